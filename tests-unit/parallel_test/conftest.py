"""Guards for every test in this folder: Linux only, a hard timeout, and no child process left behind.

Self-contained: it needs nothing from a root conftest.
"""

import faulthandler
import os
import signal
import sys

import pytest

HARD_TIMEOUT = 60

if not sys.platform.startswith("linux"):
    collect_ignore_glob = ["*_test.py"]  # comfy.parallel runs worker processes on Linux only (pidfd, /proc)
else:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from parallel_helpers import child_pids

    @pytest.fixture(autouse=True)
    def hard_deadline(request):
        """SIGALRM raises in the test; a test stuck in C code gets its stacks dumped and pytest ended 15 s later."""
        seconds = getattr(request.module, "HARD_TIMEOUT", HARD_TIMEOUT)

        def on_alarm(signum, frame):
            raise TimeoutError(f"{request.node.nodeid} ran past its hard timeout of {seconds}s")

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
    def no_leaked_children(hard_deadline):
        """ParallelGroup must reap every worker; leftovers fail the test and are killed."""
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
