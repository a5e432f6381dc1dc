"""comfy.parallel: a model-agnostic owner of worker processes and process groups.

ComfyUI (rank 0) holds one ``ParallelGroup`` for the life of a loaded model; ranks 1..N-1 are
worker processes, each owning one device. Model packages register ops (``register_op``) that run
on every rank; ``ParallelGroup.run`` broadcasts rank 0's inputs and returns rank 0's outputs and
every rank's meta. See ``group.py`` for the lifecycle, ``runner.py`` for one op and its
cancellation rule, ``protocol.py`` for the wire format.

Example (a model package registers its op at import; rank 0 holds the group)::

    @register_op("h3.forward")
    def forward(ctx, tensors, meta):             # runs on every rank
        model = ctx.state["model"]               # built once by setup on workers, local_state on rank 0
        plan = build_plan(tensors, meta)
        ctx.preflight(plan.digest())             # every rank agrees before the first data collective
        out = model.run(plan, shard=ctx.rank, group=ctx.data_group)
        return ({"velocity": out} if ctx.rank == 0 else {}), {"rank": ctx.rank}

    group = ParallelGroup("h3")
    group.start(["cuda:0", "cuda:1"], {"imports": ["my_pkg.h3_ops"], "setup": "my_pkg.h3_ops:build",
                                      "setup_args": {"checkpoint": "/models/h3.safetensors"}},
                local_state={"model": rank0_model})
    result = group.run("h3.forward", {"x": x, "sigma": sigma}, {"step": 3})   # result.tensors["velocity"]
    group.close()
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
from .ops import OpContext, OpResult, register_op, registered_ops, unregister_op
from .protocol import Limits

__all__ = [
    "Limits",
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
