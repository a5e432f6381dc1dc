"""H3's timestep domain and the per-segment conditioning derived from it.

A token's t is 1 - sigma of its stream (the sampler passes the video sigma * 1000; audio runs on its
own shifted schedule). adaLN rows are evaluated once per distinct t; a segment uses mod row
t_row * 3 + tag (video 0, text 1, audio 2); rows a denoise mask holds back get per-row rows. All
arithmetic matches upstream's float32 expressions.
"""

import torch

VISUAL_COND_TIMESTEP = 0.999
AUDIO_COND_TIMESTEP = 1.0
MODALITY_TAG = {"video": 0, "text": 1, "audio": 2,
                "cond": 0, "ref_img": 0, "cond_audio": 2, "ref_audio": 2}


def time_shift_sigma(sigma, from_shift, to_shift):
    # invert sigma = s*b/(1+(s-1)*b) to the base grid, re-apply the other shift
    base = sigma / (from_shift + sigma * (1.0 - from_shift))
    return to_shift * base / (1.0 + (to_shift - 1.0) * base)


def sigma_shifts(transformer_options, default_video, default_audio):
    """(video, audio) sigma shifts, overridable per run through transformer_options."""
    return (float(transformer_options.get("minimax_h3_sigma_shift_video", default_video)),
            float(transformer_options.get("minimax_h3_sigma_shift_audio", default_audio)))


def video_sigma(timestep):
    """[B] timestep (sigma * 1000) -> 0-dim float32 video sigma, clamped away from 0."""
    return (timestep.flatten()[0] / 1000.0).float().clamp(min=1e-6)


def audio_carry(timestep, shift_v, shift_a):
    """(sigma_v, sigma_a): the sampler carries audio as (sigma_v / sigma_a)^-1 scaled latents."""
    sigma_v = video_sigma(timestep)
    return sigma_v, time_shift_sigma(sigma_v, shift_v, shift_a)


def carried_audio_velocity(out_audio, carried_audio, scale, sigma_a):
    """Velocity of the carried audio variable (d/d sigma_v) from the stream's own velocity."""
    return (1.0 - scale) * carried_audio + (1.0 + (scale - 1.0) * sigma_a).to(out_audio.dtype) * out_audio


class TimestepPlan:
    """Per-segment timesteps and the sorted distinct timesteps (the adaLN rows) of one step.

    video_mask / audio_mask: [rows] fp32 per-target-row denoise strength (1 = generate, pooled to
    the token grid) or None. A row of strength m runs at sigma = m * sigma of its stream, so its
    t is 1 - m * sigma, never above the condition rows' level.
    """

    def __init__(self, sigma_v, shift_v, shift_a, layout, vis_aug=VISUAL_COND_TIMESTEP, aud_aug=AUDIO_COND_TIMESTEP,
                 video_mask=None, audio_mask=None):
        sigma = torch.tensor(float(sigma_v), dtype=torch.float32)
        self.t_video = float(1.0 - sigma)
        self.t_audio = float(1.0 - time_shift_sigma(sigma, shift_v, shift_a))
        vis_aug, aud_aug = float(vis_aug), float(aud_aug)
        t_vis_cond = max(self.t_video, vis_aug)
        t_aud_cond = max(self.t_audio, aud_aug)
        self.segment_t = {"text": self.t_video, "video": self.t_video, "audio": self.t_audio,
                          "cond": t_vis_cond, "ref_img": t_vis_cond,
                          "cond_audio": t_aud_cond, "ref_audio": t_aud_cond}
        # upstream scales the video mask by the fp32 sigma tensor and the audio mask by a Python float
        self.row_t = {}  # target kind -> [rows] fp32 t of its rows, where a mask makes them differ
        for kind, mask, stream_sigma, pin in (("video", video_mask, sigma, max(self.t_video, VISUAL_COND_TIMESTEP)),
                                              ("audio", audio_mask, 1.0 - self.t_audio, max(self.t_audio, AUDIO_COND_TIMESTEP))):
            if mask is None or bool((mask >= 1.0 - 1e-3).all()):
                continue
            rows_t = (1.0 - mask * stream_sigma).clamp(max=pin)
            if rows_t.unique().numel() == 1:
                self.segment_t[kind] = float(rows_t[0])  # one level: the segment keeps a single mod row
            else:
                self.row_t[kind] = rows_t
        unique = {self.t_video, self.t_audio} | {self.segment_t[k] for _, _, k in layout.segments}
        for rows_t in self.row_t.values():
            unique.update(rows_t.unique().tolist())
        self.unique_t = tuple(sorted(unique))
        self.t_row = {t: i for i, t in enumerate(self.unique_t)}

    def mod_row(self, kind, tag=None):
        """Row of the [n_unique_t * 3, hidden] adaLN outputs used by a segment of this kind."""
        return self.t_row[self.segment_t[kind]] * 3 + (MODALITY_TAG[kind] if tag is None else tag)

    def target_rows(self, kind):
        """t_row of a target segment ('video' / 'audio'): an int, or a [rows] LongTensor where a mask varies it."""
        rows_t = self.row_t.get(kind)
        if rows_t is None:
            return self.t_row[self.segment_t[kind]]
        levels = rows_t.unique()  # sorted
        index = torch.tensor([self.t_row[t] for t in levels.tolist()], dtype=torch.long)
        return index[torch.searchsorted(levels, rows_t)]

    def segment_mod_row(self, kind):
        """mod_row of a segment of this kind: per row ([rows] LongTensor) on a masked target segment."""
        if kind in self.row_t:
            return self.target_rows(kind) * 3 + MODALITY_TAG[kind]
        return self.mod_row(kind)

    def t_values(self, device):
        return torch.tensor(self.unique_t, dtype=torch.float32, device=device)


