"""Guards for every test in this folder: a hard timeout, and no child process left behind.

* ``HARD_TIMEOUT`` seconds (a module may set its own): SIGALRM raises in the test; if the test is
  stuck in C code and cannot take it, faulthandler dumps every stack and ends pytest 15 s later.
* After each test, no process whose parent is pytest may remain (ParallelGroup must reap every
  worker); leftovers fail the test and are killed so that one failure does not cascade.
"""

import faulthandler
import os
import signal
import sys

import pytest
from parallel_helpers import child_pids

HARD_TIMEOUT = 40


class HardTimeout(Exception):
    pass


@pytest.fixture(autouse=True)
def hard_timeout(request):
    seconds = getattr(request.module, "HARD_TIMEOUT", HARD_TIMEOUT)

    def on_alarm(signum, frame):
        raise HardTimeout(f"{request.node.nodeid} ran past its hard timeout of {seconds}s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    faulthandler.dump_traceback_later(seconds + 15, exit=True, file=sys.stderr)
    try:
        yield
    finally:
        signal.alarm(0)
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGALRM, old)


@pytest.fixture(autouse=True)
def no_leaked_children(hard_timeout):
    before = set(child_pids())
    yield
    leaked = [p for p in child_pids() if p not in before]
    for pid in leaked:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
    assert not leaked, f"child processes left behind by the test: {leaked}"
