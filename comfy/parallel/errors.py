"""Typed errors of the process-group owner, and the workers' exit codes.

Every error names the rank it is about (``rank``; 0 is the calling process) and ends with what to do.
"""

import signal

# Worker exit codes (part of the worker contract; rank 0 turns them into words).
EXIT_OK = 0
EXIT_PROTOCOL = 3
EXIT_PARENT_GONE = 4
EXIT_STARTUP = 6
EXIT_INTERNAL = 7

_EXIT_MEANING = {
    EXIT_OK: "exited normally",
    EXIT_PROTOCOL: "rejected a control message (see its log for which check failed)",
    EXIT_PARENT_GONE: "lost its control channel to rank 0",
    EXIT_STARTUP: "failed during start-up (import, rendezvous, probe or setup; traceback in its log)",
    EXIT_INTERNAL: "hit an internal error in the worker loop (traceback in its log)",
}

RESTART_HINT = "call close() and then start() again (ParallelGroup.ensure_started() does both)"


def describe_exit(exitcode):
    """Exit code -> words, e.g. -9 -> 'was killed by SIGKILL (signal 9; the OOM killer also sends this)'."""
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        extra = "; the OOM killer also sends this" if exitcode == -signal.SIGKILL else ""
        return f"was killed by {name} (signal {-exitcode}{extra})"
    return f"exited with code {exitcode} ({_EXIT_MEANING.get(exitcode, 'unexpected code')})"


class ParallelError(RuntimeError):
    """Base class of every error raised by comfy.parallel. The split that matters to callers:

    * ``ParallelStateError``: the call was made in the wrong lifecycle state; nothing happened.
    * ``PreflightMismatch`` and ``ParallelCancelled``: raised on every rank at the same agreement point,
      so the group is still consistent and stays ``ready`` (unless ``group_broken`` says otherwise).
    * ``ParallelGroupError`` (and its ``ParallelTimeout`` / ``ParallelOpError``): a rank died, hung or
      failed mid-op; collectives may be out of step, so the group is ``broken`` until ``close()`` and a
      new ``start()`` (``ParallelGroup.ensure_started()`` does both).
    """


class ParallelStateError(ParallelError):
    """A call that the group's current lifecycle state does not allow; the group is unchanged."""

    def __init__(self, message, state=None):
        self.state = state
        super().__init__(message)


class WorkerSpecError(ParallelError, ValueError):
    """``worker_spec`` (or the device list) is malformed; raised before any process is spawned."""


class ProtocolError(ParallelError):
    """A control message failed a check (magic, version, size, MAC, kind, schema, order)."""


class UnknownOpError(ParallelError, KeyError):
    """No op of that name is registered in this process."""

    def __str__(self):
        return str(self.args[0]) if self.args else ""


class PreflightMismatch(ParallelError):
    """Ranks disagree before a data collective; raised on every rank. ``values[r]`` is rank r's view."""

    def __init__(self, message, values=None):
        self.values = list(values or [])
        super().__init__(message)


class ParallelCancelled(ParallelError):
    """The op was cancelled. ``group_broken`` is True when a rank had to be killed to get there."""

    def __init__(self, message, group_broken=False):
        self.group_broken = group_broken
        super().__init__(message)


class ParallelGroupError(ParallelError):
    """A rank failed; the group is broken.

    ``rank``: the rank at fault (0 = this process), ``exitcode``: its exit code (None while it runs
    or for rank 0), ``log_tail``: the end of that rank's log, ``log_path``: the whole log,
    ``log_dir``: the folder of every worker's log (``close()`` keeps it after a fault).
    """

    def __init__(self, reason, rank=None, exitcode=None, log_tail="", log_path=None, hint=RESTART_HINT, log_dir=None):
        self.reason = reason
        self.rank = rank
        self.exitcode = exitcode
        self.log_tail = log_tail or ""
        self.log_path = log_path
        self.log_dir = log_dir
        self.hint = hint
        super().__init__(self._format())

    def _format(self):
        text = self.reason
        if self.hint:
            text += f"\nWhat to do: {self.hint}."
        if self.log_dir:
            text += f"\nWorker logs (kept after close()): {self.log_dir}"
        if self.log_path:
            text += f"\nLog of rank {self.rank}: {self.log_path}"
        if self.log_tail:
            text += f"\n--- last lines of rank {self.rank}'s log ---\n{self.log_tail.rstrip()}\n---"
        return text

    def with_log_dir(self, log_dir):
        """This error, naming ``log_dir`` as its workers' log folder unless it names one already."""
        if self.log_dir is None and log_dir is not None:
            self.log_dir = log_dir
            self.args = (self._format(),)
        return self

    def again(self):
        """A fresh error with the same facts, for re-raising on a later call (keeps tracebacks short)."""
        err = type(self).__new__(type(self))
        err.__dict__.update(self.__dict__)
        err.reason = f"the parallel group is broken: {self.reason}"
        ParallelError.__init__(err, err._format())
        return err


class ParallelTimeout(ParallelGroupError):
    """A deadline passed (start-up, op or cancel acknowledgement); the late ranks were killed."""


class ParallelOpError(ParallelGroupError):
    """An op raised on ``rank``; ``remote_traceback`` is that rank's traceback (text)."""

    def __init__(self, reason, rank=None, remote_traceback="", **kwargs):
        self.remote_traceback = remote_traceback or ""
        super().__init__(reason, rank=rank, **kwargs)

    def _format(self):
        text = super()._format()
        if self.remote_traceback:
            text += f"\n--- traceback on rank {self.rank} ---\n{self.remote_traceback.rstrip()}"
        return text
