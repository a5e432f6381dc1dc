"""Issue 19 item 1: per-token video/audio denoise masks and the #15988 masked-row velocity scaling.

Our forward against the newer upstream's stored outputs (upstream_newer's mask cases, mask_edges'
generated edges), and the plan's per-row levels, each rank's rows of them and the digest. Edges that
follow from the unmasked reference by hand (all-ones, just above the 1 - 1e-3 threshold) are checked
against it. The same cases on gloo ranks and on worker groups: newer_features_sharded_test.
"""


import pytest
import torch

import mask_edges as me
import upstream_newer as un
from comfy.ldm.minimax_h3.step_io import StepInputs

pytestmark = pytest.mark.comfyui

@pytest.mark.parametrize("name", me.MASK_CASES)
def test_native_matches_newer_upstream(comfyui_dir, reference, name):
    tensors, _ = reference
    model, _ = un.build_model(un.ours(), un.CASES[name][0])
    video, audio, _ = un.run_case(un.ours(), name, model=model)
    un.assert_case_outputs(video, audio, tensors, name)


@pytest.mark.parametrize("name", list(me.EDGES))
def test_native_edges(comfyui_dir, reference, edges, name):
    video, audio = me.run_edge(un.ours(), name)
    me.check_edge(name, video, audio, reference[0], edges[0])
    _, _, _, _, masks, _ = me.edge_inputs(name)
    # a fully kept stream has no velocity at all: the sampler's x0 = x - sigma * v is x
    if float(masks.get("denoise_mask", torch.ones(1)).max()) == 0.0:
        assert not video.any()
    if float(masks.get("audio_denoise_mask", torch.ones(1)).max()) == 0.0 and me.EDGES[name][0] == "t2va":
        assert not audio.any()


def test_edges_reference_matches_its_recipe(comfyui_dir, edges):
    tensors, manifest = edges
    assert manifest["reference"] == un.REFERENCE and manifest["base"] == un.BASE_COMMIT
    assert manifest["edges"] == {n: list(me.EDGES[n]) for n in me.GENERATED}
    for name in me.GENERATED:
        assert un.input_digest(*me.edge_inputs(name)) == manifest["input_digests"][name], f"{name} inputs drifted"


def test_newer_upstream_reproduces_the_edges_reference(comfyui_dir, edges):
    tensors, manifest = edges
    module = un.upstream_or_skip()
    assert module.H3_SHIMS == manifest["shims"]
    for name in me.GENERATED:
        video, audio = me.run_edge(module, name)
        un.assert_case_outputs(video, audio, tensors, name)


# -- the plan: per-row levels and indices, each rank's rows, the digest -----------------------------

def _plan(name, masks=None):
    model, _ = un.build_model(un.ours(), un.CASES[name][0])
    x, timestep, context, payload, case_masks, options = un.case_inputs(name, model.dtype)
    masks = case_masks if masks is None else masks
    return model.plan(StepInputs(x[0], x[1], timestep, context, payload, options, masks.get("denoise_mask"),
                                 masks.get("audio_denoise_mask"))), masks


