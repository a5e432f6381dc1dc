"""Ulysses sequence parallelism for H3: the only place where H3 issues collectives.

Each rank holds a contiguous, balanced block of rows (uneven by at most one row) and, inside
attention, a contiguous block of heads (uneven by at most one head, so any world size up to the
head count works without padding). Two all-to-alls per block, both with exact split sizes, so no
padding row ever exists, let alone acts as a key:

  packed q|k|v   [s_r, 3, H, D]   --all_to_all-->  [S, 3, h_r, D]   (S = sum of s_i)
  attention out  [S, h_r * D]     --all_to_all-->  [s_r, H * D]

With one rank nothing here is called: the model runs its native path.
"""

import torch
import torch.distributed as dist

from . import kernels
from .step_io import check_replicable_options


class UlyssesAttention:
    """All-to-all attention over `group` for the rows and heads a ShardPlan assigns."""

    def __init__(self, shard, heads, head_dim, group=None):
        self.group = group
        self.rank = shard.rank
        self.world_size = shard.world_size
        self.head_dim = head_dim
        self.rows = [b - a for a, b in shard.row_ranges]
        self.head_ranges = shard.head_ranges
        self.heads = [b - a for a, b in shard.head_ranges]
        if sum(self.heads) != heads:
            raise ValueError(f"ShardPlan splits {sum(self.heads)} heads but the model has {heads}; build it with heads={heads}")

    def pack_heads(self, qkv):
        """[s_r, 3, H, D] -> flat [rank 0's heads | rank 1's heads | ...], each [s_r, 3, h_j, D]: one copy."""
        s_r, d = qkv.shape[0], self.head_dim
        send = torch.empty(qkv.numel(), dtype=qkv.dtype, device=qkv.device)
        off = 0
        for a, b in self.head_ranges:
            n = s_r * 3 * (b - a) * d
            send[off:off + n].view(s_r, 3, b - a, d).copy_(qkv[:, :, a:b])
            off += n
        return send

    def heads_to_seq(self, qkv):
        """[s_r, 3, H, D] rows of all heads -> [S, 3, h_r, D] all rows of this rank's heads."""
        d, s_r, h_r = self.head_dim, self.rows[self.rank], self.heads[self.rank]
        send = self.pack_heads(qkv)
        recv = torch.empty(sum(self.rows) * 3 * h_r * d, dtype=qkv.dtype, device=qkv.device)
        dist.all_to_all_single(recv, send, output_split_sizes=[s * 3 * h_r * d for s in self.rows],
                               input_split_sizes=[s_r * 3 * h * d for h in self.heads], group=self.group)
        return recv.view(-1, 3, h_r, d)

    def seq_to_heads(self, out):
        """[S, h_r * D] all rows of this rank's heads -> [s_r, H * D] this rank's rows of all heads."""
        d, s_r, h_r = self.head_dim, self.rows[self.rank], self.heads[self.rank]
        recv = torch.empty(s_r * sum(self.heads) * d, dtype=out.dtype, device=out.device)
        dist.all_to_all_single(recv, out.contiguous().view(-1), output_split_sizes=[s_r * h * d for h in self.heads],
                               input_split_sizes=[s * h_r * d for s in self.rows], group=self.group)
        return torch.cat([c.view(s_r, -1) for c in recv.split([s_r * h * d for h in self.heads])], dim=1)

    def attention(self, qkv, transformer_options):
        """[s_r, 3, H, D] normed + roped local q|k|v -> [s_r, H * D] attention output."""
        full = self.heads_to_seq(qkv)
        out = kernels.attention(full[:, 0], full[:, 1], full[:, 2], self.heads[self.rank], transformer_options)
        return self.seq_to_heads(out)


def gather_targets(shard, video_rows, audio_rows, dst=0, group=None):
    """Every rank's fp32 target velocity rows -> the full (video, audio) rows on rank `dst`.

    One all-to-all in which only `dst` receives; other ranks get (None, None).
    """
    widths = (video_rows.shape[1], audio_rows.shape[1])
    sizes = [nv * widths[0] + na * widths[1] for nv, na in shard.target_counts]
    send = torch.cat([video_rows.reshape(-1), audio_rows.reshape(-1)])
    mine = shard.rank == dst
    recv = torch.empty(sum(sizes) if mine else 0, dtype=send.dtype, device=send.device)
    dist.all_to_all_single(recv, send, output_split_sizes=sizes if mine else [0] * shard.world_size,
                           input_split_sizes=[send.numel() if r == dst else 0 for r in range(shard.world_size)], group=group)
    if not mine:
        return None, None
    video, audio = [], []
    for (nv, na), part in zip(shard.target_counts, recv.split(sizes)):
        v, a = part.split([nv * widths[0], na * widths[1]])
        video.append(v.view(nv, widths[0]))
        audio.append(a.view(na, widths[1]))
    return torch.cat(video), torch.cat(audio)


def sharded_forward(model, plan, rank, world_size, video_x, audio_x, context, payload, transformer_options, group=None):
    """This rank's part of one step; returns the full (video, audio) target rows on rank 0, else (None, None)."""
    check_replicable_options(transformer_options)
    shard = plan.shard(world_size, rank, model.num_heads)
    sp = UlyssesAttention(shard, model.num_heads, model.config["attention_head_dim"], group=group)
    v, a = model.run(plan, shard, video_x, audio_x, context, payload, transformer_options, seq_parallel=sp)
    return gather_targets(shard, v, a, group=group)
