"""The per-step plan of the MiniMax H3 forward, and one rank's shard of it.

ForwardPlan is what a step derives from its packed layout and timesteps: the distinct timesteps,
the modulation row of every packed row and the target segments. ShardPlan rebases it onto the
contiguous rows one rank holds. Both are plain data; the model's per-token code runs the same on a
shard as on the whole sequence, and natively the one shard is every row.
"""

import torch

# modulation tag of each segment kind: 0 video, 1 text, 2 audio
SEG_TAG = {"text": 1, "video": 0, "audio": 2, "cond": 0, "ref_img": 0, "cond_audio": 2, "ref_audio": 2}


def balanced_ranges(total, parts):
    """range(total) as `parts` contiguous (start, stop) ranges whose sizes differ by at most one."""
    base, extra = divmod(total, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def clip_segment(segment, start, stop):
    """(a, b, row) clipped to rows [start, stop) and rebased to start (empty when they do not meet).

    row is a mod-row index, or a per-row LongTensor that is sliced with the rows."""
    a, b, row = segment
    a2 = min(max(a, start), stop)
    b2 = max(min(b, stop), a2)
    if isinstance(row, torch.Tensor) and (a2, b2) != (a, b):
        row = row[a2 - a:b2 - a]
    return (a2 - start, b2 - start, row)


class ForwardPlan:
    """t_v / t_a: the video and audio stream timesteps (t = 1 - sigma); video_rows_t / audio_rows_t:
    per-row timesteps of the target rows under a denoise mask, or None."""

    def __init__(self, layout, t_v, t_a, vis_aug, aud_aug, text_tags=None, video_rows_t=None, audio_rows_t=None):
        self.layout = layout
        # distinct timesteps are known analytically: text/pad follow video, cond rows pin near 1
        seg_t = {"text": t_v, "video": t_v, "audio": t_a,
                 "cond": max(t_v, vis_aug), "ref_img": max(t_v, vis_aug),
                 "cond_audio": max(t_a, aud_aug), "ref_audio": max(t_a, aud_aug)}
        # a mask that keeps every row at one strength runs its stream at that single timestep
        if video_rows_t is not None and video_rows_t.unique().numel() == 1:
            seg_t["video"] = float(video_rows_t[0])
            video_rows_t = None
        if audio_rows_t is not None and audio_rows_t.unique().numel() == 1:
            seg_t["audio"] = float(audio_rows_t[0])
            audio_rows_t = None

        self.unique_t = sorted({t_v, t_a} | {seg_t[k] for _, _, k in layout.segments}
                               | (set(video_rows_t.unique().tolist()) if video_rows_t is not None else set())
                               | (set(audio_rows_t.unique().tolist()) if audio_rows_t is not None else set()))
        t_row = {t: i for i, t in enumerate(self.unique_t)}

        def rows_to_mod_index(rows_t, tag):
            # per-row timestep values -> per-row mod-row indices into the t_emb table
            levels = rows_t.unique()
            base = torch.tensor([t_row[v] * 3 + tag for v in levels.tolist()], dtype=torch.long, device=rows_t.device)
            return base[torch.searchsorted(levels, rows_t)]

        self.mod_segments = []
        for a, b, kind in layout.segments:
            row_base = t_row[seg_t[kind]] * 3
            if kind == "text" and text_tags is not None:
                # the presentation text span mixes tags (vision pads carry the video modality) split into tag runs
                tags = text_tags.view(-1).tolist()
                run_start = 0
                for i in range(1, b - a + 1):
                    if i == b - a or tags[i] != tags[run_start]:
                        self.mod_segments.append((a + run_start, a + i, row_base + int(tags[run_start])))
                        run_start = i
            elif kind == "video" and video_rows_t is not None:
                self.mod_segments.append((a, b, rows_to_mod_index(video_rows_t, SEG_TAG[kind])))
            elif kind == "audio" and audio_rows_t is not None:
                self.mod_segments.append((a, b, rows_to_mod_index(audio_rows_t, SEG_TAG[kind])))
            else:
                self.mod_segments.append((a, b, row_base + SEG_TAG[kind]))

        # target streams are single contiguous segments (audio then video, last two); their row is a t_emb row
        va, vb, _ = next(s for s in layout.segments if s[2] == "video")
        aa, ab, _ = next(s for s in layout.segments if s[2] == "audio")
        if video_rows_t is not None:
            self.video_seg = (va, vb, rows_to_mod_index(video_rows_t, 0) // 3)
        else:
            self.video_seg = (va, vb, t_row[seg_t["video"]])
        if audio_rows_t is not None:
            self.audio_seg = (aa, ab, rows_to_mod_index(audio_rows_t, 0) // 3)
        else:
            self.audio_seg = (aa, ab, t_row[seg_t["audio"]])

    def shard(self, world_size=1, rank=0):
        return ShardPlan(self, world_size, rank)


class ShardPlan:
    """Rows [start, stop) of a ForwardPlan, one of `world_size` balanced contiguous ranges.

    mod_segments, video_seg and audio_seg are local to those rows; a target segment is empty on a
    shard that holds none of its rows.
    """

    def __init__(self, plan, world_size=1, rank=0):
        self.plan = plan  # the whole sequence's: what a block patch that runs on every row needs
        self.rank = rank
        self.world_size = world_size
        self.row_ranges = balanced_ranges(plan.layout.seq_len, world_size)
        self.start, self.stop = self.row_ranges[rank]
        self.mod_segments = [s for s in (clip_segment(s, self.start, self.stop) for s in plan.mod_segments) if s[0] < s[1]]
        self.video_seg = clip_segment(plan.video_seg, self.start, self.stop)
        self.audio_seg = clip_segment(plan.audio_seg, self.start, self.stop)

        def held(seg, a, b):
            return max(0, min(seg[1], b) - max(seg[0], a))

        # (video, audio) target rows of every rank, in rank order: what a gather receives
        self.target_counts = [(held(plan.video_seg, a, b), held(plan.audio_seg, a, b)) for a, b in self.row_ranges]
