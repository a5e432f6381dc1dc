"""``GroupState`` and ``GroupCore``: the state of one ParallelGroup and its only writer.

``group.py`` (lifecycle), ``runner.py`` (ops) and ``monitor.py`` (replies, exits, deadlines) share
one ``GroupCore``; every state change and the fault that breaks the group go through its methods.
"""

import logging
import threading
from enum import Enum

from .errors import ParallelGroupError, ParallelStateError

logger = logging.getLogger(__name__)


class GroupState(str, Enum):
    """Lifecycle of a ParallelGroup (``group.state``; equal to its value, e.g. ``"ready"``).

    * ``IDLE``: never started. ``start()`` -> ``STARTING``.
    * ``STARTING``: spawn, rendezvous, probe, setup. Every worker ready -> ``READY``.
    * ``READY``: the workers wait for an op. ``run()`` -> ``RUNNING``.
    * ``RUNNING``: one op in flight. Every rank left it alike (result, cancel, preflight mismatch) -> ``READY``.
    * ``BROKEN``: a fault while ``STARTING``, ``READY`` or ``RUNNING``; every worker was killed and
      ``group.error`` says why. Only ``close()`` leaves it.
    * ``CLOSING``: ``close()``, from any state. -> ``CLOSED``.
    * ``CLOSED``: everything torn down. ``start()`` -> ``STARTING``; ``close()`` again changes nothing.
    """
    IDLE = "idle"
    STARTING = "starting"
    READY = "ready"
    RUNNING = "running"
    BROKEN = "broken"
    CLOSING = "closing"
    CLOSED = "closed"

    def __str__(self):
        return self.value


ACTIVE = (GroupState.STARTING, GroupState.READY, GroupState.RUNNING)
ENDING = (GroupState.CLOSING, GroupState.CLOSED)


class GroupCore:
    """What rank 0's lifecycle, op runner and monitor share.

    ``cond`` (reentrant) guards ``state``, ``error`` and ``op`` (the op in flight) and wakes whoever
    waits for a reply, a fault or a state; ``send_lock`` keeps one writer per worker pipe; ``quiet``
    is set while no ``start()`` or ``run()`` is in flight.
    """

    def __init__(self, name, timeouts):
        self.name = name
        self.timeouts = timeouts
        self.cond = threading.Condition(threading.RLock())
        self.send_lock = threading.Lock()
        self.quiet = threading.Event()
        self.quiet.set()
        self.state = GroupState.IDLE
        self.error = None
        self.op = None
        self.workers = []
        self.log_dir = None

    def set_state(self, state):
        with self.cond:
            self.state = state
            if state == GroupState.STARTING:
                self.error = None
            self.cond.notify_all()

    def begin_op(self, op):
        """READY -> RUNNING with ``op`` in flight; raises (nothing changed) in any other state."""
        with self.cond:
            if self.state != GroupState.READY:
                raise self.not_ready("run()")
            self.op = op
            self.quiet.clear()
            self.set_state(GroupState.RUNNING)

    def end_op(self, op):
        """``op`` is over on rank 0: RUNNING -> READY unless a fault or close() came first."""
        with self.cond:
            op.finished = True
            if self.op is op:
                self.op = None
            if self.state == GroupState.RUNNING:
                self.set_state(GroupState.READY)
            self.cond.notify_all()
        self.quiet.set()

    def not_ready(self, what):
        """The error for ``what`` (e.g. "run()") called in a state that does not allow it."""
        if self.state == GroupState.BROKEN and self.error is not None:
            return self.error.again()
        if self.state == GroupState.RUNNING:
            return ParallelStateError(f"{what}: group {self.name!r} is already running an op; it runs one op at a time", self.state)
        return ParallelStateError(f"{what} needs a ready group; group {self.name!r} is {self.state}"
                                  + ("; call start() first" if self.state in (GroupState.IDLE, GroupState.CLOSED) else ""),
                                  self.state)

    def fault(self, err):
        """Keep the first fault, mark the group broken, kill every worker. Returns the fault kept."""
        with self.cond:
            if self.state in ENDING:
                return self.error or err
            if self.error is None:
                self.error = err.with_log_dir(self.log_dir)
                logger.error("parallel group %r broken: %s", self.name, err.reason)
            if self.state in ACTIVE:
                self.state = GroupState.BROKEN
            self.cond.notify_all()
            kept = self.error
        self.kill_workers()
        return kept

    def attribute(self, exc, make_error, grace=0.5):
        """What to raise for ``exc`` raised on rank 0; the group is broken either way.

        A worker's fault recorded within ``grace`` seconds wins: a peer's death usually reaches rank 0
        as a transport error before the monitor has reaped it. A KeyboardInterrupt or SystemExit is
        returned as it is (after the workers are stopped), anything else becomes ``make_error()``.
        """
        if isinstance(exc, ParallelGroupError):
            return self.fault(exc)
        if isinstance(exc, Exception):
            with self.cond:
                self.cond.wait_for(lambda: self.error is not None, timeout=grace)
                if self.error is not None:
                    return self.error
            return self.fault(make_error())
        self.fault(ParallelGroupError(f"rank 0 was interrupted ({type(exc).__name__})", rank=0))
        return exc

    def kill_workers(self):
        for w in list(self.workers):
            w.kill()
