"""State-dict compatibility, input validation and checkpoint loading of MiniMaxH3Model."""

import json
import os

import pytest
import torch

from comfy.ldm.minimax_h3.model import MiniMaxH3Model
from comfy.ldm.minimax_h3.step_io import StepInputs
from h3_cases import tiny_model
from h3_files import TINY_CONFIG, step_inputs

KEYS = os.path.join(os.path.dirname(__file__), "data", "tiny_state_dict_keys.json")


@pytest.mark.parametrize("form,curve", [("full", None), ("curve", 9)])
def test_state_dict_matches_upstream_key_list(form, curve):
    # the list was derived from upstream's MiniMaxH3Model (same tiny config, bf16); fp32 islands included
    with open(KEYS) as f:
        expected = json.load(f)[form]
    model = MiniMaxH3Model(**TINY_CONFIG, adaln_curve_grid=curve, dtype=torch.bfloat16)
    got = [[k, list(v.shape), str(v.dtype).replace("torch.", "")] for k, v in model.state_dict().items()]
    assert sorted(got) == sorted(expected)


def _forward(model, cfg, kind="t2va", **kw):
    x, t, c, p = step_inputs(cfg, kind, **kw)
    return model(x, t, c, {}, minimax_payload=p)


def test_bad_inputs_are_refused_with_the_fix():
    model, cfg = tiny_model()
    x, t, c, p = step_inputs(cfg, "t2va")
    with pytest.raises(ValueError, match="batch size 1"):
        model([x[0].repeat(2, 1, 1, 1, 1), x[1]], t, c, {}, minimax_payload=p)
    with pytest.raises(ValueError, match=r"video latent \[1, 24, T, H, W\]"):
        model([x[0][:, :16], x[1]], t, c, {}, minimax_payload=p)
    with pytest.raises(ValueError, match="stereo audio latent"):
        model([x[0], x[1][:, :, :1]], t, c, {}, minimax_payload=p)
    with pytest.raises(ValueError, match="expects context"):
        model(x, t, c[..., :10], {}, minimax_payload=p)
    x, t, c, p = step_inputs(cfg, "keyframes")
    with pytest.raises(ValueError, match="condition rows but the conditioning latents give"):
        model(x, t, c, {}, minimax_payload=dict(p, cond_video_latents=p["cond_video_latents"][:1]))
    # a keyframe narrower than the target by more than the patch padding makes up (an odd size is padded)
    with pytest.raises(ValueError, match="expects 24 video condition rows but the conditioning latents give 21"):
        model(x, t, c, {}, minimax_payload=dict(p, cond_video_latents=[z[..., :-2] if i else z for i, z in enumerate(p["cond_video_latents"])]))
    with pytest.raises(ValueError, match=r"minimax_payload\['seed'\] -9223372036854775809 is out of range for the video"):
        model(x, t, c, {}, minimax_payload=dict(p, seed=-2**63 - 1))
    # a seed the noise never uses is not refused: KSampler's largest seed with no audio noise augmentation
    model(x, t, c, {}, minimax_payload=dict(p, seed=2**64 - 1, audio_cond_noise_aug=1.0))


def test_refined_context_skips_the_token_refiner():
    model, cfg = tiny_model()
    x, t, c, p = step_inputs(cfg, "tags")
    refined = model.preprocess_text_embeds(c)
    assert refined.shape[-1] == cfg["hidden_size"]
    a = model(x, t, c, {}, minimax_payload=p)
    b = model(x, t, refined, {}, minimax_payload=p)
    for u, v in zip(a, b):
        torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-5)


def test_block_patch_and_sigma_shift_reach_the_forward():
    model, cfg = tiny_model()
    base = _forward(model, cfg)
    calls = []

    def patch(args, extra):
        calls.append(args["img"].shape[0])
        return {"img": extra["original_block"](args)["img"] * 0.5}

    x, t, c, p = step_inputs(cfg, "t2va")
    patched = model(x, t, c, {"patches_replace": {"dit": {("double_block", 1): patch}}}, minimax_payload=p)
    assert calls == [7 + 2 * 5 + 3 * 3 * 4] and not torch.allclose(patched[0], base[0])
    opts = {"minimax_h3_sigma_shift_audio": 5.0}
    shifted = model(x, t, c, opts, minimax_payload=p)
    assert not torch.allclose(shifted[1], base[1])
    # the override moves the audio stream's timestep only
    plans = [model.plan(StepInputs(x[0], x[1], t, c, p, o)).timesteps for o in ({}, opts)]
    assert plans[0].t_video == plans[1].t_video and plans[0].t_audio != plans[1].t_audio
