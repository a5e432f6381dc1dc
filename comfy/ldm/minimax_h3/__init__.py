"""MiniMax H3 audio-video DiT as one model package.

``__all__`` is the versioned extension interface: ``H3_EXTENSION_API`` (major, minor) gets a minor
bump for additive changes, a major one for anything else. Names are imported on first use, so
importing the package stays cheap. Modules marked "Internal." in their docstring are not part of it.
"""

import importlib
import typing

H3_EXTENSION_API = (1, 0)

_EXPORTS = {
    "MiniMaxH3Model": "model", "SEQUENCE_PARALLEL_OPTION": "model", "StepInputs": "step_io",
    "ForwardPlan": "plan", "ShardPlan": "plan",
    "PackedLayout": "layout",
    "TimestepPlan": "conditioning", "text_tag_runs": "conditioning", "mod_segments": "conditioning",
    "curve_t_emb": "conditioning",
    "clip_segments": "modulation", "mod_scale_shift": "modulation", "mod_gate": "modulation",
    "norm_scale_shift": "modulation",
}

__all__ = ["H3_EXTENSION_API", "SequenceParallelRunner", *_EXPORTS]


@typing.runtime_checkable
class SequenceParallelRunner(typing.Protocol):
    """What ``MiniMaxH3Model.run(plan, shard, inputs, seq_parallel=runner)`` calls on a sharded step.

    A runner may also provide ``adaln_projections(projections, t_emb)``: the list of every block's
    ``AdalnProj.project(t_emb)``, computed once for all ranks (``DiTBlock`` takes one as ``adaln=``);
    without it every rank projects every block itself.
    """

    world_size: int

    def attention(self, qkv, transformer_options, prepare=None):
        """[rows, 3, heads, head_dim] this rank's q|k|v -> [rows, heads * head_dim] attention output.

        With ``prepare``, the q and k of heads [a, b) are ready only once ``prepare(a, b)`` has run
        (H3 norms and ropes them in place); the runner calls it for every head before sending it.
        """
        ...


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)


def __dir__():
    return sorted(set(globals()) | set(__all__))
