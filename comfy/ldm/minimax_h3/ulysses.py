"""Ulysses sequence parallelism for H3: the only place where H3 issues collectives.

Each rank holds a contiguous, balanced block of rows (uneven by at most one row) and, inside
attention, a contiguous block of heads (uneven by at most one head, so any world size up to the
head count works without padding). Two all-to-alls per block, both with exact split sizes, so no
padding row ever exists, let alone acts as a key:

  packed q|k|v   [s_r, 3, H, D]   --all_to_all-->  [S, 3, h_r, D]   (S = sum of s_i)
  attention out  [S, h_r * D]     --all_to_all-->  [s_r, H * D]

Both are cut by head into pipelined chunks so transfers overlap attention (UlyssesAttention). Once
per step an all-gather shares the blocks' adaLN projections, each computed by one rank.

With one rank nothing here is called: the model runs its native path.
"""

import torch
import torch.distributed as dist

from . import kernels
from .plan import balanced_ranges
from .step_io import check_replicable_options


# Pipeline depth of the attention all-to-alls (UlyssesAttention's `chunks`); see bench/results/h3_h200_overlap.json.
DEFAULT_CHUNKS = 2


class UlyssesAttention:
    """All-to-all attention over `group` for the rows and heads a ShardPlan assigns.

    With ``chunks`` > 1 every rank's heads are cut into that many balanced sub-ranges and the
    exchange is pipelined per chunk: chunk c+1's q|k|v all-to-all and chunk c-1's output
    all-to-all are in flight while chunk c's attention runs, so only the first chunk's input and
    the last chunk's output transfer stay on the critical path. Collectives are issued in the same
    order on every rank (``chunks`` is a step-wide setting), as NCCL requires.
    """

    def __init__(self, shard, heads, head_dim, group=None, chunks=1):
        self.group = group
        self.rank = shard.rank
        self.world_size = shard.world_size
        self.head_dim = head_dim
        self.rows = [b - a for a, b in shard.row_ranges]
        self.head_ranges = shard.head_ranges
        self.heads = [b - a for a, b in shard.head_ranges]
        if sum(self.heads) != heads:
            raise ValueError(f"ShardPlan splits {sum(self.heads)} heads but the model has {heads}; build it with heads={heads}")
        if chunks < 1:
            raise ValueError(f"all-to-all pipeline chunks must be >= 1, got {chunks}")
        self.chunks = min(chunks, min(self.heads))  # every chunk holds >= 1 head on every rank
        # chunk_heads[c][j]: the global head range of rank j's chunk c
        cuts = [balanced_ranges(b - a, self.chunks) for a, b in shard.head_ranges]
        self.chunk_heads = [[(a + cuts[j][c][0], a + cuts[j][c][1]) for j, (a, _) in enumerate(shard.head_ranges)]
                            for c in range(self.chunks)]
        self.chunk_sizes = [[b - a for a, b in ranges] for ranges in self.chunk_heads]  # [c][j]: heads of rank j in chunk c

    def pack_heads(self, qkv):
        """[s_r, 3, H, D] -> flat, chunk-major then rank-major, each piece [s_r, 3, h_jc, D]: one pass.

        When every rank holds the same number of heads (N divides H), a chunk's pieces for all ranks
        are one strided view of qkv, so each chunk is packed by one copy kernel instead of N.
        """
        send = torch.empty(qkv.numel(), dtype=qkv.dtype, device=qkv.device)
        words = _words(qkv)
        self._pack_into(send if words is qkv else send.view(words.dtype), words)
        return send

    def _pack_into(self, send, qkv):
        s_r, d, n_ranks = qkv.shape[0], qkv.shape[-1], self.world_size
        even = len(set(self.heads)) == 1
        by_rank = qkv.view(s_r, 3, n_ranks, self.heads[0], d) if even else None
        off = 0
        for ranges in self.chunk_heads:
            if even:
                x, h = ranges[0][0] - self.head_ranges[0][0], ranges[0][1] - ranges[0][0]
                n = n_ranks * s_r * 3 * h * d
                send[off:off + n].view(n_ranks, s_r, 3, h, d).copy_(by_rank[:, :, :, x:x + h].permute(2, 0, 1, 3, 4))
                off += n
                continue
            for a, b in ranges:
                n = s_r * 3 * (b - a) * d
                send[off:off + n].view(s_r, 3, b - a, d).copy_(qkv[:, :, a:b])
                off += n

    def adaln_projections(self, projections, t_emb):
        """[p.project(t_emb) for p in projections], each computed by one rank and shared by one all-gather.

        A block's adaLN projection depends only on the step's timesteps, yet it reads the largest
        weight in the block (260 M of a DiT block's 646 M parameters); computed on every rank it is
        replicated work that does not shrink with N. Rank r projects blocks r, r + N, ...; the
        all-gather moves ceil(L / N) * N of the small [M, features] outputs (~20 MB a step for H3).
        """
        n, count = self.world_size, len(projections)
        mine = [p.project(t_emb) for p in projections[self.rank::n]]
        per = -(-count // n)
        first = mine[0] if mine else projections[0].project(t_emb)  # shape and dtype (count < n: an idle rank)
        send = torch.zeros((per,) + tuple(first.shape), dtype=first.dtype, device=first.device)
        for k, out in enumerate(mine):
            send[k] = out
        recv = torch.empty((n * per,) + tuple(first.shape), dtype=send.dtype, device=send.device)
        dist.all_gather(list(recv.chunk(n)), send, group=self.group)  # rank r's outputs land at [r * per, (r + 1) * per)
        return [recv[(i % n) * per + i // n] for i in range(count)]

    def _a2a(self, recv, send, out_splits, in_splits):
        return dist.all_to_all_single(recv, send, output_split_sizes=out_splits, input_split_sizes=in_splits,
                                      group=self.group, async_op=True)

    def attention(self, qkv, transformer_options):
        """[s_r, 3, H, D] normed + roped local q|k|v -> [s_r, H * D] attention output."""
        d, s_r, me, sizes = self.head_dim, self.rows[self.rank], self.rank, self.chunk_sizes
        send = self.pack_heads(qkv)
        offsets = [0]
        for c in range(self.chunks):
            offsets.append(offsets[-1] + s_r * 3 * sum(sizes[c]) * d)

        def start_in(c):
            h = sizes[c][me]
            recv = torch.empty(sum(self.rows) * 3 * h * d, dtype=qkv.dtype, device=qkv.device)
            work = self._a2a(recv, send[offsets[c]:offsets[c + 1]], [s * 3 * h * d for s in self.rows],
                             [s_r * 3 * hj * d for hj in sizes[c]])
            return work, recv.view(-1, 3, h, d)

        pending = start_in(0)
        outs = []
        for c in range(self.chunks):
            work, full = pending
            if c + 1 < self.chunks:
                pending = start_in(c + 1)  # next chunk's input travels while this chunk computes
            work.wait()
            h = sizes[c][me]
            out = kernels.attention(full[:, 0], full[:, 1], full[:, 2], h, transformer_options).contiguous()
            recv = torch.empty(s_r * sum(sizes[c]) * d, dtype=out.dtype, device=out.device)
            # `out` stays referenced until its transfer is waited on
            outs.append((self._a2a(recv, out.view(-1), [s_r * hj * d for hj in sizes[c]], [s * h * d for s in self.rows]),
                         recv.split([s_r * hj * d for hj in sizes[c]]), out))
        for work, _, _ in outs:
            work.wait()
        # global head order is rank-major, then chunk: [rank 0 chunk 0 | rank 0 chunk 1 | ... | rank 1 chunk 0 | ...]
        return torch.cat([outs[c][1][j].view(s_r, -1) for j in range(self.world_size) for c in range(self.chunks)], dim=1)


def _words(t):
    """t's last dim reinterpreted as 8-byte words when it divides evenly: a strided copy then moves a
    quarter as many bf16 elements (the copy kernel's cost is per element, not per byte)."""
    if t.dtype.itemsize < 8 and t.shape[-1] * t.dtype.itemsize % 8 == 0:
        try:
            return t.view(torch.int64)
        except RuntimeError:  # strides or offset not word-aligned
            pass
    return t


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


def sharded_forward(model, plan, rank, world_size, video_x, audio_x, context, payload, transformer_options, group=None,
                    chunks=DEFAULT_CHUNKS):
    """This rank's part of one step; returns the full (video, audio) target rows on rank 0, else (None, None).

    `chunks`: heads per rank are exchanged in this many pipelined pieces (see UlyssesAttention); it
    must be the same on every rank.
    """
    check_replicable_options(transformer_options)
    shard = plan.shard(world_size, rank, model.num_heads)
    sp = UlyssesAttention(shard, model.num_heads, model.config["attention_head_dim"], group=group, chunks=chunks)
    v, a = model.run(plan, shard, video_x, audio_x, context, payload, transformer_options, seq_parallel=sp)
    return gather_targets(shard, v, a, group=group)
