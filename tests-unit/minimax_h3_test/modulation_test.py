"""RMSNorm + adaLN modulation: the fused path (comfy_kitchen rms_adaln, the norm weight folded into
the scale) against the unfused ops upstream runs.

The fused path is what CUDA runs; here it is forced on CPU, where comfy_kitchen's eager backend
computes the same formula, so the folding, the largest-segment pass and the per-segment redo are
all checked without a GPU. fp32 tolerance: 1e-5 relative to the largest output.
"""

import pytest
import torch

from comfy.ldm.minimax_h3 import kernels
from comfy.ldm.minimax_h3.modulation import norm_scale_shift
from h3_cases import plan_for, tiny_model


def _norm(hidden, seed):
    norm = torch.nn.RMSNorm(hidden, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.3 * torch.randn(hidden, generator=torch.Generator().manual_seed(seed)))
    return norm


def _by_hand(weight, eps, x, shift, scale, segments):
    """The unfused formula written out: rmsnorm(x) * weight, then * (1 + scale[row]) + shift[row] on each
    segment's rows (rows of no segment keep the norm alone)."""
    h = torch.nn.functional.rms_norm(x, x.shape[-1:], weight, eps)
    for a, b, row in segments:
        h[a:b] = h[a:b] * (1.0 + scale[row]) + shift[row]
    return h


@pytest.mark.parametrize("segments", [[(0, 5, 2), (5, 9, 0), (9, 40, 1)], [(0, 40, 3)], [(0, 3, 1), (3, 30, 0), (30, 40, 1)]])
def test_fused_matches_unfused(monkeypatch, segments):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 32, generator=g)
    shift, scale = torch.randn(4, 32, generator=g), 0.2 * torch.randn(4, 32, generator=g)
    norm = _norm(32, 1)
    with torch.no_grad():
        ref = _by_hand(norm.weight, norm.eps, x, shift, scale, segments)
        monkeypatch.setattr(kernels, "fused_adaln", lambda t: True)
        got = norm_scale_shift(norm, x, shift, scale, segments)
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_unfused_on_cpu_and_when_rows_are_not_covered(monkeypatch):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 16, generator=g)
    shift, scale = torch.randn(2, 16, generator=g), torch.randn(2, 16, generator=g)
    norm = _norm(16, 2)
    full, gaps = [(0, 6, 0), (6, 10, 1)], [(0, 4, 0), (6, 10, 1)]
    with torch.no_grad():
        # CPU: the unfused ops, bit for bit (every row covered, so only the device keeps the fused kernel out)
        assert torch.equal(norm_scale_shift(norm, x, shift, scale, full), _by_hand(norm.weight, norm.eps, x, shift, scale, full))
        monkeypatch.setattr(kernels, "fused_adaln", lambda t: True)
        # rows 4..5 carry no modulation: the fused whole-row pass would modulate them, so the ops stay unfused
        assert torch.equal(norm_scale_shift(norm, x, shift, scale, gaps), _by_hand(norm.weight, norm.eps, x, shift, scale, gaps))
        # a forward-time weight patch (ComfyUI's low-VRAM LoRA path) lives in the norm's own forward: unfused
        patched_norm = _norm(16, 2)
        patched_norm.weight_function = [lambda w: w * 2.0]
        patched_norm.forward = lambda t: torch.nn.functional.rms_norm(t, (16,), patched_norm.weight_function[0](patched_norm.weight), 1e-6)
        expect = _by_hand(2.0 * patched_norm.weight, 1e-6, x, shift, scale, full)
        assert torch.equal(norm_scale_shift(patched_norm, x, shift, scale, full), expect)


@pytest.mark.parametrize("kind", ["tags", "refs_all"])
def test_model_forward_fused_matches_unfused(monkeypatch, kind):
    model, cfg = tiny_model()
    case = plan_for(model, cfg, kind)
    with torch.no_grad():
        ref = case.forward(model)
        monkeypatch.setattr(kernels, "fused_adaln", lambda t: True)
        got = case.forward(model)
    for r, o in zip(ref, got):
        assert (o - r).abs().max() <= 1e-5 * r.abs().max()
