"""adaLN modulation over mod segments: [(start, stop, mod_row)] covering the rows a rank holds.

mod_row is one row of the [M, hidden] modulation tensors, or a [stop - start] LongTensor giving each
row its own (target rows a denoise mask runs at several timesteps).

Segments are global on a ForwardPlan and rebased to local row coordinates on a ShardPlan; the ops
below only ever see local segments, so they are the same for native and sharded runs.
"""

import torch

import comfy.model_management

from . import kernels


def clip_segments(segments, start, stop):
    """Segments intersected with rows [start, stop) and rebased so that row `start` becomes 0."""
    out = []
    for a, b, row in segments:
        a2, b2 = max(a, start), min(b, stop)
        if a2 < b2:
            out.append((a2 - start, b2 - start, row[a2 - a:b2 - a] if isinstance(row, torch.Tensor) else row))
    return out


def mod_scale_shift(h, shift, scale, segments):
    """h[rows] = h * (1 + scale[row]) + shift[row], in place, one fused pair of kernels per segment."""
    for a, b, row in segments:
        h[a:b].mul_(1.0 + scale[row].to(h.dtype)).add_(shift[row].to(h.dtype))
    return h


def mod_gate(x, gate, other, segments):
    """x[rows] += other[rows] * gate[row], in place: the gated residual of a fresh attn/mlp output."""
    for a, b, row in segments:
        x[a:b].addcmul_(other[a:b], gate[row].to(x.dtype))
    return x


def norm_scale_shift(norm, x, shift, scale, segments):
    """mod_scale_shift(norm(x), shift, scale, segments) as a new tensor, for an RMSNorm `norm`.

    Where kernels.fused_adaln(x) holds, one comfy_kitchen RMSNorm+adaLN pass over all rows with the
    largest segment's modulation, then the other segments' rows redone with theirs, replaces the
    norm and two broadcast passes over every row. The norm weight is folded into the scale:
    rmsnorm(x) * w * (1 + s) + b == rmsnorm(x) * (1 + (w * (1 + s) - 1)) + b.
    """
    covered = sum(b - a for a, b, _ in segments) == x.shape[0]
    # a norm with forward-time weight patches (ComfyUI's low-VRAM LoRA path) must run its own forward
    patched = bool(getattr(norm, "weight_function", None)) or bool(getattr(norm, "bias_function", None))
    # per-row modulation (masked rows) has no fused kernel: the kernel takes one scale/shift vector
    per_row = any(isinstance(row, torch.Tensor) for _, _, row in segments)
    if not kernels.fused_adaln(x) or not covered or patched or per_row or getattr(norm, "eps", None) is None or norm.weight is None:
        return mod_scale_shift(norm(x), shift, scale, segments)
    # every mod row folded at once (a handful of [M, hidden] kernels; per-row folding costs launches that show at small shards)
    w = comfy.model_management.cast_to(norm.weight, dtype=torch.float32, device=x.device)
    scale = (w * (1.0 + scale.float()) - 1.0).to(x.dtype)
    shift = shift.to(x.dtype)
    big = max(segments, key=lambda seg: seg[1] - seg[0])[2]
    out = kernels.rms_adaln(x, scale[big], shift[big], norm.eps)
    for a, b, row in segments:
        if row != big:
            out[a:b] = kernels.rms_adaln(x[a:b], scale[row], shift[row], norm.eps)
    return out