def test_binary_mask_puts_the_kept_patches_on_the_condition_level(comfyui_dir):
    plan, _ = _plan("video_mask_binary")
    ts = plan.timesteps
    t_video = float(torch.tensor(1.0) - torch.tensor(0.6))
    # by hand from upstream_newer._video_mask("binary") on 2 frames of 2 x 3 patches (row order t, h, w):
    # frame 0 pixels h 0:2, w 0:4 are patches (0, 0), (0, 1); frame 1 pixels h 2:4, w 2:6 are (1, 1), (1, 2)
    kept = {0, 1, 6 + 3 + 1, 6 + 3 + 2}
    want = [float(torch.tensor(0.999, dtype=torch.float32)) if r in kept else t_video for r in range(12)]
    va, vb, t_rows = plan.video_seg
    assert vb - va == 12 and [ts.unique_t[i] for i in t_rows.tolist()] == want
    mods = {a: row for a, b, row in plan.mod_segments}
    assert [ts.unique_t[i // 3] for i in mods[va].tolist()] == want and all(i % 3 == 0 for i in mods[va].tolist())
    assert isinstance(plan.audio_seg[2], int)


def test_audio_mask_rows_follow_the_packed_channel_major_order(comfyui_dir):
    plan, masks = _plan("audio_mask")
    ts = plan.timesteps
    aa, ab, t_rows = plan.audio_seg
    # _audio_mask: frames 0-1 of both channels kept, channel 0 frame 2 at half strength; rows ch0 t0..4, ch1 t0..4
    strength = [0.0, 0.0, 0.5, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    sigma_a = 1.0 - ts.t_audio
    want = [min(float(torch.tensor(1.0 - m * sigma_a, dtype=torch.float32)), max(ts.t_audio, 1.0)) for m in strength]
    assert ab - aa == 10 and [ts.unique_t[i] for i in t_rows.tolist()] == want
    mods = {a: row for a, b, row in plan.mod_segments}
    assert all(i % 3 == 2 for i in mods[aa].tolist())  # the audio modality tag


@pytest.mark.parametrize("name", ["video_mask_levels", "masks_keyframes_scale", "masks_refs_curve"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_each_rank_holds_exactly_its_rows_mask_levels(comfyui_dir, name, world):
    plan, _ = _plan(name)
    shards = [plan.shard(world, r, un.TINY["num_attention_heads"]) for r in range(world)]
    per_row = {}
    for a, b, row in plan.mod_segments:
        for i in range(a, b):
            per_row[i] = int(row[i - a]) if isinstance(row, torch.Tensor) else row
    split = 0
    for shard in shards:
        for a, b, row in shard.mod_segments:
            got = row.tolist() if isinstance(row, torch.Tensor) else [row] * (b - a)
            assert got == [per_row[shard.row_start + i] for i in range(a, b)]
        for seg, rows, whole in ((shard.video_seg, shard.video_rows, plan.video_seg), (shard.audio_seg, shard.audio_rows, plan.audio_seg)):
            if isinstance(whole[2], torch.Tensor):
                assert torch.equal(seg[2], whole[2][rows[0]:rows[1]]) and seg[1] - seg[0] == rows[1] - rows[0]
                split += 0 < rows[1] - rows[0] < whole[1] - whole[0]
    # from 3 ranks on a rank boundary falls inside the masked video rows (the last 12 of 29 for video_mask_levels)
    assert split or world == 2, "no rank holds part of a masked target segment: the case does not test the split"


def test_digest_covers_mask_levels_and_which_rows_hold_them(comfyui_dir):
    base, masks = _plan("video_mask_binary")
    video = masks["denoise_mask"]
    same, _ = _plan("video_mask_binary", {"denoise_mask": video.clone().to(torch.bfloat16)})
    moved = torch.ones_like(video)
    moved[..., 1, 0:2, 0:4] = 0.0  # the frame-0 patches' mask on frame 1 instead: same levels, other rows
    moved[..., 0, 2:4, 2:6] = 0.0
    weaker = video.clone()
    weaker[..., 0, 0:2, 0:4] = 0.25  # another level
    plain, _ = _plan("video_mask_binary", {})
    ones, _ = _plan("video_mask_binary", {"denoise_mask": torch.ones_like(video)})
    assert same.digest() == base.digest()
    assert _plan("video_mask_binary", {"denoise_mask": moved})[0].digest() != base.digest()
    assert _plan("video_mask_binary", {"denoise_mask": weaker})[0].digest() != base.digest()
    assert plain.digest() != base.digest() and ones.digest() == plain.digest()


def test_step_inputs_carry_the_masks(comfyui_dir):
    x, timestep, context, payload, masks, options = un.case_inputs("masks_bf16", torch.bfloat16)
    # model_base passes slices of the sampler's mask: non-contiguous views
    video_mask = torch.cat([masks["denoise_mask"]] * 2, dim=1)[:, :1]
    inputs = StepInputs(x[0], x[1], timestep, context, payload, options, video_mask, masks["audio_denoise_mask"])
    tensors, meta = inputs.encode()
    back = StepInputs.decode(tensors, meta)
    assert back.denoise_mask.dtype == torch.bfloat16 and torch.equal(back.denoise_mask, video_mask)
    assert torch.equal(back.audio_denoise_mask, masks["audio_denoise_mask"])
    none = StepInputs.decode(*StepInputs(x[0], x[1], timestep, context, payload, options).encode())
    assert none.denoise_mask is None and none.audio_denoise_mask is None


def test_bad_masks_are_refused_with_the_fix(comfyui_dir):
    model, _ = un.build_model(un.ours(), {})
    x, timestep, context, payload, _, options = un.case_inputs("t2va")
    video = torch.ones(1, 1, *x[0].shape[2:])
    bad = [
        ({"denoise_mask": video[..., :-1]}, r"denoise_mask \[1, 1, 2, 4, 6\] \(one channel of the first batch entry"),
        ({"denoise_mask": video.expand(1, 2, -1, -1, -1)}, r"got \(1, 2, 2, 4, 6\)"),
        ({"audio_denoise_mask": torch.ones(1, 1, 5)}, r"audio_denoise_mask \[1, 1, 2, 5\]"),
        ({"denoise_mask": video * torch.tensor([1.0, 2.0]).view(1, 1, 2, 1, 1)}, r"denoise_mask values must lie in \[0, 1\] .*found 1.0..2.0"),
        ({"audio_denoise_mask": torch.full((1, 1, 2, 5), float("nan"))}, r"audio_denoise_mask values must lie in \[0, 1\]"),
    ]
    for masks, message in bad:
        with pytest.raises(ValueError, match=message):
            model(x, timestep, context, dict(options), minimax_payload=payload, **masks)


def test_mask_row_values_pools_each_patch_by_hand_and_as_newer_upstream(comfyui_patched):
    import comfy.ldm.minimax.model as reexport
    from comfy.ldm.minimax_h3.embedding import mask_row_values
    assert reexport.mask_row_values is mask_row_values  # callers of the newer upstream name get ours
    mask = torch.tensor([[[0.0, 0.0, 1.0], [0.0, 0.5, 0.0], [0.25, 0.0, 0.0]]])
    # padded to 4 x 4 by repeating the last row and column; each 2x2 patch takes its max
    assert mask_row_values(mask, 1, 4, 4).tolist() == [0.5, 1.0, 0.25, 0.0]
    assert mask_row_values(torch.full((2, 3, 5), 0.9995), 2, 4, 6) is None  # every row generates
    path = un.upstream_path()
    if path is not None:
        theirs = un.load_upstream(path).mask_row_values
        for m in (mask, torch.rand(3, 5, 7, generator=torch.Generator().manual_seed(0))):
            lat_h, lat_w = m.shape[1] + m.shape[1] % 2, m.shape[2] + m.shape[2] % 2
            assert torch.equal(mask_row_values(m, m.shape[0], lat_h, lat_w), theirs(m, m.shape[0], lat_h, lat_w))
