"""Step inputs round-trip through tensors + JSON and refuse what cannot be replicated."""

import json

import pytest
import torch

from comfy.ldm.minimax_h3.layout import PackedLayout
from comfy.ldm.minimax_h3.step_io import StepInputs
from h3_files import INPUT_KINDS, TINY_CONFIG, step_inputs


@pytest.mark.parametrize("kind", INPUT_KINDS)
def test_round_trip_every_conditioning_kind(kind):
    x, t, c, p = step_inputs(TINY_CONFIG, kind, audio_scale=0.7)
    p["layout"] = PackedLayout(c.shape[1], *x[0].shape[2:], x[1].shape[-1], keyframes=p.get("keyframes"), refs=p.get("refs"))
    opts = {"minimax_h3_sigma_shift_audio": 4.0, "wrappers": {}, "sigmas": torch.ones(3)}
    tensors, meta = StepInputs(x[0], x[1], t, c, p, opts).encode()
    meta = json.loads(json.dumps(meta))  # what crosses is plain JSON
    got = StepInputs.decode(tensors, meta)
    assert torch.equal(got.video, x[0]) and torch.equal(got.audio, x[1]) and torch.equal(got.timestep, t) and torch.equal(got.context, c)
    assert got.options == {"minimax_h3_sigma_shift_audio": 4.0}
    p2 = got.payload
    assert "layout" not in p2 and set(p2) == set(p) - {"layout"}
    for key in ("keyframes", "refs"):
        for a, b in zip(p.get(key, []), p2.get(key, [])):
            assert set(a) == set(b)
            for k in a:
                assert torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k]
    if "text_token_tags" in p:
        assert torch.equal(p2["text_token_tags"], p["text_token_tags"])


def test_unsendable_payload_and_options_are_refused():
    x, t, c, p = step_inputs(TINY_CONFIG, "t2va")
    with pytest.raises(TypeError, match=r"minimax_payload.extra is a object"):
        StepInputs(x[0], x[1], t, c, dict(p, extra=object())).encode()
    with pytest.raises(ValueError, match=r"block replacement patches \[\"\('double_block', 3\)\"\]"):
        StepInputs(x[0], x[1], t, c, p, {"patches_replace": {"dit": {("double_block", 3): None}}}).encode()
    tensors, meta = StepInputs(x[0], x[1], t, c, p).encode()
    with pytest.raises(ValueError, match="version 99"):
        StepInputs.decode(tensors, dict(meta, version=99))


@pytest.mark.comfyui
def test_attention_override_travels_by_registered_name_or_is_refused(comfyui_models):
    """The override ModelAttentionBackend installs maps back to its registered backend; anything else is refused."""
    import types

    import comfy.ldm.modules.attention as attention
    import comfy.model_patcher
    from comfy.parallel import headless
    for name in ("pytorch", "split", "sub_quad"):
        holder = types.SimpleNamespace(model_options={"transformer_options": {}})
        comfy.model_patcher.ModelPatcher.set_model_optimized_attention(holder, attention.get_attention_function(name))
        assert headless.attention_name(holder.model_options["transformer_options"]["optimized_attention_override"]) == name
    with pytest.raises(ValueError, match="not one of ComfyUI's registered attention functions"):
        headless.attention_name(lambda func, *args, **kwargs: func(*args, **kwargs))

