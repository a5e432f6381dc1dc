"""Issue 19 item 6: text-tag runs read once per sampling run, condition latents padded to the patch
size, an fp32 residual under fp16 compute.

No upstream file holds the padding (PR #15769 is open) or the fp16 residual (a fork's work in
progress), so those are checked against hand-derived expectations: row counts and positions of
the padded grid, the explicitly padded input, and the fp32 model.
"""

import pytest
import torch

import upstream_newer as un
from comfy.ldm.minimax_h3.step_io import StepInputs
from h3_files import TINY_CONFIG, write_h3_file

pytestmark = pytest.mark.comfyui


class CountingTags(torch.Tensor):
    """Text tags that count how often their values are read back to Python (a host sync on a GPU)."""
    reads = 0

    def tolist(self):
        CountingTags.reads += 1
        return super().tolist()


def _counting(tags):
    CountingTags.reads = 0
    return tags.as_subclass(CountingTags)


# -- 6c: text-tag runs -------------------------------------------------------------------------------

def test_comfyui_sampling_reads_the_text_tags_once(comfyui_patched, tmp_path):
    import comfy.sd
    import nodes
    from comfy_extras.nodes_minimax_h3 import EmptyMiniMaxH3LatentAV
    patcher = comfy.sd.load_diffusion_model(write_h3_file(str(tmp_path / "h3.safetensors"), TINY_CONFIG, seed=2))
    tags = torch.ones(7, dtype=torch.long)
    tags[1:3] = 0
    tags[-1] = 2
    g = torch.Generator().manual_seed(3)
    text = torch.randn(1, 7, TINY_CONFIG["text_dim"], generator=g)
    negative = [[torch.randn(1, 5, TINY_CONFIG["text_dim"], generator=g), {}]]
    latent = EmptyMiniMaxH3LatentAV.execute(32, 32, 5).result[0]

    def sample(tags):
        positive = [[text, {"minimax_token_tags": tags}]]
        out = nodes.common_ksampler(patcher, 7, 3, 2.5, "euler", "simple", positive, negative, latent)[0]["samples"]
        return out.unbind()
    counted = sample(_counting(tags))
    assert CountingTags.reads == 1  # three steps, the positive cond's payload keeps the runs
    plain, untagged = sample(tags), sample(torch.ones(7, dtype=torch.long))
    for a, b, c in zip(counted, plain, untagged):
        assert torch.equal(a, b)
        assert not torch.allclose(a, c, atol=1e-3)  # the runs reached the modulation


def test_sequence_parallel_ranks_take_the_runs_from_the_payload(comfyui_dir):
    model, _ = un.build_model(un.ours(), {})
    x, timestep, context, payload, _, options = un.case_inputs("keyframes_tags")
    tags = payload["text_token_tags"]
    payload["text_token_tags"] = _counting(tags)
    inputs = StepInputs(x[0], x[1], timestep, context, payload, options)
    plan = model.plan(inputs)
    assert CountingTags.reads == 1
    assert model.plan(inputs).digest() == plan.digest() and CountingTags.reads == 1
    # a worker decodes the payload rank 0 sent after building its plan: the runs come along
    worker = StepInputs.decode(*inputs.encode())
    worker.payload["text_token_tags"] = _counting(worker.payload["text_token_tags"])
    assert model.plan(worker).digest() == plan.digest() and CountingTags.reads == 0
    # the runs by hand: tags 1, 0, 0, 1, 1, 1, 2 over the 7 text rows
    text_rows = [(a, b) for a, b, _ in plan.mod_segments if b <= 7]
    assert text_rows == [(0, 1), (1, 3), (3, 6), (6, 7)]
    # the same payload on a text of another length computes its own runs
    short = StepInputs(x[0], x[1], timestep, context[:, :6], payload, options)
    assert [(a, b) for a, b, _ in model.plan(short).mod_segments if b <= 6] == [(0, 1), (1, 3), (3, 6)]
    assert CountingTags.reads == 1


# -- 6b: condition latents of an odd size ------------------------------------------------------------

def _wrap_pad(z):
    """z [1, C, T, H, W] padded by hand to even H and W the way pad_to_patch_size pads the target
    latent (circular: the first row / column repeats after the last)."""
    if z.shape[3] % 2:
        z = torch.cat([z, z[..., :1, :]], dim=3)
    if z.shape[4] % 2:
        z = torch.cat([z, z[..., :1]], dim=4)
    return z


def test_odd_reference_sizes_take_the_padded_grid(comfyui_dir):
    from comfy.ldm.minimax_h3.layout import PackedLayout

    def ref_rows(h, w, **kw):
        lay = PackedLayout(3, 1, 4, 6, 2, refs=[{"kind": "image", "latent_h": h, "latent_w": w}], **kw)
        a, b = next((a, b) for a, b, k in lay.segments if k == "ref_img")
        return lay.position_ids[a:b]
    # by hand: 5 x 7 latents pad to 6 x 8, three by four 2x2 patches; 31 x 33 pad to 32 x 34, 16 by 17
    assert ref_rows(5, 7).shape[0] == 12 and ref_rows(31, 33).shape[0] == 16 * 17
    assert torch.equal(ref_rows(5, 7), ref_rows(6, 8))
    video = PackedLayout(3, 1, 4, 6, 2, refs=[{"kind": "video_audio", "latent_t": 2, "latent_h": 3, "latent_w": 5, "ref_audio_t": 2}])
    same = PackedLayout(3, 1, 4, 6, 2, refs=[{"kind": "video_audio", "latent_t": 2, "latent_h": 4, "latent_w": 6, "ref_audio_t": 2}])
    assert torch.equal(video.position_ids, same.position_ids)  # the block's audio rows take the padded grid's w too


