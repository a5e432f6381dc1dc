"""Latents <-> token rows, denoise masks -> row strengths, condition rows with seeded noise augmentation,
rope tables.

Shapes at the boundaries:
  video latent [1, C, T, H, W]  <-> rows [T*H/2*W/2, C*1*2*2]   (patch 1x2x2, row order t, h, w)
  audio latent [1, C=32, 2, T]  <-> rows [2*T, C]               (channel-major: ch0 t0..T-1, ch1 ...)
  denoise masks [1, 1, T, H, W] / [1, 1, 2, T] -> [rows] fp32   (a video row takes its patch's max)
  positions [S, 3] float64      ->  angles [S, 6*F] fp32        (F = rope inv_freq length)
  angles [S, rot]               ->  rotation table [1, S, 1, rot/2, 2, 2]
"""

import torch


def patchify_video(latent, patch_size=(1, 2, 2)):
    """[B, C, T, H, W] -> [B*t*h*w, C*pt*ph*pw]."""
    b, c, t_full, h_full, w_full = latent.shape
    pt, ph, pw = patch_size
    t, h, w = t_full // pt, h_full // ph, w_full // pw
    x = latent.reshape(b, c, t, pt, h, ph, w, pw)
    x = torch.einsum("nctrhpwq->nthwcrpq", x)
    return x.reshape(b * t * h * w, c * pt * ph * pw)


def unpatchify_video(rows, t, h, w, c=24, patch_size=(1, 2, 2)):
    """[t*h*w, C*pt*ph*pw] -> [1, C, t*pt, h*ph, w*pw]."""
    pt, ph, pw = patch_size
    x = rows.reshape(-1, t, h, w, c, pt, ph, pw)
    x = torch.einsum("nthwcrpq->nctrhpwq", x)
    return x.reshape(-1, c, t * pt, h * ph, w * pw)


def pack_audio(latent):
    """[B, C, ch, T] -> [ch*T, C] channel-major (batch 1)."""
    return latent[0].permute(1, 2, 0).reshape(latent.shape[2] * latent.shape[3], latent.shape[1])


def unpack_audio(rows, ch=2):
    """[ch*T, C] -> [1, C, ch, T]."""
    t = rows.shape[0] // ch
    return rows.reshape(ch, t, rows.shape[-1]).permute(2, 0, 1).unsqueeze(0)


def mask_row_values(mask, latent_t, lat_h, lat_w):
    """[T, H, W] denoise mask (1 = generate) at the unpadded latent grid -> [latent_t * lat_h/2 * lat_w/2]
    fp32 per-row strength, or None when every row fully generates (upstream's name and contract).

    A row takes the max over its 2x2 patch, so any pixel that generates lets the whole row move; the
    padding repeats the edge pixels.
    """
    m = torch.nn.functional.pad(mask.to(torch.float32), (0, lat_w - mask.shape[-1], 0, lat_h - mask.shape[-2]), mode="replicate")
    values = m.reshape(latent_t, lat_h // 2, 2, lat_w // 2, 2).amax(dim=(2, 4)).reshape(-1)
    return None if bool((values >= 1.0 - 1e-3).all()) else values


def audio_mask_rows(mask):
    """[1, 1, 2, T] audio denoise mask -> [2*T] fp32 per-row strength in pack_audio's row order."""
    return mask[0, 0].to(torch.float32).reshape(-1)


def noise_augmented(rows, aug, seed):
    """aug * rows + (1 - aug) * N(0, 1) from a CPU generator seeded per condition.

    Every condition restarts the same stream on purpose (upstream's behaviour), and a CPU generator
    makes the noise identical on every rank and device.
    """
    if aug >= 1.0:
        return rows
    gen = torch.Generator("cpu").manual_seed(int(seed))
    noise = torch.randn(rows.shape, generator=gen, dtype=torch.float32)
    return aug * rows + (1.0 - aug) * noise.to(rows.device)


def condition_rows(latents, to_rows, aug, seed, device):
    """Concatenated fp32 rows of the condition latents, noise-augmented; None when there are none."""
    rows = [noise_augmented(to_rows(z.to(torch.float32)), aug, seed).to(device) for z in latents]
    return torch.cat(rows, dim=0) if rows else None


def check_condition_rows(n_cond, found, what):
    if found != n_cond:
        raise ValueError(f"MiniMax H3 layout expects {n_cond} {what} condition rows but the conditioning latents give "
                         f"{found}: keyframe/reference latents and their declared sizes (latent_t/h/w, ref_audio_t) "
                         "must match")


def stream_rows(cond_rows, target_rows, n_cond, what):
    """[condition rows | target rows] of one stream, checked against the layout's count."""
    check_condition_rows(n_cond, 0 if cond_rows is None else cond_rows.shape[0], what)
    return target_rows if cond_rows is None else torch.cat([cond_rows, target_rows], dim=0)


def rope_angles(positions, inv_freq):
    """[S, 3] float64 positions -> [S, 6F] fp32 angles: per axis (t, h, w) times inv_freq, duplicated."""
    per_axis = positions.to(torch.float32).to(inv_freq.device).unsqueeze(-1) * inv_freq.view(1, 1, -1)  # [S, 3, F]
    t_f, h_f, w_f = per_axis.unbind(dim=1)
    half = torch.cat((t_f, h_f, w_f), dim=-1)  # [S, 3F]
    return torch.cat((half, half), dim=-1)


def rope_rotation_table(angles, dtype):
    """[S, rot] pair angles -> [1, S, 1, rot/2, 2, 2] rotation matrices."""
    half = angles.shape[-1] // 2
    ang = angles[:, :half]  # duplicated halves: [:, :half] == [:, half:]
    c, s = torch.cos(ang), torch.sin(ang)
    return torch.stack([c, -s, s, c], dim=-1).reshape(1, angles.shape[0], 1, half, 2, 2).to(dtype)
