"""adaLN modulation over mod segments: [(start, stop, mod_row)] covering the rows a rank holds.

Segments are global on a ForwardPlan and rebased to local row coordinates on a ShardPlan; the ops
below only ever see local segments, so they are the same for native and sharded runs.
"""


def clip_segments(segments, start, stop):
    """Segments intersected with rows [start, stop) and rebased so that row `start` becomes 0."""
    out = []
    for a, b, row in segments:
        a2, b2 = max(a, start), min(b, stop)
        if a2 < b2:
            out.append((a2 - start, b2 - start, row))
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
