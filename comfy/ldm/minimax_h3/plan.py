"""ForwardPlan (everything one step derives from its inputs) and ShardPlan (one rank's view).

Both are pure data, identical wherever they are built from the same inputs; ``ForwardPlan.digest()``
lets ranks prove they agree before any collective. A ShardPlan rebases every row-indexed quantity
onto the rows a rank holds, so the model's per-token code never branches on the rank.
"""

import hashlib
import json
from dataclasses import dataclass, field

import torch

from .conditioning import AUDIO_COND_TIMESTEP, VISUAL_COND_TIMESTEP, TimestepPlan, mod_segments, payload_tag_runs
from .layout import AUDIO_KINDS, VIDEO_KINDS, PackedLayout
from .modulation import clip_segments

PLAN_VERSION = 3


def balanced_ranges(total, parts):
    """Split range(total) into `parts` contiguous ranges whose sizes differ by at most one."""
    base, extra = divmod(total, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return tuple(out)


@dataclass(frozen=True)
class ForwardPlan:
    layout: PackedLayout = field(repr=False)
    latent_thw: tuple           # padded video latent (T, H, W)
    orig_thw: tuple             # unpadded (T, H, W) the output is cropped to
    audio_t: int
    text_len: int
    refine_text: bool           # context is raw Qwen states: run condition_proj + token refiner
    sigma: float                # video sigma (float32 value)
    timesteps: TimestepPlan = field(repr=False)
    mod_segments: tuple         # global (start, stop, mod_row); mod_row an int or a per-row LongTensor (masks)
    video_seg: tuple            # (start, stop, t_row) of the target video rows; t_row an int or a per-row LongTensor
    audio_seg: tuple
    vis_aug: float
    aud_aug: float
    seed: int
    model_key: str              # config + dtype of the model that built it
    pdd: object = None          # pdd.PddHeads of a model with a PDD head bank, else None

    @classmethod
    def build(cls, video_shape, orig_thw, audio_shape, context_shape, sigma, shifts, payload, model_key, hidden_size,
              masks=(None, None)):
        """masks: (video, audio) [rows] fp32 CPU strength of the target rows (embedding.mask_row_values /
        audio_mask_rows), or None for a stream that fully generates."""
        _, _, lt, lh, lw = video_shape
        audio_t, text_len = audio_shape[-1], context_shape[1]
        layout = payload.get("layout")
        # a layout prebuilt by another implementation (or for other shapes) is rebuilt as ours
        if not isinstance(layout, PackedLayout) or layout.signature != (text_len, lt, lh, lw, audio_t):
            layout = PackedLayout(text_len, lt, lh, lw, audio_t, keyframes=payload.get("keyframes"), refs=payload.get("refs"))
        vis_aug = float(payload.get("visual_cond_noise_aug", VISUAL_COND_TIMESTEP))
        aud_aug = float(payload.get("audio_cond_noise_aug", AUDIO_COND_TIMESTEP))
        ts = TimestepPlan(sigma, shifts[0], shifts[1], layout, vis_aug, aud_aug, video_mask=masks[0], audio_mask=masks[1])
        va, vb = layout.segment("video")
        aa, ab = layout.segment("audio")
        return cls(layout=layout, latent_thw=(lt, lh, lw), orig_thw=tuple(orig_thw), audio_t=audio_t, text_len=text_len,
                   refine_text=context_shape[-1] != hidden_size, sigma=float(sigma), timesteps=ts,
                   mod_segments=tuple(mod_segments(layout, ts, tag_runs=payload_tag_runs(payload, text_len))),
                   video_seg=(va, vb, ts.target_rows("video")), audio_seg=(aa, ab, ts.target_rows("audio")),
                   vis_aug=vis_aug, aud_aug=aud_aug, seed=int(payload.get("seed", 0)), model_key=model_key)

    @property
    def seq_len(self):
        return self.layout.seq_len

    def describe(self):
        """JSON-able summary: every scalar the step depends on (positions enter via their hash)."""
        return {"version": PLAN_VERSION, "seq_len": self.seq_len, "latent_thw": list(self.latent_thw),
                "orig_thw": list(self.orig_thw), "audio_t": self.audio_t, "text_len": self.text_len,
                "refine_text": self.refine_text, "sigma": self.sigma.hex(),
                "unique_t": [t.hex() for t in self.timesteps.unique_t],
                "segments": [list(s) for s in self.layout.segments], "mod_segments": [_segment_json(s) for s in self.mod_segments],
                "video_seg": _segment_json(self.video_seg), "audio_seg": _segment_json(self.audio_seg),
                "vis_aug": self.vis_aug.hex(), "aud_aug": self.aud_aug.hex(), "seed": self.seed,
                "layout": self.layout.fingerprint(), "model": self.model_key,
                "pdd": None if self.pdd is None else self.pdd.describe()}

    def digest(self):
        blob = json.dumps(self.describe(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()

    def shard(self, world_size=1, rank=0, heads=None):
        return ShardPlan.build(self, world_size, rank, heads)


def _segment_json(segment):
    """(start, stop, row) for a digest: a per-row LongTensor enters by its length and content hash."""
    a, b, row = segment
    if isinstance(row, torch.Tensor):
        row = {"rows": row.numel(), "sha256": hashlib.sha256(row.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()}
    return [a, b, row]


def _stream_offsets(segments, kinds):
    """Start of each segment within its stream (rows of `kinds` in sequence order)."""
    off, out = 0, {}
    for a, b, k in segments:
        if k in kinds:
            out[a] = off
            off += b - a
    return out


@dataclass(frozen=True)
class ShardPlan:
    """One rank's view of a ForwardPlan: rows [row_start, row_stop) and heads [head_start, head_stop).

    pieces: (local_start, local_stop, source, source_row) -- where each local row's embedding comes
    from: "text" (refined text states), "video" / "audio" (row of that stream's projected rows).
    """
    rank: int
    world_size: int
    row_ranges: tuple           # (start, stop) of every rank, contiguous and balanced
    head_ranges: tuple          # (start, stop) heads of every rank after the all-to-all (pipelined chunks keep
                                # the counts and order heads chunk-major: UlyssesAttention.chunk_heads)
    pieces: tuple
    mod_segments: tuple         # local (start, stop, mod_row)
    video_seg: tuple            # local (start, stop, t_row) of the target video rows held
    audio_seg: tuple
    video_rows: tuple           # (start, stop) of those rows within the target video rows
    audio_rows: tuple
    target_counts: tuple        # (video rows, audio rows) of the targets every rank holds

    @classmethod
    def build(cls, plan, world_size=1, rank=0, heads=None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size}")
        if world_size > plan.seq_len:
            raise ValueError(f"cannot shard {plan.seq_len} rows over {world_size} ranks")
        if heads is not None and world_size > heads:
            raise ValueError(f"sequence parallelism over {world_size} ranks needs at least {world_size} attention heads; "
                             f"the model has {heads}: use at most {heads} ranks")
        rows = balanced_ranges(plan.seq_len, world_size)
        r0, r1 = rows[rank]
        video_off = _stream_offsets(plan.layout.segments, VIDEO_KINDS)
        audio_off = _stream_offsets(plan.layout.segments, AUDIO_KINDS)
        pieces = []
        for a, b, kind in plan.layout.segments:
            a2, b2 = max(a, r0), min(b, r1)
            if a2 >= b2:
                continue
            if kind == "text":
                pieces.append((a2 - r0, b2 - r0, "text", a2 - a))
            elif kind in VIDEO_KINDS:
                pieces.append((a2 - r0, b2 - r0, "video", video_off[a] + a2 - a))
            else:
                pieces.append((a2 - r0, b2 - r0, "audio", audio_off[a] + a2 - a))

        def target(seg):
            a, b, t_row = seg
            a2, b2 = max(a, r0), min(b, r1)
            if a2 >= b2:
                return (0, 0, t_row[0:0] if isinstance(t_row, torch.Tensor) else t_row), (0, 0)
            return (a2 - r0, b2 - r0, t_row[a2 - a:b2 - a] if isinstance(t_row, torch.Tensor) else t_row), (a2 - a, b2 - a)

        video_seg, video_rows = target(plan.video_seg)
        audio_seg, audio_rows = target(plan.audio_seg)

        def overlap(seg, lo, hi):
            return max(0, min(seg[1], hi) - max(seg[0], lo))

        counts = tuple((overlap(plan.video_seg, lo, hi), overlap(plan.audio_seg, lo, hi)) for lo, hi in rows)
        return cls(rank=rank, world_size=world_size, row_ranges=rows,
                   head_ranges=balanced_ranges(heads, world_size) if heads is not None else ((0, 0),) * world_size,
                   pieces=tuple(pieces), mod_segments=tuple(clip_segments(plan.mod_segments, r0, r1)),
                   video_seg=video_seg, audio_seg=audio_seg, video_rows=video_rows, audio_rows=audio_rows,
                   target_counts=counts)

    @property
    def row_start(self):
        return self.row_ranges[self.rank][0]

    @property
    def row_stop(self):
        return self.row_ranges[self.rank][1]

    @property
    def rows(self):
        return self.row_stop - self.row_start

    def source_range(self, source):
        """(first, stop) rows of a source stream this shard embeds; (0, 0) when none."""
        spans = [(off, off + b - a) for a, b, s, off in self.pieces if s == source]
        if not spans:
            return (0, 0)
        return (spans[0][0], spans[-1][1])

    def positions(self, plan):
        """[rows, 3] float64 positions of the rows held."""
        return plan.layout.position_ids[self.row_start:self.row_stop]

    def __str__(self):
        lines = [f"ShardPlan rank {self.rank}/{self.world_size}: rows [{self.row_start}, {self.row_stop}) "
                 f"heads {self.head_ranges[self.rank]}"]
        lines += [f"  embed rows [{a}, {b}) <- {s}[{o}:{o + b - a}]" for a, b, s, o in self.pieces]
        lines.append(f"  mod segments {list(self.mod_segments)}")
        lines.append(f"  target video rows {self.video_rows} at local {self.video_seg[:2]}, "
                     f"audio rows {self.audio_rows} at local {self.audio_seg[:2]}")
        return "\n".join(lines)

