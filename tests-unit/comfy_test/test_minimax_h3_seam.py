import pytest
import torch

import minimax_h3_cases as cases
from comfy.ldm.minimax.model import PackedLayout
from comfy.ldm.minimax.plan import ForwardPlan, balanced_ranges, clip_segment


class OneShard:
    """A sequence-parallel runner of one rank: the forward must then be the native forward."""
    rank, world_size = 0, 1

    def __init__(self):
        self.calls = []

    def attention(self, attn, shard):
        self.calls.append(("attention", (shard.start, shard.stop)))
        return attn

    def gather(self, shard, video_rows, audio_rows):
        self.calls.append(("gather", (shard.start, shard.stop)))
        return video_rows, audio_rows


@pytest.mark.parametrize("name", ["t2va", "refs_all", "masks_keyframes_scale", "pdd_mid"])
def test_one_shard_runner_is_the_native_forward(name):
    model = cases.build_model(cases.CASES[name][0])
    runner = OneShard()
    native = cases.run_case(name, model=model)
    sharded = cases.run_case(name, model=model, transformer_options={"minimax_h3_sequence_parallel": runner})
    assert all(torch.equal(s, n) for s, n in zip(sharded, native))
    seq_len = runner.calls[-1][1][1]
    assert runner.calls == [("attention", (0, seq_len))] * cases.TINY["num_layers"] + [("gather", (0, seq_len))]


def test_balanced_ranges():
    assert balanced_ranges(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert balanced_ranges(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_clip_segment_slices_per_row_indices():
    rows = torch.arange(10, 16)
    assert clip_segment((10, 16, rows), 12, 20)[:2] == (0, 4)
    assert torch.equal(clip_segment((10, 16, rows), 12, 20)[2], rows[2:])
    assert clip_segment((10, 16, 5), 0, 12) == (10, 12, 5)
    assert clip_segment((10, 16, 5), 0, 4)[:2] == (4, 4)  # empty
    assert clip_segment((10, 16, rows), 0, 20)[2] is rows


def _layout(kind):
    if kind == "refs":
        refs = [{"kind": "image", "latent_h": 4, "latent_w": 6}, {"kind": "audio", "ref_audio_t": 3},
                {"kind": "video_audio", "latent_t": 2, "latent_h": 2, "latent_w": 4, "ref_audio_t": 4}]
        return PackedLayout(7, 2, 4, 6, 5, refs=refs)
    if kind == "keyframes":
        kfs = [{"resolved_frame_index": 0, "latent": torch.zeros(1, 24, 1, 4, 6)},
               {"resolved_frame_index": 4, "latent": torch.zeros(1, 24, 1, 4, 6), "audio_latent": torch.zeros(1, 32, 2, 2)}]
        return PackedLayout(7, 2, 4, 6, 5, keyframes=kfs)
    return PackedLayout(7, 2, 4, 6, 5)


def _rows(segment):
    # (start, stop, row) -> the row of each of its rows
    a, b, row = segment
    return row.tolist() if isinstance(row, torch.Tensor) else [row] * (b - a)


def _per_row(segments, n):
    out = [None] * n
    for seg in segments:
        out[seg[0]:seg[1]] = _rows(seg)
    return out


@pytest.mark.parametrize("kind", ["plain", "refs", "keyframes"])
@pytest.mark.parametrize("masked", [False, True])
def test_shards_partition_the_plan(kind, masked):
    layout = _layout(kind)
    video_rows = layout.segments[-1][1] - layout.segments[-1][0]
    audio_rows = layout.segments[-2][1] - layout.segments[-2][0]
    video_t = torch.tensor([0.4, 0.7, 0.999]).repeat(video_rows)[:video_rows] if masked else None
    audio_t = torch.linspace(0.5, 1.0, audio_rows) if masked else None
    tags = torch.tensor([1, 0, 0, 1, 1, 2, 1])
    plan = ForwardPlan(layout, 0.4, 0.55, 0.9, 0.8, tags, video_t, audio_t)
    mod_rows = _per_row(plan.mod_segments, layout.seq_len)
    assert None not in mod_rows
    for world in range(1, 9):
        shards = [plan.shard(world, r) for r in range(world)]
        assert [(s.start, s.stop) for s in shards] == balanced_ranges(layout.seq_len, world)
        assert sum((_per_row(s.mod_segments, s.stop - s.start) for s in shards), []) == mod_rows
        for stream, seg in (("video", plan.video_seg), ("audio", plan.audio_seg)):
            local = [getattr(s, stream + "_seg") for s in shards]
            assert sum((_rows(t) for t in local), []) == _rows(seg)
            assert [t[1] - t[0] for t in local] == [c[stream == "audio"] for c in shards[0].target_counts]


@pytest.mark.parametrize("name", ["refs_all", "keyframes_tags"])
def test_embed_and_pack_rows_are_slices_of_the_full_pack(name):
    model = cases.build_model({})
    x, _, context, payload, _, _ = cases.case_inputs(name)
    video = x[0]
    layout = PackedLayout(context.shape[1], *video.shape[2:], x[1].shape[-1], keyframes=payload.get("keyframes"), refs=payload.get("refs"))
    full = model._embed_and_pack(video, x[1], context, layout, payload, {})
    for world in (2, 3, 5):
        for start, stop in balanced_ranges(layout.seq_len, world):
            rows = model._embed_and_pack(video, x[1], context, layout, payload, {}, rows=(start, stop))
            assert torch.equal(rows, full[start:stop])
