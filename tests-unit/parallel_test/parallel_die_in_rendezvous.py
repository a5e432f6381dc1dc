"""A worker-spec import that kills its worker inside the process-group rendezvous.

In a worker started with ``PARALLEL_TEST_DIE_IN_RENDEZVOUS=1`` (``start(env=...)`` reaches the
workers only) it wraps ``process_groups.file_store`` to count the keys of the fresh store before the worker
replies "connected" (rank 0 writes nothing before that reply), and replaces
``process_groups.init_groups``: the
worker waits until a key appears (rank 0 has begun the rendezvous) and kills itself, leaving rank 0
inside ``init_process_group``. Rank 0 imports this module too and is left alone.
"""

import os
import signal
import time

from comfy.parallel import process_groups

if os.environ.get("PARALLEL_TEST_DIE_IN_RENDEZVOUS") == "1":
    _file_store = process_groups.file_store
    _keys_at_open = []

    def _counting_file_store(*args, **kwargs):
        store = _file_store(*args, **kwargs)
        _keys_at_open.append(store.num_keys())
        return store

    def _die_in_rendezvous(backend, store, rank, world_size, device, timeouts):
        while store.num_keys() == _keys_at_open[0]:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)

    process_groups.file_store = _counting_file_store
    process_groups.init_groups = _die_in_rendezvous
