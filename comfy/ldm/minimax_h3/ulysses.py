"""Ulysses sequence parallelism for the MiniMax H3 forward.

``UlyssesParallel`` is what the forward reads from ``transformer_options["minimax_h3_sequence_parallel"]``:
each rank embeds and runs its own contiguous rows (ShardPlan); inside attention, two all-to-alls
with exact uneven splits (no padding row ever acts as a key) trade rows for heads:

  q|k|v          [s_r, 3, H, D]   --all_to_all-->  [S, 3, h_r, D]   (S = sum of s_j)
  attention out  [S, h_r * D]     --all_to_all-->  [s_r, H * D]

and the target velocity rows are gathered on every rank at the end.
"""

import torch
import torch.distributed as dist

from .plan import balanced_ranges


class UlyssesParallel:
    def __init__(self, rank, world_size, heads, group=None):
        if world_size > heads:
            raise ValueError("MiniMax H3 has {} attention heads: use at most {} ranks".format(heads, heads))
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.head_ranges = balanced_ranges(heads, world_size)

    def attention(self, attn, shard):
        """The attention of `attn` (an H3 Attention) over the rows of every rank, for DiTBlock.forward."""
        rows = [b - a for a, b in shard.row_ranges]

        def forward(x, rope_freqs=None, transformer_options={}):
            q, k, v = attn.project_qkv(x, rope_freqs)
            q, k, v = self.heads_to_rows(torch.stack((q, k, v), dim=1), rows).unbind(1)
            out = attn.attend(q, k, v, transformer_options)
            return attn.out_proj(self.rows_to_heads(out, rows))
        return forward

    def heads_to_rows(self, qkv, rows):
        # [s_r, 3, H, D] -> [S, 3, h_r, D]
        s_r, _, _, d = qkv.shape
        a, b = self.head_ranges[self.rank]
        send = torch.cat([qkv[:, :, h0:h1].reshape(-1) for h0, h1 in self.head_ranges])
        recv = torch.empty(sum(rows) * 3 * (b - a) * d, dtype=qkv.dtype, device=qkv.device)
        dist.all_to_all_single(recv, send, output_split_sizes=[n * 3 * (b - a) * d for n in rows],
                               input_split_sizes=[s_r * 3 * (h1 - h0) * d for h0, h1 in self.head_ranges], group=self.group)
        return recv.view(sum(rows), 3, b - a, d)

    def rows_to_heads(self, out, rows):
        # [S, h_r * D] -> [s_r, H * D], heads in global order
        s_r = rows[self.rank]
        width = out.shape[1] // (self.head_ranges[self.rank][1] - self.head_ranges[self.rank][0])
        splits = [s_r * (h1 - h0) * width for h0, h1 in self.head_ranges]
        recv = torch.empty(sum(splits), dtype=out.dtype, device=out.device)
        dist.all_to_all_single(recv, out.contiguous().view(-1), output_split_sizes=splits,
                               input_split_sizes=[n * out.shape[1] for n in rows], group=self.group)
        return torch.cat([p.view(s_r, -1) for p in recv.split(splits)], dim=1)

    def gather(self, shard, video_rows, audio_rows):
        """Every rank's target velocity rows -> the full (video, audio) rows, on every rank."""
        widths = (video_rows.shape[1], audio_rows.shape[1])
        sizes = [nv * widths[0] + na * widths[1] for nv, na in shard.target_counts]
        send = torch.cat([video_rows.reshape(-1), audio_rows.reshape(-1)])
        recv = torch.empty(sum(sizes), dtype=send.dtype, device=send.device)
        dist.all_to_all_single(recv, send.repeat(self.world_size), output_split_sizes=sizes,
                               input_split_sizes=[send.numel()] * self.world_size, group=self.group)
        video, audio = [], []
        for (nv, na), part in zip(shard.target_counts, recv.split(sizes)):
            v, a = part.split([nv * widths[0], na * widths[1]])
            video.append(v.view(nv, widths[0]))
            audio.append(a.view(na, widths[1]))
        return torch.cat(video), torch.cat(audio)
