"""PackedLayout: the static structure of H3's packed token sequence.

``[text | keyframe cond rows | reference blocks | target audio | target video]``, every row with a
float64 (t, h, w) position. The video kinds (cond, ref_img, video) and the audio kinds (cond_audio,
ref_audio, audio) each form one stream of latent rows, ``[condition rows | target rows]``.
"""

import hashlib
import math

import torch

FRAME_PER_TOKEN = (1, 4, 4, 4, 4)
FRAME_RESCALE = 5.0 / 3.0

VIDEO_KINDS = ("cond", "ref_img", "video")
AUDIO_KINDS = ("cond_audio", "ref_audio", "audio")
REF_KINDS = ("image", "audio", "video", "video_audio")


def _axis_from_sqrt_area(dim, patch, sqrt_area):
    # linspace((1 - ratio) / 2, (1 + ratio) / 2, dim // patch, endpoint=False) * 32
    ratio = dim / sqrt_area
    n = dim // patch
    return (torch.arange(n, dtype=torch.float64) * (ratio / n) + (1.0 - ratio) / 2.0) * 32.0


def frame_grid(h, w):
    """Area-normalised (h, w) of one latent frame's 2x2-patch rows: ([h/2*w/2, 2], w axis [w/2])."""
    area = math.sqrt(h * w)
    w_axis = _axis_from_sqrt_area(w, 2, area)
    hh, ww = torch.meshgrid(_axis_from_sqrt_area(h, 2, area), w_axis, indexing="ij")
    return torch.stack([hh.reshape(-1), ww.reshape(-1)], dim=-1), w_axis


def padded_grid(n):
    """A latent dim as the model pads it for the 2x2 patch (pad_to_patch_size); frame_grid's sizes."""
    return n + n % 2


def video_t_spans(n):
    """Time-axis span of each of n latent frames (the first latent frame holds one pixel frame)."""
    return [FRAME_RESCALE * FRAME_PER_TOKEN[k % 5] for k in range(n)]


def video_t_grid(n, origin):
    """[n] float64: origin + exclusive cumulative sum of the frame spans."""
    spans = torch.tensor(video_t_spans(n), dtype=torch.float64)
    return float(origin) + torch.cat([torch.zeros(1, dtype=torch.float64), spans[:-1].cumsum(0)])


def ref_t_span(blk):
    """Time-axis span a reference block occupies ahead of the target streams."""
    kind = blk["kind"]
    if kind == "image":
        return 1.0
    if kind == "audio":
        return float(blk["ref_audio_t"])
    return max(float(blk["ref_audio_t"]), sum(video_t_spans(blk["latent_t"])))


def audio_positions(cursor, t, w_low, w_high):
    """[2t, 3] channel-major stereo rows: t advances per latent frame, w pinned per channel, h = 0."""
    g = torch.zeros(t * 2, 3, dtype=torch.float64)
    g[:, 0] = (cursor + torch.arange(t, dtype=torch.float64)).repeat(2)
    g[:t, 2] = w_low
    g[t:, 2] = w_high
    return g


def video_positions(vt, frame, cursor):
    """[vt * frame_rows, 3] rows of vt latent frames starting at time cursor."""
    g = torch.empty(vt, frame.shape[0], 3, dtype=torch.float64)
    g[:, :, 0] = video_t_grid(vt, cursor)[:, None]
    g[:, :, 1:] = frame[None]
    return g.reshape(-1, 3)


def text_positions(text_len):
    g = torch.zeros(text_len, 3, dtype=torch.float64)
    g[:, 0] = torch.arange(text_len, dtype=torch.float64)
    return g


def _check_refs(refs):
    for i, blk in enumerate(refs):
        kind = blk.get("kind")
        if kind not in REF_KINDS:
            raise ValueError(f"MiniMax H3 reference block {i} has kind {kind!r}; expected one of {REF_KINDS}")


