"""Ulysses sequence parallelism for the MiniMax H3 forward.

``UlyssesParallel`` is what the forward reads from ``transformer_options["minimax_h3_sequence_parallel"]``:
each rank embeds and runs its own contiguous rows (ShardPlan); inside attention, all-to-alls with
exact uneven splits (no padding row ever acts as a key) trade rows for heads:

  q|k|v          [s_r, 3, H, D]   --all_to_all-->  [S, 3, h_r, D]   (S = sum of s_j)
  attention out  [S, h_r * D]     --all_to_all-->  [s_r, H * D]

Each rank's heads are cut into ``chunks`` groups that move one after the other: chunk c + 1 of
q|k|v and chunk c - 1 of the output travel while chunk c attends, so only the first chunk's
exchange and the last one's return wait for the link. ``fp8`` sends both as float8_e4m3fn with one
scale per row and head (half the bytes of bf16; not exact). The target velocity rows are gathered
on every rank at the end.
"""

import math

import torch

from comfy.ldm.minimax.plan import balanced_ranges

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


class UlyssesParallel:
    def __init__(self, rank, world_size, heads, transport, chunks=2, fp8=False):
        if world_size > heads:
            raise ValueError("MiniMax H3 has {} attention heads: use at most {} ranks".format(heads, heads))
        self.rank = rank
        self.world_size = world_size
        self.transport = transport
        self.fp8 = fp8
        self.head_ranges = balanced_ranges(heads, world_size)
        chunks = max(1, min(chunks, min(b - a for a, b in self.head_ranges)))
        # chunk_heads[c][j]: the global (start, stop) of rank j's c-th head group
        splits = [balanced_ranges(b - a, chunks) for a, b in self.head_ranges]
        self.chunk_heads = [[(a + split[c][0], a + split[c][1]) for (a, _), split in zip(self.head_ranges, splits)]
                            for c in range(chunks)]

    def attention(self, attn, shard):
        """The attention of `attn` (an H3 Attention) over the rows of every rank, for DiTBlock.forward."""
        n = self.world_size
        rows = [b - a for a, b in shard.row_ranges]
        bounds = [sum(rows[:j]) for j in range(n + 1)]

        def forward(x, rope_freqs=None, transformer_options={}):
            q, k, v = attn.project_qkv(x, rope_freqs)
            qkv = torch.stack((q, k, v), dim=1)
            s_r, _, _, d = qkv.shape
            # every chunk's q|k|v is on its way before the first one attends
            incoming = []
            for heads in self.chunk_heads:
                width = [h1 - h0 for h0, h1 in heads]
                buf = qkv.new_empty(bounds[-1], 3, width[self.rank], d)
                incoming.append((buf, self._exchange([qkv[:, :, h0:h1] for h0, h1 in heads],
                                                     [buf[bounds[i]:bounds[i + 1]] for i in range(n)],
                                                     [[(rows[i], 3, width[j], d) for j in range(n)] for i in range(n)])))
            returning = []
            for heads, (buf, wait) in zip(self.chunk_heads, incoming):
                wait()
                width = [h1 - h0 for h0, h1 in heads]
                out = attn.attend(*buf.unbind(1), transformer_options).view(bounds[-1], width[self.rank], d)
                parts = [out.new_empty(s_r, width[i], d) for i in range(n)]
                returning.append((parts, self._exchange([out[bounds[j]:bounds[j + 1]] for j in range(n)], parts,
                                                        [[(rows[j], width[i], d) for j in range(n)] for i in range(n)])))
            for _, wait in returning:
                wait()
            # heads in global order: rank j's chunks, j = 0..N-1
            return attn.out_proj(torch.cat([parts[j].flatten(1) for j in range(n) for parts, _ in returning], dim=1))
        return forward

    def _exchange(self, sends, recvs, shapes):
        """all_to_all of ``sends[j]`` into rank j's ``recvs[rank]``; ``shapes[i][j]``: the shape of rank i's piece
        for rank j (every rank knows them all). -> a function that waits until this rank's ``recvs`` hold
        what its peers sent (dequantized if the exchange is fp8)."""
        n = self.world_size
        if not self.fp8:
            item = recvs[0].element_size()
            work = self.transport.all_to_all([t.contiguous() for t in sends], recvs,
                                             [[math.prod(shapes[i][j]) * item for j in range(n)] for i in range(n)])
            return work.wait
        sizes = [[_fp8_bytes(shapes[i][j]) for j in range(n)] for i in range(n)]
        raw = [torch.empty(sizes[i][self.rank], dtype=torch.uint8, device=recvs[i].device) for i in range(n)]
        work = self.transport.all_to_all([_fp8_pack(t) for t in sends], raw, sizes)

        def wait():
            work.wait()
            for r, t in zip(raw, recvs):
                _fp8_unpack(r, t)
        return wait

    def gather_rows(self, shard, rows, dim=0):
        """This rank's ``rows`` (its shard's rows along ``dim``) -> every rank's in order, on rank 0; None elsewhere."""
        flat = rows.movedim(dim, 0).contiguous()
        counts = [b - a for a, b in shard.row_ranges]
        width, item = math.prod(flat.shape[1:]), flat.element_size()
        n = self.world_size
        recvs = [flat.new_empty(c, *flat.shape[1:]) for c in counts] if self.rank == 0 else [None] * n
        sizes = [[counts[i] * width * item if j == 0 else 0 for j in range(n)] for i in range(n)]
        self.transport.all_to_all([flat] + [None] * (n - 1), recvs, sizes).wait()
        return torch.cat(recvs).movedim(0, dim) if self.rank == 0 else None

    def scatter_rows(self, shard, full, like, dim=0):
        """Rank 0's ``full`` rows -> this rank's shard of them, shaped as ``like`` (this rank's rows before)."""
        n = self.world_size
        counts = [b - a for a, b in shard.row_ranges]
        mine = like.movedim(dim, 0)
        width, item = math.prod(mine.shape[1:]), mine.element_size()
        sizes = [[counts[j] * width * item if i == 0 else 0 for j in range(n)] for i in range(n)]
        sends = [p.contiguous() for p in full.movedim(dim, 0).split(counts)] if self.rank == 0 else [None] * n
        recv = torch.empty_like(mine, memory_format=torch.contiguous_format)
        self.transport.all_to_all(sends, [recv] + [None] * (n - 1), sizes).wait()
        return recv.movedim(0, dim)

    def gather(self, shard, video_rows, audio_rows):
        """Every rank's target velocity rows -> the full (video, audio) rows, on every rank."""
        widths = (video_rows.shape[1], audio_rows.shape[1])
        item = video_rows.element_size()
        sizes = [(nv * widths[0] + na * widths[1]) * item for nv, na in shard.target_counts]
        send = torch.cat([video_rows.reshape(-1), audio_rows.reshape(-1)])
        recvs = [torch.empty(s // item, dtype=send.dtype, device=send.device) for s in sizes]
        self.transport.all_to_all([send] * self.world_size, recvs, [[s] * self.world_size for s in sizes]).wait()
        video, audio = [], []
        for (nv, na), part in zip(shard.target_counts, recvs):
            v, a = part.split([nv * widths[0], na * widths[1]])
            video.append(v.view(nv, widths[0]))
            audio.append(a.view(na, widths[1]))
        return torch.cat(video), torch.cat(audio)


def _fp8_bytes(shape):
    # fp8 values, then one fp32 scale per row of the last dim
    n = math.prod(shape)
    return n + n // shape[-1] * 4 if n else 0


def _fp8_pack(t):
    # [..., D] -> uint8 [fp8 values | fp32 scale per D values]
    if t.numel() == 0:
        return t.new_empty(0, dtype=torch.uint8)
    flat = t.reshape(-1, t.shape[-1]).float()
    scale = (flat.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    values = (flat / scale).to(FP8)
    return torch.cat([values.view(torch.uint8).reshape(-1), scale.view(torch.uint8).reshape(-1)])


def _fp8_unpack(raw, out):
    # the inverse of _fp8_pack, into `out`
    n = out.numel()
    if n:
        values = raw[:n].view(FP8).view(-1, out.shape[-1])
        scale = raw[n:].view(torch.float32).view(-1, 1)
        out.copy_((values.float() * scale).view(out.shape))
