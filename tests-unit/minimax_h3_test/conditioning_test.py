"""Timestep plan, tag runs, mod segments and the curve-form lookup, by hand."""

import pytest
import torch

from comfy.ldm.minimax_h3.conditioning import (TimestepPlan, curve_t_emb, mod_segments, text_tag_runs,
                                               time_shift_sigma)
from comfy.ldm.minimax_h3.layout import PackedLayout


def test_time_shift_closed_form():
    # sigma 0.6 at shift 12 -> base 0.6 / 5.4 = 1/9 -> shift 3: (1/3) / (11/9) = 3/11
    assert time_shift_sigma(0.6, 12.0, 3.0) == pytest.approx(3 / 11)
    assert time_shift_sigma(time_shift_sigma(0.3, 12.0, 3.0), 3.0, 12.0) == pytest.approx(0.3)


def test_tag_runs():
    assert text_tag_runs(torch.tensor([1, 0, 0, 1, 1, 2]), 6) == [(0, 1, 1), (1, 3, 0), (3, 5, 1), (5, 6, 2)]
    assert text_tag_runs(torch.tensor([1, 1, 1, 0]), 3) == [(0, 3, 1)]  # longer tags: the text span wins
    with pytest.raises(ValueError, match="2 entries but the text has 3"):
        text_tag_runs(torch.tensor([1, 1]), 3)
    with pytest.raises(ValueError, match=r"found \[5\]"):
        text_tag_runs(torch.tensor([1, 5]), 2)


def test_unique_t_rows_without_condition_rows():
    lay = PackedLayout(3, 1, 2, 2, 2)
    ts = TimestepPlan(0.6, 12.0, 3.0, lay)
    t_v, t_a = float(torch.tensor(1.0) - torch.tensor(0.6)), 1 - 3 / 11
    assert ts.unique_t == pytest.approx((t_v, t_a), abs=1e-7)
    segs = mod_segments(lay, ts)
    # rows = t_row * 3 + tag: text (t_v, 1), audio (t_a, 2), video (t_v, 0)
    assert segs == [(0, 3, 1), (3, 7, 5), (7, 8, 0)]


def test_unique_t_rows_with_condition_rows():
    z = torch.zeros
    kf = [{"resolved_frame_index": 0, "latent": z(1, 24, 1, 2, 2), "audio_latent": z(1, 32, 2, 1)}]
    lay = PackedLayout(2, 1, 2, 2, 1, keyframes=kf)
    ts = TimestepPlan(0.6, 12.0, 3.0, lay, vis_aug=0.999, aud_aug=1.0)
    assert ts.unique_t == pytest.approx((0.4, 1 - 3 / 11, 0.999, 1.0), abs=1e-6)
    assert mod_segments(lay, ts) == [(0, 2, 1), (2, 3, 6), (3, 5, 11), (5, 7, 5), (7, 8, 0)]
    # late in sampling t_v passes the augmentation level: the cond row dedupes onto the video row
    late = TimestepPlan(0.0005, 12.0, 3.0, lay, vis_aug=0.999, aud_aug=1.0)
    assert len(late.unique_t) == 3 and late.mod_row("cond") == late.mod_row("video")


def test_text_tags_split_the_text_span():
    lay = PackedLayout(4, 1, 2, 2, 1)
    ts = TimestepPlan(0.5, 12.0, 3.0, lay)
    segs = mod_segments(lay, ts, torch.tensor([1, 0, 0, 2]))
    assert segs[:3] == [(0, 1, 1), (1, 3, 0), (3, 4, 2)]


def test_curve_lookup():
    table = torch.stack([torch.arange(5.0), 10 * torch.arange(5.0)], dim=1)  # row i = [i, 10 i]
    out = curve_t_emb(table, torch.tensor([0.3, 1.0, -0.5, 0.625]))
    torch.testing.assert_close(out, torch.tensor([[1.2, 12.0], [4.0, 40.0], [0.0, 0.0], [2.5, 25.0]]))
