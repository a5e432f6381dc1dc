"""The errors of comfy.parallel. Their text is for people: a sentence or two, the rank, what to do, the log.

``ParallelStateError``: a call in the wrong lifecycle state, nothing happened. ``PreflightMismatch``,
``ParallelCancelled``: raised on every rank at one agreement point, the group stays ready (unless
``group_broken``). ``ParallelGroupError`` (``ParallelTimeout``, ``ParallelOpError``): a rank died, hung or
failed; the group is broken until ``close()`` and ``start()`` (``ensure_started()`` does both).
"""

import signal

RESTART_HINT = "close() and start() the group again (ensure_started() does both)"
_EXIT_CODES = {3: " (it rejected a control frame)", 6: " (start-up failed; traceback in its log)", 7: " (traceback in its log)"}


def describe_exit(code):
    if code < 0:
        return f"was killed by {signal.Signals(-code).name if -code in signal.valid_signals() else f'signal {-code}'}"
    return f"exited with code {code}{_EXIT_CODES.get(code, '')}"


class ParallelError(RuntimeError):
    pass


class ParallelStateError(ParallelError):
    def __init__(self, message, state=None):
        self.state = state
        super().__init__(message)


class PreflightMismatch(ParallelError):
    def __init__(self, message, values=()):
        self.values = list(values)
        super().__init__(message)


class ParallelCancelled(ParallelError):
    def __init__(self, message, group_broken=False):
        self.group_broken = group_broken
        super().__init__(message)


class ParallelGroupError(ParallelError):
    """A rank failed; the group is broken. ``rank`` (0 = this process), ``exitcode`` (a worker's, or None),
    ``log_path`` (that rank's log, whose end goes to this process's log, not into the text)."""

    def __init__(self, reason, rank=None, exitcode=None, log_path=None, hint=RESTART_HINT, remote_traceback=""):
        self.reason, self.rank, self.exitcode, self.log_path, self.hint = reason, rank, exitcode, log_path, hint
        self.remote_traceback = remote_traceback
        super().__init__(f"{reason}; {hint}." + (f" Log: {log_path}" if log_path else ""))

    def again(self):
        """The same fault, for a later call on the broken group."""
        return type(self)(f"the parallel group is broken: {self.reason}", self.rank, self.exitcode, self.log_path, self.hint,
                          self.remote_traceback)


class ParallelTimeout(ParallelGroupError):
    """A rank missed a deadline or did not reach a collective its peers waited in; it was killed."""


class ParallelOpError(ParallelGroupError):
    """An op raised on ``rank``; ``remote_traceback`` is its traceback (also in its log)."""