class PackedLayout:
    """Static packed-sequence structure for one shape/conditioning signature.

    Attributes (compatible with upstream's ``comfy.ldm.minimax.model.PackedLayout``):
    ``segments`` [(start, stop, kind)], ``seq_len``, ``position_ids`` [S, 3] float64,
    ``img_pos`` / ``audio_pos`` (row indices of each stream), ``img_update`` / ``audio_update``
    (True on target rows of each stream) and ``signature``.
    """

    def __init__(self, text_len, latent_t, latent_h, latent_w, audio_t, keyframes=None, refs=None):
        refs = list(refs or ())
        _check_refs(refs)
        frame, w_axis = frame_grid(latent_h, latent_w)
        target_audio_w = (float(w_axis[0]), float(w_axis[-1]))
        self._kinds, self._pos = [], []
        self._add("text", text_positions(text_len))

        # refs pack between text and the targets, so the target timeline starts after their spans
        target_origin = float(text_len)
        for blk in refs:
            target_origin += ref_t_span(blk)

        # fl2va: keyframe cond rows share the target spatial grid; anchors count from the target
        # timeline origin, FRAME_RESCALE per pixel frame
        for kf in keyframes or ():
            cond_t = target_origin + FRAME_RESCALE * kf["resolved_frame_index"]
            if kf.get("latent") is not None:
                self._add("cond", video_positions(kf["latent"].shape[2], frame, cond_t))
            if kf.get("audio_latent") is not None:
                self._add("cond_audio", audio_positions(cond_t, kf["audio_latent"].shape[-1], *target_audio_w))

        cursor = float(text_len)
        for blk in refs:
            kind = blk["kind"]
            if kind == "image":
                r_frame, _ = frame_grid(padded_grid(blk["latent_h"]), padded_grid(blk["latent_w"]))
                g = torch.empty(r_frame.shape[0], 3, dtype=torch.float64)
                g[:, 0] = cursor
                g[:, 1:] = r_frame
                self._add("ref_img", g)
            elif kind == "audio":
                if blk["ref_audio_t"] > 0:
                    self._add("ref_audio", audio_positions(cursor, blk["ref_audio_t"], *target_audio_w))
            else:
                # the block's audio rows pack immediately before its video rows, both at the cursor
                r_frame, r_w_axis = frame_grid(padded_grid(blk["latent_h"]), padded_grid(blk["latent_w"]))
                if blk["ref_audio_t"] > 0:
                    self._add("ref_audio", audio_positions(cursor, blk["ref_audio_t"], float(r_w_axis[0]), float(r_w_axis[-1])))
                self._add("ref_img", video_positions(blk["latent_t"], r_frame, cursor))
            cursor += ref_t_span(blk)

        # target audio then target video, always the last two segments
        self._add("audio", audio_positions(cursor, audio_t, *target_audio_w))
        self._add("video", video_positions(latent_t, frame, cursor))
        self._finish()
        self.signature = (text_len, latent_t, latent_h, latent_w, audio_t)

    def _add(self, kind, positions):
        self._kinds.append((kind, positions.shape[0]))
        self._pos.append(positions)

    def _finish(self):
        segments, img_pos, img_update, audio_pos, audio_update = [], [], [], [], []
        off = 0
        for kind, n in self._kinds:
            segments.append((off, off + n, kind))
            if kind in VIDEO_KINDS:
                img_pos.append(torch.arange(off, off + n))
                img_update.append(torch.full((n,), kind == "video", dtype=torch.bool))
            elif kind in AUDIO_KINDS:
                audio_pos.append(torch.arange(off, off + n))
                audio_update.append(torch.full((n,), kind == "audio", dtype=torch.bool))
            off += n
        self.segments = segments
        self.seq_len = off
        self.position_ids = torch.cat(self._pos)
        self.img_pos, self.img_update = torch.cat(img_pos), torch.cat(img_update)
        self.audio_pos, self.audio_update = torch.cat(audio_pos), torch.cat(audio_update)
        del self._kinds, self._pos

    def segment(self, kind):
        """(start, stop) of the single segment of a target kind ('audio' or 'video')."""
        return next((a, b) for a, b, k in self.segments if k == kind)

    @property
    def video_cond_rows(self):
        return int((~self.img_update).sum())

    @property
    def audio_cond_rows(self):
        return int((~self.audio_update).sum())

    def has_kind(self, *kinds):
        return any(k in kinds for _, _, k in self.segments)

    def fingerprint(self):
        """sha256 over the segment table and the exact position bytes (for plan digests)."""
        h = hashlib.sha256(repr((self.signature, self.segments)).encode())
        h.update(self.position_ids.contiguous().numpy().tobytes())
        return h.hexdigest()

    def __repr__(self):
        segs = ", ".join(f"{k}[{a}:{b}]" for a, b, k in self.segments)
        return f"PackedLayout(seq_len={self.seq_len}, {segs})"
