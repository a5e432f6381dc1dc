"""The errors of comfy.parallel. Their text is for people: what happened, on which rank, what to do.

``ParallelStateError``: a call in the wrong lifecycle state; nothing happened. ``ParallelOpError``,
``PreflightMismatch``, ``ParallelCancelled``: the op ended on every rank and the group is ready for
the next. ``ParallelGroupError`` (``ParallelTimeout``): a worker died, hung, stopped or broke the
protocol; every worker was killed and the next ``start()`` makes new ones.
"""


class ParallelError(RuntimeError):
    pass


class ParallelStateError(ParallelError):
    pass


class PreflightMismatch(ParallelError):
    pass


class ParallelCancelled(ParallelError):
    pass


class ParallelOpError(ParallelError):
    """An op raised on worker ``rank``; ``type_name`` and ``remote_traceback`` are its exception's (also logged)."""

    def __init__(self, message, rank, type_name, remote_traceback):
        self.rank, self.type_name, self.remote_traceback = rank, type_name, remote_traceback
        super().__init__(message)


class ParallelGroupError(ParallelError):
    """A rank failed and the group is broken. ``rank``: the rank at fault (None if unknown)."""

    def __init__(self, reason, rank=None):
        self.reason, self.rank = reason, rank
        super().__init__(f"{reason}; the next run starts new workers")


class ParallelTimeout(ParallelGroupError):
    """A worker missed its op's deadline."""
