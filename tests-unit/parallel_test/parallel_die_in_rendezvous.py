"""A worker-spec import that kills its worker inside the process-group rendezvous.

In a worker started with ``PARALLEL_TEST_DIE_IN_RENDEZVOUS=1`` (``start(env=...)`` reaches the
workers only) it replaces ``pg.init_groups``: the worker replies "connected", waits until rank 0 has
begun the rendezvous (the store is fresh every start, so its first key is rank 0's) and kills itself,
leaving rank 0 inside ``init_process_group``. Rank 0 imports this module too and is left alone.
"""

import os
import signal
import time

from comfy.parallel import pg

if os.environ.get("PARALLEL_TEST_DIE_IN_RENDEZVOUS") == "1":
    def _die_in_rendezvous(backend, store, rank, world_size, device, timeouts):
        while store.num_keys() == 0:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)

    pg.init_groups = _die_in_rendezvous
