"""Ulysses sequence parallelism for H3: the only place where H3 issues collectives. Internal.

Each rank holds a balanced block of rows and, inside attention, a balanced share of the heads. Two
all-to-alls per block, with exact split sizes (no padding row ever acts as a key), each cut by head
into pipelined chunks (UlyssesAttention):

  packed q|k|v   [s_r, 3, H, D]   --all_to_all-->  [S, 3, h_r, D]   (S = sum of s_i)
  attention out  [S, h_r * D]     --all_to_all-->  [s_r, H * D]
"""

import torch
import torch.distributed as dist

from . import kernels
from .plan import balanced_ranges


# pipeline depth of the attention all-to-alls (UlyssesAttention's `chunks`)
DEFAULT_CHUNKS = 2


class UlyssesAttention:
    """All-to-all attention over `group` for the rows and head counts a ShardPlan assigns.

    With ``chunks`` > 1 every rank's heads are cut into that many balanced sub-ranges and the
    exchange is pipelined per chunk: chunk c's q|k|v leave as soon as that chunk's heads are
    normed and packed (while the next chunk's are), chunk c+1's input and chunk c-1's output are in
    flight while chunk c's attention runs, so only the last chunk's output transfer (and whatever of
    the first input transfer the next chunk's preparation does not cover) stays on the critical path.

    Head order is chunk-major: chunk c owns a contiguous range of the global heads, split rank-major
    among the ranks (``chunk_heads[c][j]``), so "prepare the heads of chunk c" is one slice of
    every local row and the output pieces concatenate back in global order. With one chunk this is
    exactly the ShardPlan's ``head_ranges``. Collectives are issued in the same order on every rank
    (``chunks`` is a step-wide setting), as NCCL requires.
    """

    def __init__(self, shard, heads, head_dim, group=None, chunks=1):
        self.group = group
        self.rank = shard.rank
        self.world_size = shard.world_size
        self.head_dim = head_dim
        self.rows = [b - a for a, b in shard.row_ranges]
        self.heads = [b - a for a, b in shard.head_ranges]
        if sum(self.heads) != heads:
            raise ValueError(f"ShardPlan splits {sum(self.heads)} heads but the model has {heads}; build it with heads={heads}")
        if chunks < 1:
            raise ValueError(f"all-to-all pipeline chunks must be >= 1, got {chunks}")
        self.chunks = min(chunks, min(self.heads))  # every chunk holds >= 1 head on every rank
        cuts = [balanced_ranges(h, self.chunks) for h in self.heads]
        self.chunk_sizes = [[cuts[j][c][1] - cuts[j][c][0] for j in range(self.world_size)]
                            for c in range(self.chunks)]  # [c][j]: heads of rank j in chunk c
        # chunk_span[c]: chunk c's global heads; chunk_heads[c][j]: rank j's part of them
        self.chunk_span, self.chunk_heads, first = [], [], 0
        for sizes in self.chunk_sizes:
            ranges = []
            for h in sizes:
                ranges.append((first, first + h))
                first += h
            self.chunk_span.append((ranges[0][0], ranges[-1][1]))
            self.chunk_heads.append(ranges)

    def _send_offsets(self, s_r):
        """Start of each chunk's pieces in the flat send buffer of s_r rows (chunk-major, then rank-major)."""
        offsets = [0]
        for sizes in self.chunk_sizes:
            offsets.append(offsets[-1] + s_r * 3 * sum(sizes) * self.head_dim)
        return offsets

    def _pack_chunk(self, send, qkv, c):
        """Chunk c's pieces for every rank into `send`, in one strided copy when they are equal in size.

        The copy moves 8-byte words where a head is a whole number of them (_words): a strided
        copy costs per element, so a 128-dim bf16 head moves as 32 words instead of 128 elements.
        """
        words = _words(qkv)
        if words is not qkv:
            send = send.view(words.dtype)
        s_r, d = words.shape[0], words.shape[-1]
        sizes = self.chunk_sizes[c]
        a, b = self.chunk_span[c]
        if len(set(sizes)) == 1:
            h = sizes[0]
            send.view(self.world_size, s_r, 3, h, d).copy_(words[:, :, a:b].unflatten(2, (self.world_size, h)).permute(2, 0, 1, 3, 4))
            return
        off = 0
        for a, b in self.chunk_heads[c]:
            n = s_r * 3 * (b - a) * d
            send[off:off + n].view(s_r, 3, b - a, d).copy_(words[:, :, a:b])
            off += n

    def adaln_projections(self, projections, t_emb):
        """[p.project(t_emb) for p in projections], each computed by one rank and shared by one all-gather.

        A block's adaLN projection depends only on the step's timesteps, yet it reads one of the
        block's largest weights; computed on every rank it is replicated work that does not shrink
        with N. Rank r projects blocks r, r + N, ...; the all-gather moves ceil(L / N) * N of the
        small [M, features] outputs.
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

    def _buffer(self, numel, like):
        """A new receive buffer (one place to change allocation, e.g. for registered NCCL buffers)."""
        return torch.empty(numel, dtype=like.dtype, device=like.device)

    def _a2a(self, recv, send, out_splits, in_splits):
        return dist.all_to_all_single(recv, send, output_split_sizes=out_splits, input_split_sizes=in_splits,
                                      group=self.group, async_op=True)

    def attention(self, qkv, transformer_options, prepare=None):
        """[s_r, 3, H, D] local q|k|v -> [s_r, H * D] attention output.

        prepare(a, b): makes q and k of global heads [a, b) ready for attention, in place in `qkv`
        (H3: per-head RMSNorm + rope); called once per chunk, just before that chunk is packed, so
        the previous chunk's transfer overlaps it. None: qkv is ready as given.
        """
        d, s_r, me, sizes = self.head_dim, self.rows[self.rank], self.rank, self.chunk_sizes
        send = torch.empty(qkv.numel(), dtype=qkv.dtype, device=qkv.device)
        offsets = self._send_offsets(s_r)

        def start_in(c):
            if prepare is not None:
                prepare(*self.chunk_span[c])
            self._pack_chunk(send[offsets[c]:offsets[c + 1]], qkv, c)
            h = sizes[c][me]
            recv = self._buffer(sum(self.rows) * 3 * h * d, qkv)
            work = self._a2a(recv, send[offsets[c]:offsets[c + 1]], [s * 3 * h * d for s in self.rows],
                             [s_r * 3 * hj * d for hj in sizes[c]])
            return work, recv.view(-1, 3, h, d)

        pending = start_in(0)
        outs = []
        for c in range(self.chunks):
            work, full = pending
            if c + 1 < self.chunks:
                pending = start_in(c + 1)  # next chunk's heads are prepared and sent while this one is in flight / computes
            work.wait()
            h = sizes[c][me]
            out = kernels.attention(full[:, 0], full[:, 1], full[:, 2], h, transformer_options).contiguous()
            recv = self._buffer(s_r * sum(sizes[c]) * d, out)
            # `out` stays referenced until its transfer is waited on
            outs.append((self._a2a(recv, out.view(-1), [s_r * hj * d for hj in sizes[c]], [s * h * d for s in self.rows]),
                         recv.split([s_r * hj * d for hj in sizes[c]]), out))
        for work, _, _ in outs:
            work.wait()
        # chunk-major, then rank-major: the global head order
        return torch.cat([piece.view(s_r, -1) for _, pieces, _ in outs for piece in pieces], dim=1)


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


def sharded_forward(model, plan, inputs, rank, world_size, group=None, chunks=DEFAULT_CHUNKS):
    """This rank's part of one step; returns the full (video, audio) target rows on rank 0, else (None, None).

    `chunks`: heads per rank are exchanged in this many pipelined pieces (see UlyssesAttention); it
    must be the same on every rank.
    """
    shard = plan.shard(world_size, rank, model.num_heads)
    sp = UlyssesAttention(shard, model.num_heads, model.config["attention_head_dim"], group=group, chunks=chunks)
    v, a = model.run(plan, shard, inputs, seq_parallel=sp)
    return gather_targets(shard, v, a, group=group)