def _odd_inputs(pre_padded):
    """A 5 x 7 target with odd keyframes and an odd reference image, or the same latents padded by hand."""
    x, timestep, context, payload, _, options = un.case_inputs("odd_hw")
    g = torch.Generator().manual_seed(5)
    keyframe, ref = torch.randn(1, 24, 1, 5, 7, generator=g), torch.randn(1, 24, 1, 3, 5, generator=g)
    if pre_padded:
        keyframe, ref = _wrap_pad(keyframe), _wrap_pad(ref)
    payload.update(keyframes=[{"resolved_frame_index": 0, "latent": keyframe}], cond_video_latents=[keyframe, ref],
                   refs=[{"kind": "image", "latent_h": ref.shape[3], "latent_w": ref.shape[4], "latent": ref}],
                   visual_cond_noise_aug=0.9)
    return x, timestep, context, payload, options


def test_odd_condition_latents_run_as_their_padded_latents(comfyui_dir):
    model, _ = un.build_model(un.ours(), {})
    x, timestep, context, payload, options = _odd_inputs(False)
    got = model(x, timestep, context, dict(options), minimax_payload=payload)
    x, timestep, context, padded, options = _odd_inputs(True)
    want = model(x, timestep, context, dict(options), minimax_payload=padded)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    x0, t0, c0, unconditioned, _, _ = un.case_inputs("odd_hw")
    assert not torch.allclose(got[0], model(x0, t0, c0, {}, minimax_payload=unconditioned)[0], atol=1e-3)  # the conditions count
    # the pinned base patchifies them unpadded and fails inside the forward (issue #15768)
    from upstream_newer_test import _base_upstream
    upstream = _base_upstream()
    theirs, _ = un.build_model(upstream, {})
    with pytest.raises(RuntimeError, match="is invalid for input of size"):
        theirs(x, timestep, context, dict(options), minimax_payload=_odd_inputs(False)[3])


# -- 6a: fp16 compute keeps the residual in fp32 ------------------------------------------------------

def _peaks(model, x, timestep, context, payload):
    peaks = {}

    def record(name):
        return lambda module, args, out: peaks.__setitem__(name, max(peaks.get(name, 0.0), float(out.abs().max())))
    hooks = [m.register_forward_hook(record(n)) for b in model.blocks for n, m in (("residual", b), ("out_proj", b.attn.out_proj),
                                                                                   ("fc2", b.mlp.fc2))]
    try:
        out = model(x, timestep, context, {}, minimax_payload=payload)
    finally:
        for h in hooks:
            h.remove()
    return out, peaks


def test_fp16_compute_stays_finite_where_the_residual_and_branches_pass_65504(comfyui_dir):
    x, timestep, context, payload, _, _ = un.case_inputs("t2va")
    want, peaks = _peaks(un.loud_model(un.ours(), torch.float32), x, timestep, context, payload)
    fp16_max = torch.finfo(torch.float16).max
    assert peaks["residual"] > 10 * fp16_max and fp16_max < peaks["out_proj"] < 64 * fp16_max
    assert fp16_max < peaks["fc2"] < 256 * fp16_max
    half_x, half_context = un.half(x, context)
    got = un.loud_model(un.ours(), torch.float16)(half_x, timestep, half_context, {}, minimax_payload=payload)
    for g, w in zip(got, want):
        assert g.dtype == torch.float16 and bool(torch.isfinite(g).all())
        assert float((g.float() - w).abs().max() / w.abs().max()) <= 5e-3
    # the pinned base's fp16 residual overflows on the same weights
    from upstream_newer_test import _base_upstream
    theirs = un.loud_model(_base_upstream(), torch.float16)(half_x, timestep, half_context, {}, minimax_payload=payload)
    assert not all(bool(torch.isfinite(t).all()) for t in theirs)


def test_fp16_compute_dtype_node_through_comfyuis_loader(comfyui_patched, tmp_path):
    import comfy.model_management
    import comfy.sd
    from safetensors.torch import save_file

    from comfy_extras.nodes_model_advanced import ModelComputeDtype
    path = str(tmp_path / "h3_loud.safetensors")
    save_file({"model.diffusion_model." + k: v.contiguous() for k, v in un.loud_weights().items()}, path)
    base = comfy.sd.load_diffusion_model(path)
    x, timestep, context, payload, _, _ = un.case_inputs("t2va")
    outputs = {}
    for name, patcher in (("fp32", base), ("fp16", ModelComputeDtype().patch(base, "fp16")[0])):
        comfy.model_management.load_models_gpu([patcher])
        dtype = patcher.model.get_dtype_inference()
        with torch.no_grad():
            outputs[name] = patcher.model.diffusion_model([x[0].to(dtype), x[1].to(dtype)], timestep, context.to(dtype),
                                                           {}, minimax_payload=dict(payload))
        outputs[name + " dtype"] = dtype
    assert outputs["fp16 dtype"] == torch.float16 and outputs["fp32 dtype"] == torch.float32
    for g, w in zip(outputs["fp16"], outputs["fp32"]):
        assert bool(torch.isfinite(g).all()) and float((g.float() - w).abs().max() / w.abs().max()) <= 5e-3
