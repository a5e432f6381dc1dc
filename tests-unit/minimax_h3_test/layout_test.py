"""PackedLayout against hand-derived positions, segment tables and stream masks."""

import math

import pytest
import torch

from comfy.ldm.minimax_h3.layout import PackedLayout


def _axis(dim, area):
    # expected area-normalised axis, written out from the definition rather than from the code
    ratio = dim / area
    n = dim // 2
    return [((1 - ratio) / 2 + i * ratio / n) * 32 for i in range(n)]


def test_two_frame_layout_positions():
    lay = PackedLayout(text_len=2, latent_t=2, latent_h=2, latent_w=4, audio_t=2)
    area = math.sqrt(2 * 4)
    (h0,), (w0, w1) = _axis(2, area), _axis(4, area)
    assert (round(h0, 6), round(w0, 6), w1) == (4.686292, -6.627417, 16.0)
    # text t=0,1; audio origin = text_len; stereo channel-major with w pinned to the grid ends;
    # video frames at 2 and 2 + 5/3 (the first latent frame holds one pixel frame)
    expected = [[0, 0, 0], [1, 0, 0],
                [2, 0, w0], [3, 0, w0], [2, 0, w1], [3, 0, w1],
                [2, h0, w0], [2, h0, w1], [2 + 5 / 3, h0, w0], [2 + 5 / 3, h0, w1]]
    assert lay.position_ids.dtype == torch.float64
    torch.testing.assert_close(lay.position_ids, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)
    assert lay.segments == [(0, 2, "text"), (2, 6, "audio"), (6, 10, "video")]
    assert lay.seq_len == 10 and lay.signature == (2, 2, 2, 4, 2)
    assert lay.img_pos.tolist() == [6, 7, 8, 9] and lay.img_update.all()
    assert lay.audio_pos.tolist() == [2, 3, 4, 5] and lay.audio_update.all()


def test_video_frame_spans_follow_the_5_frame_pattern():
    lay = PackedLayout(text_len=1, latent_t=7, latent_h=2, latent_w=2, audio_t=1)
    t = lay.position_ids[lay.img_pos, 0].tolist()
    spans = [b - a for a, b in zip(t, t[1:])]
    r = 5 / 3
    assert spans == pytest.approx([r, 4 * r, 4 * r, 4 * r, 4 * r, r], abs=1e-12)


def test_keyframes_and_refs_order_and_time_origin():
    z = torch.zeros
    keyframes = [{"resolved_frame_index": 0, "latent": z(1, 24, 1, 2, 4)},
                 {"resolved_frame_index": 6, "latent": z(1, 24, 1, 2, 4), "audio_latent": z(1, 32, 2, 3)}]
    refs = [{"kind": "image", "latent_h": 2, "latent_w": 2},
            {"kind": "audio", "ref_audio_t": 3},
            {"kind": "video_audio", "latent_t": 2, "latent_h": 2, "latent_w": 2, "ref_audio_t": 2}]
    lay = PackedLayout(4, 2, 2, 4, 2, keyframes=keyframes, refs=refs)
    kinds = [k for _, _, k in lay.segments]
    assert kinds == ["text", "cond", "cond", "cond_audio", "ref_img", "ref_audio", "ref_audio", "ref_img", "audio", "video"]
    # targets start after text (4) + image (1) + audio (3) + max(2, 5/3 + 20/3) spans
    origin = 4 + 1 + 3 + (5 / 3 + 20 / 3)
    video_start = lay.segment("video")[0]
    assert lay.position_ids[video_start, 0].item() == pytest.approx(origin)
    # keyframe anchors count from the target origin, 5/3 per pixel frame
    cond_audio = next(a for a, _, k in lay.segments if k == "cond_audio")
    assert lay.position_ids[cond_audio, 0].item() == pytest.approx(origin + 6 * 5 / 3)
    assert lay.video_cond_rows == 2 + 2 + 1 + 2 and lay.audio_cond_rows == 6 + 6 + 4
    assert not lay.img_update[:lay.video_cond_rows].any() and lay.img_update[lay.video_cond_rows:].all()


def test_unknown_reference_kind_is_refused():
    with pytest.raises(ValueError, match="kind 'sketch'"):
        PackedLayout(2, 1, 2, 2, 1, refs=[{"kind": "sketch"}])


def test_fingerprint_tracks_positions():
    a = PackedLayout(3, 2, 2, 4, 2).fingerprint()
    assert a == PackedLayout(3, 2, 2, 4, 2).fingerprint()
    assert a != PackedLayout(3, 2, 2, 4, 3).fingerprint()
