"""Imported by the workers of the fault tests: ``PARALLEL_TEST_DIE=<phase>`` (``start(env=...)`` reaches the
workers only) makes rank 1 SIGKILL itself at that phase of its start-up, with rank 0 inside it too.

* ``rendezvous``: once another rank has written to the fresh store (the rendezvous has begun), before
  this rank writes anything;
* ``groups``: once gloo listens in this rank, while it publishes its address and connects the ranks;
* ``probe``: inside the probe's first all_reduce.
"""

import os
import signal
import sys
import threading
import time

import torch.distributed as dist
from parallel_helpers import listening_sockets

from comfy.parallel import ops

# sys.argv of a worker: -c, the path list, its rank, ...
PHASE = os.environ.get("PARALLEL_TEST_DIE") if sys.argv[2:3] == ["1"] else None


def die():
    os.kill(os.getpid(), signal.SIGKILL)


if PHASE in ("rendezvous", "groups"):
    _init = ops.init_groups

    def init_groups(store_path, *args):
        if PHASE == "rendezvous":
            while not os.path.exists(store_path) or not os.path.getsize(store_path):
                time.sleep(0.005)
            die()

        def kill_when_listening():
            # gloo listens before it publishes its address and connects to its peers
            while not listening_sockets([os.getpid()]):
                time.sleep(0.005)
            die()
        threading.Thread(target=kill_when_listening, daemon=True).start()
        return _init(store_path, *args)

    ops.init_groups = init_groups

if PHASE == "probe":
    _all_reduce = dist.all_reduce

    def all_reduce(*args, **kwargs):
        kwargs["async_op"] = True
        _all_reduce(*args, **kwargs)
        die()

    dist.all_reduce = all_reduce
