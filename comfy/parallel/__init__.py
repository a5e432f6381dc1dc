"""comfy.parallel: a model-agnostic owner of worker processes and process groups.

ComfyUI (rank 0) holds one ``ParallelGroup`` per loaded model; ranks 1..N-1 are worker processes,
one device each. Model packages register ops (``register_op``) that run on every rank.
"""

from .config import Timeouts
from .errors import (
    ParallelCancelled,
    ParallelError,
    ParallelGroupError,
    ParallelOpError,
    ParallelStateError,
    ParallelTimeout,
    PreflightMismatch,
    ProtocolError,
    UnknownOpError,
    WorkerSpecError,
)
from .group import ParallelGroup
from .registry import OpContext, OpResult, register_op, registered_ops, unregister_op
from .state import GroupState

__all__ = [
    "GroupState",
    "OpContext",
    "OpResult",
    "ParallelCancelled",
    "ParallelError",
    "ParallelGroup",
    "ParallelGroupError",
    "ParallelOpError",
    "ParallelStateError",
    "ParallelTimeout",
    "PreflightMismatch",
    "ProtocolError",
    "Timeouts",
    "UnknownOpError",
    "WorkerSpecError",
    "register_op",
    "registered_ops",
    "unregister_op",
]
