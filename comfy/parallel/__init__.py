"""comfy.parallel: ComfyUI (rank 0) holds a ``ParallelGroup`` of headless worker processes (ranks 1..N-1, one
device each) for a job; model packages register ops (``register_op``) that run on every rank."""

from .errors import ParallelCancelled, ParallelError, ParallelGroupError, ParallelOpError, ParallelStateError, ParallelTimeout, PreflightMismatch
from .group import ParallelGroup, Timeouts
from .ops import OpContext, OpResult, register_op, unregister_op
from .transport import OpAborted

__all__ = ["OpAborted", "OpContext", "OpResult", "ParallelCancelled", "ParallelError", "ParallelGroup", "ParallelGroupError",
           "ParallelOpError", "ParallelStateError", "ParallelTimeout", "PreflightMismatch", "Timeouts", "register_op",
           "unregister_op"]
