"""Patchify / pack round trips, element placement, seeded condition noise and rope tables."""

import torch

from comfy.ldm.minimax_h3.embedding import (noise_augmented, pack_audio, patchify_video, rope_rotation_table,
                                            stream_rows, unpack_audio, unpatchify_video)


def test_patchify_round_trip_and_placement():
    z = torch.randn(1, 3, 2, 4, 6)
    rows = patchify_video(z)
    assert rows.shape == (2 * 2 * 3, 3 * 4)
    assert torch.equal(unpatchify_video(rows, 2, 2, 3, c=3), z)
    # row (t, h, w), column (c, ph, pw)
    t, h, w, c, ph, pw = 1, 1, 2, 2, 1, 0
    assert rows[(t * 2 + h) * 3 + w, c * 4 + ph * 2 + pw] == z[0, c, t, 2 * h + ph, 2 * w + pw]


def test_audio_pack_is_channel_major_and_round_trips():
    z = torch.randn(1, 5, 2, 3)
    rows = pack_audio(z)
    assert rows.shape == (6, 5)
    assert torch.equal(rows[1], z[0, :, 0, 1]) and torch.equal(rows[3 + 2], z[0, :, 1, 2])
    assert torch.equal(unpack_audio(rows), z)


def test_condition_noise_is_seeded_and_cpu_generated():
    rows = torch.randn(4, 3)
    assert noise_augmented(rows, 1.0, 7) is rows
    a, b = noise_augmented(rows, 0.9, 7), noise_augmented(rows, 0.9, 7)
    assert torch.equal(a, b)
    expected = 0.9 * rows + 0.1 * torch.randn(4, 3, generator=torch.Generator("cpu").manual_seed(7))
    torch.testing.assert_close(a, expected, rtol=0, atol=0)
    assert not torch.equal(a, noise_augmented(rows, 0.9, 8))


def test_stream_rows_checks_condition_count():
    target = torch.zeros(2, 3)
    assert torch.equal(stream_rows(torch.ones(1, 3), target, 1, "video")[0], torch.ones(3))
    try:
        stream_rows(None, target, 4, "video")
    except ValueError as e:
        assert "expects 4 video condition rows but the conditioning latents give 0" in str(e)
    else:
        raise AssertionError("a missing condition latent must be refused")


def test_rope_table_rotates_pairs():
    angles = torch.tensor([[0.5, 1.0, 0.5, 1.0]])  # duplicated halves
    table = rope_rotation_table(angles, torch.float64)
    assert table.shape == (1, 1, 1, 2, 2, 2)
    c, s = torch.cos(torch.tensor(1.0, dtype=torch.float64)), torch.sin(torch.tensor(1.0, dtype=torch.float64))
    torch.testing.assert_close(table[0, 0, 0, 1], torch.stack([torch.stack([c, -s]), torch.stack([s, c])]))
