"""Overlay: our MiniMaxH3Model against upstream's comfy.ldm.minimax.model at the pinned base.

Same tiny random weights through the state dict, same inputs, both built with ComfyUI's ops and
kernels. fp32 must agree to 1e-5 (max abs, outputs are O(1)); in practice they agree bit for bit.
"""

import pytest
import torch

from h3_files import INPUT_KINDS, TINY_CONFIG, random_state_dict, step_inputs

pytestmark = pytest.mark.comfyui


def _pair(dtype, curve=None):
    import comfy.ldm.minimax.model as upstream
    import comfy.ops
    from comfy.ldm.minimax_h3.model import MiniMaxH3Model
    if upstream.MiniMaxH3Model is MiniMaxH3Model:
        pytest.skip("comfy.ldm.minimax.model re-exports this package (patched tree): there is no upstream model to compare")
    cfg = dict(TINY_CONFIG, adaln_curve_grid=curve)
    ops = comfy.ops.disable_weight_init
    theirs = upstream.MiniMaxH3Model(**cfg, dtype=dtype, operations=ops).requires_grad_(False)
    ours = MiniMaxH3Model(**cfg, dtype=dtype, operations=ops).requires_grad_(False)
    sd = random_state_dict(theirs, seed=3)
    theirs.load_state_dict(sd)
    ours.load_state_dict(sd)
    return theirs, ours, cfg


def _both(theirs, ours, cfg, kind, opts=None, dtype=torch.float32, **kw):
    x, t, c, p = step_inputs(cfg, kind, **kw)
    c = c.to(dtype)
    # upstream writes into transformer_options: each model gets its own copy
    a = theirs(x, t, c, dict(opts or {}), minimax_payload=dict(p))
    b = ours(x, t, c, dict(opts or {}), minimax_payload=dict(p))
    return a, b


@pytest.mark.parametrize("curve", [None, 9])
@pytest.mark.parametrize("kind", INPUT_KINDS)
@pytest.mark.parametrize("audio_scale", [1.0, 0.7])
def test_forward_matches_upstream_fp32(comfyui_dir, kind, curve, audio_scale):
    theirs, ours, cfg = _pair(torch.float32, curve)
    a, b = _both(theirs, ours, cfg, kind, audio_scale=audio_scale, height=5)
    for u, v in zip(a, b):
        assert u.shape == v.shape and u.dtype == v.dtype
        assert float((u - v).abs().max()) <= 1e-5


def test_state_dicts_identical(comfyui_dir):
    for curve in (None, 9):
        theirs, ours, _ = _pair(torch.bfloat16, curve)
        a, b = theirs.state_dict(), ours.state_dict()
        assert list(a) == list(b)
        assert all(a[k].shape == b[k].shape and a[k].dtype == b[k].dtype for k in a)


def test_prebuilt_upstream_layout_is_accepted(comfyui_dir):
    import comfy.ldm.minimax.model as upstream
    theirs, ours, cfg = _pair(torch.float32)
    x, t, c, p = step_inputs(cfg, "refs_all")
    # model_base.extra_conds of the unpatched base hands the model upstream's layout object
    p["layout"] = upstream.PackedLayout(c.shape[1], x[0].shape[2], x[0].shape[3], x[0].shape[4], x[1].shape[-1], refs=p["refs"])
    a = theirs(x, t, c, {}, minimax_payload=dict(p))
    b = ours(x, t, c, {}, minimax_payload=dict(p))
    assert all(float((u - v).abs().max()) <= 1e-5 for u, v in zip(a, b))


def test_block_patch_and_wrapper_match_upstream(comfyui_dir):
    import comfy.patcher_extension as pe
    theirs, ours, cfg = _pair(torch.float32)

    def patch(args, extra):
        # blocks update their input in place, so scale the result rather than mixing with the input
        return {"img": extra["original_block"](args)["img"] * 0.5}

    seen = []

    def wrapper(executor, x, timestep, context, transformer_options, **kwargs):
        seen.append(type(executor.class_obj).__module__)
        out = executor(x, timestep, context, transformer_options, **kwargs)
        return [out[0] * 2.0, out[1]]

    opts = {"patches_replace": {"dit": {("double_block", 0): patch}}}
    pe.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, "test", wrapper, opts)
    a, b = _both(theirs, ours, cfg, "tags", opts=opts)
    assert seen == ["comfy.ldm.minimax.model", "comfy.ldm.minimax_h3.model"]
    for u, v in zip(a, b):
        assert float((u - v).abs().max()) <= 1e-5
    plain = ours(*step_inputs(cfg, "tags")[:3], {}, minimax_payload=step_inputs(cfg, "tags")[3])
    assert not torch.allclose(plain[0] * 2.0, b[0])


@pytest.mark.parametrize("kind", ["t2va", "keyframes"])
def test_forward_matches_upstream_bf16(comfyui_dir, kind):
    theirs, ours, cfg = _pair(torch.bfloat16)
    a, b = _both(theirs, ours, cfg, kind, dtype=torch.bfloat16)
    for u, v in zip(a, b):
        assert torch.equal(u, v), f"bf16 max diff {float((u.float() - v.float()).abs().max())}"