def text_tag_runs(tags, length):
    """Runs of equal modality tags over the text span: [(start, stop, tag)] relative to the span.

    The presentation text mixes tags (vision pad tokens carry the video modality), so the text span
    is modulated run by run.
    """
    tags = [int(t) for t in tags.reshape(-1).tolist()]
    if len(tags) < length:
        raise ValueError(f"MiniMax H3 text_token_tags has {len(tags)} entries but the text has {length} tokens; "
                         "the tags must come from the same tokenisation as the conditioning")
    tags = tags[:length]
    bad = sorted({t for t in tags if t not in (0, 1, 2)})
    if bad:
        raise ValueError(f"MiniMax H3 text_token_tags must be modality tags 0 (video), 1 (text) or 2 (audio); found {bad}")
    runs, start = [], 0
    for i in range(1, length + 1):
        if i == length or tags[i] != tags[start]:
            runs.append((start, i, tags[start]))
            start = i
    return runs


# minimax_payload key holding the text's tag runs: the payload (a CONDConstant) lives for a whole sampling
# run and reaches sequence-parallel ranks as JSON, so the tags are read back from their device only once
TAG_RUNS_KEY = "text_token_tag_runs"


def payload_tag_runs(payload, length):
    """text_tag_runs of payload["text_token_tags"] over `length` text tokens, cached in the payload; None without tags."""
    tags = payload.get("text_token_tags")
    if tags is None:
        return None
    key = [int(length), int(tags.numel())]
    cached = payload.get(TAG_RUNS_KEY)
    if not isinstance(cached, dict) or cached.get("for") != key:
        cached = {"for": key, "runs": [list(r) for r in text_tag_runs(tags, length)]}
        payload[TAG_RUNS_KEY] = cached
    return [tuple(r) for r in cached["runs"]]


def mod_segments(layout, timesteps, text_tags=None, tag_runs=None):
    """[(start, stop, mod_row)] covering the whole sequence contiguously; mod_row is an int, or a
    [stop - start] LongTensor on a target segment a denoise mask varies. The text span is split by
    `tag_runs` (text_tag_runs' result) or the runs of `text_tags`."""
    out = []
    for a, b, kind in layout.segments:
        if kind == "text" and tag_runs is None and text_tags is not None:
            tag_runs = text_tag_runs(text_tags, b - a)
        if kind == "text" and tag_runs is not None:
            base = timesteps.mod_row(kind, tag=0)
            out.extend((a + s, a + e, base + tag) for s, e, tag in tag_runs)
        else:
            out.append((a, b, timesteps.segment_mod_row(kind)))
    return out


def curve_t_emb(table, t_vals):
    """Curve-form checkpoints: linear interpolation in the [grid, t_dim] time-embedding table."""
    pos = t_vals.clamp(0.0, 1.0) * (table.shape[0] - 1)
    # the max-clamp keeps t = 1.0 on the last interval instead of reading past the table
    i0 = pos.floor().long().clamp(max=table.shape[0] - 2)
    return torch.lerp(table[i0], table[i0 + 1], (pos - i0).unsqueeze(1))
