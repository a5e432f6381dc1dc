"""Issue 19 item 2: PDD head banks (few-step LoRAs give the output layers a bank of heads).

The plan picks a step's heads from the sampler's sigmas (carried to every rank in the step inputs) and
its digest covers the choice; outputs match the newer upstream's stored ones (on gloo ranks:
newer_features_sharded_test), and FinalLayer's newer signature mixes the heads a hand computation mixes.
"""

import pytest
import torch

import upstream_newer as un
from comfy.ldm.minimax_h3.pdd import head_shares
from comfy.ldm.minimax_h3.step_io import StepInputs
from compat_reexport_test import _reexport
from upstream_newer_test import _pdd_head

pytestmark = pytest.mark.comfyui
PDD = ["pdd_first", "pdd_mid", "pdd_last", "pdd_mask"]  # pdd_mask: a bank under video and audio denoise masks


def _bank_model(heads=un.PDD_HEADS):
    model, _ = un.build_model(un.ours(), {"pdd_heads": heads})
    return model


def _plan(model, name, **options):
    x, timestep, context, payload, _, opts = un.case_inputs(name, model.dtype)
    return model.plan(StepInputs(x[0], x[1], timestep, context, payload, dict(opts, **options)))


@pytest.mark.parametrize("name", PDD)
def test_native_matches_newer_upstream(comfyui_dir, reference, name):
    tensors, _ = reference
    model, _ = un.build_model(un.ours(), un.CASES[name][0])
    video, audio, _ = un.run_case(un.ours(), name, model=model)
    un.assert_case_outputs(video, audio, tensors, name)


def test_plan_picks_the_heads_by_hand_and_its_digest_covers_them(comfyui_dir):
    model = _bank_model()
    sigmas = un.sample_sigmas()
    plan = _plan(model, "pdd_mid")
    # step 3 of 8 on a 16-head bank: heads [6, 8) of the unshifted grid
    assert (plan.pdd.heads, plan.pdd.start, plan.pdd.stop, plan.pdd.shifts) == (16, 6, 8, un.SHIFTS)
    for shift in un.SHIFTS:  # each stream weighs the two heads by their spans on its own shifted grid
        t = [1.0 - shift * (1 - k / 16) / (1.0 + (shift - 1.0) * (1 - k / 16)) for k in (6, 7, 8)]
        dt = [t[1] - t[0], t[2] - t[1]]
        assert head_shares(16, 6, 8, shift).tolist() == pytest.approx([d / sum(dt) for d in dt], rel=1e-12)
    assert plan.digest() == _plan(model, "pdd_mid").digest()
    # a schedule whose next sigma moves the span, and a bank of another size, change the digest
    moved = sigmas.clone()
    moved[4] = sigmas[5]
    other = _plan(model, "pdd_mid", sample_sigmas=moved)
    assert other.pdd.stop != plan.pdd.stop and other.digest() != plan.digest()
    assert _plan(_bank_model(8), "pdd_mid").digest() != plan.digest()
    # without a bank the schedule plays no part
    plain, _ = un.build_model(un.ours(), {})
    assert _plan(plain, "pdd_mid").pdd is None
    assert _plan(plain, "pdd_mid", sample_sigmas=moved).digest() == _plan(plain, "pdd_mid").digest()


def test_a_bank_without_the_sampler_schedule_is_refused_while_planning(comfyui_dir):
    model = _bank_model()
    x, timestep, context, payload, _, options = un.case_inputs("pdd_mid")
    del options["sample_sigmas"]
    with pytest.raises(ValueError, match=r"PDD heads need the sampler's sigma schedule.*bank of 16 heads.*ComfyUI sampler"):
        model.plan(StepInputs(x[0], x[1], timestep, context, payload, options))


def test_step_inputs_carry_the_schedule(comfyui_dir):
    model = _bank_model()
    x, timestep, context, payload, _, options = un.case_inputs("pdd_last")
    tensors, meta = StepInputs(x[0], x[1], timestep, context, payload, dict(options, unrelated=1)).encode()
    step = StepInputs.decode(tensors, meta)
    assert set(step.options) == {"sample_sigmas"} and torch.equal(step.options["sample_sigmas"], options["sample_sigmas"])
    assert model.plan(step).digest() == _plan(model, "pdd_last").digest()
    meta["options"]["not_a_step_option"] = 1.0
    with pytest.raises(ValueError, match=r"unknown options \['not_a_step_option'\]"):
        StepInputs.decode(tensors, meta)


@pytest.mark.parametrize("step", [0, 3, 7])
def test_final_layer_newer_signature_mixes_the_heads_it_spans(comfyui_dir, step):
    """FinalLayer.forward(x, t_emb, video_seg, audio_seg, sigma, sample_sigmas, shifts), as newer callers
    use it, against heads mixed by hand in float64; the 4-argument call of a plain layer is unchanged."""
    model = _bank_model()
    layer = model.final_layer
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(9, un.TINY["hidden_size"], generator=gen)
    t_emb = torch.randn(2, un.TINY["time_embed_dim"], generator=gen)
    sigmas = un.sample_sigmas()
    sigma = sigmas[step].reshape(())
    video, audio = layer(x, t_emb, (0, 5, 1), (5, 9, 0), sigma, sigmas, un.SHIFTS)
    grid = lambda s: round((1.0 - float(s) / (un.SHIFTS[0] + float(s) * (1.0 - un.SHIFTS[0]))) * 16)
    start, stop = grid(sigmas[step]), grid(sigmas[step + 1])
    shift, scale = layer.adaln_proj(t_emb)
    for got, rows, row, head, flow_shift in ((video, slice(0, 5), 1, layer.video_out, un.SHIFTS[0]),
                                             (audio, slice(5, 9), 0, layer.audio_out, un.SHIFTS[1])):
        h = layer.norm(x[rows]) * (1.0 + scale[row]) + shift[row]
        weight, bias = _pdd_head(head.weight, head.bias, 16, start, stop, flow_shift)
        torch.testing.assert_close(got, torch.nn.functional.linear(h, weight, bias), atol=1e-5, rtol=1e-5)
        # the compatibility re-export's _pdd_head(head, h, n, start, stop, flow_shift), as newer upstream names it
        torch.testing.assert_close(_reexport()._pdd_head(head, h, 16, start, stop, flow_shift), got, atol=0, rtol=0)
    plain, _ = un.build_model(un.ours(), {})
    layer = plain.final_layer
    video, _ = layer(x, t_emb, (0, 5, 1), (5, 9, 0))
    shift, scale = layer.adaln_proj(t_emb)
    assert torch.equal(video, layer.video_out(layer.norm(x[0:5]) * (1.0 + scale[1]) + shift[1]))
