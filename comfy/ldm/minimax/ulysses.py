"""Ulysses sequence parallelism for the MiniMax H3 forward.

``UlyssesParallel`` is what the forward reads from ``transformer_options["minimax_h3_sequence_parallel"]``:
each rank embeds and runs its own contiguous rows (ShardPlan); inside attention, all-to-alls with
exact uneven splits (no padding row ever acts as a key) trade rows for heads:

  q|k|v          [s_r, 3, H, D]   --all_to_all-->  [S, 3, h_r, D]   (S = sum of s_j)
  attention out  [S, h_r * D]     --all_to_all-->  [s_r, H * D]

Each rank's heads are cut into ``chunks`` groups that move one after the other: chunk c + 1 of
q|k|v and chunk c - 1 of the output travel while chunk c attends, so only the first chunk's
exchange and the last one's return wait for the link. Where it moves fewer bytes (N * hidden <
3 * heads * head_dim: N <= 3 for H3) and the q|k|v projection is a plain ComfyUI Linear, the hidden
rows are gathered instead, once per block ([s_r, hidden] -> [S, hidden] on every rank), and each
rank projects its own heads from the cast weight's rows for them (LoRA and offloading applied by
ComfyUI's cast): 37.5 % fewer bytes at N = 2, 19 % at N = 3. ``fp8`` sends everything as
float8_e4m3fn with one scale per row and head (half the bytes of bf16; not exact). The target
velocity rows are gathered on every rank at the end.
"""

import math
import types

import torch

import comfy.ops
from comfy.ldm.minimax.model import Attention
from comfy.ldm.minimax.plan import balanced_ranges
from comfy.quant_ops import QuantizedTensor

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


class UlyssesParallel:
    def __init__(self, rank, world_size, heads, transport, chunks=2, fp8=False, gather=None):
        # gather: None chooses by bytes (above); True / False forces the hidden-row gather / the all-to-all
        if world_size > heads:
            raise ValueError("MiniMax H3 has {} attention heads: use at most {} ranks".format(heads, heads))
        self.rank = rank
        self.world_size = world_size
        self.transport = transport
        self.fp8 = fp8
        self.force_gather = gather
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
        heads_of = self._gathered_heads if self.gathers(attn) else self._exchanged_heads

        def forward(x, rope_freqs=None, transformer_options={}):
            s_r, d = x.shape[0], attn.head_dim
            incoming = heads_of(attn, x, rope_freqs, rows, bounds)
            returning = []
            for heads, ready in zip(self.chunk_heads, incoming):
                width = [h1 - h0 for h0, h1 in heads]
                out = attn.attend(*ready(), transformer_options).view(bounds[-1], width[self.rank], d)
                parts = [out.new_empty(s_r, width[i], d) for i in range(n)]
                returning.append((parts, self._exchange([out[bounds[j]:bounds[j + 1]] for j in range(n)], parts,
                                                        [[(rows[j], width[i], d) for j in range(n)] for i in range(n)])))
            for _, wait in returning:
                wait()
            # heads in global order: rank j's chunks, j = 0..N-1
            return attn.out_proj(torch.cat([parts[j].flatten(1) for j in range(n) for parts, _ in returning], dim=1))
        return forward

    def gathers(self, attn):
        """Whether this block gathers hidden rows (the same answer on every rank: same model, same ops)."""
        if self.force_gather is not None:
            return self.force_gather
        proj, plain = attn.qkv_proj, comfy.ops.disable_weight_init.Linear
        return (self.world_size * proj.in_features < proj.out_features and type(attn).project_qkv is Attention.project_qkv
                and type(proj).forward is plain.forward
                and type(proj).forward_comfy_cast_weights is plain.forward_comfy_cast_weights
                and not isinstance(proj.weight, QuantizedTensor))

    def _exchanged_heads(self, attn, x, rope_freqs, rows, bounds):
        """q|k|v of this rank's rows and every head -> per chunk, a function giving q, k, v of every row
        and this rank's heads; every chunk's q|k|v is on its way before the first one attends."""
        n = self.world_size
        qkv = torch.stack(attn.project_qkv(x, rope_freqs), dim=1)
        d = qkv.shape[-1]
        incoming = []
        for heads in self.chunk_heads:
            width = [h1 - h0 for h0, h1 in heads]
            buf = qkv.new_empty(bounds[-1], 3, width[self.rank], d)
            wait = self._exchange([qkv[:, :, h0:h1] for h0, h1 in heads], [buf[bounds[i]:bounds[i + 1]] for i in range(n)],
                                  [[(rows[i], 3, width[j], d) for j in range(n)] for i in range(n)])

            def ready(buf=buf, wait=wait):
                wait()
                return buf.unbind(1)
            incoming.append(ready)
        return incoming

    def _gathered_heads(self, attn, x, rope_freqs, rows, bounds):
        """The same from every rank's hidden rows, gathered: H3's own project_qkv over all rows, on a
        projection cut to this rank's heads from the weight as ComfyUI casts it."""
        full = self._all_gather(x, rows, bounds)
        if rope_freqs is not None:  # the rotation table [1, S, ...] of every row, never quantized
            rope_freqs = self._all_gather(rope_freqs[0], rows, bounds, exact=True).unsqueeze(0)
        comfy.ops.run_every_op()  # as the projection's own forward would (ComfyUI's interrupt check)
        inner, d = attn.heads * attn.head_dim, attn.head_dim
        mine = [heads[self.rank] for heads in self.chunk_heads]
        with comfy.ops.CastBiasWeightContext(attn.qkv_proj, full, offloadable=True) as (weight, bias):
            cuts = [[slice(p * inner + h0 * d, p * inner + h1 * d) for p in range(3)] for h0, h1 in mine]
            parts = [[None if t is None else torch.cat([t[c] for c in cut]) for t in (weight, bias)] for cut in cuts]
        incoming = []
        for (w, b), (h0, h1) in zip(parts, mine):
            view = types.SimpleNamespace(qkv_proj=lambda t, w=w, b=b: torch.nn.functional.linear(t, w, b),
                                         heads=h1 - h0, head_dim=d, q_norm=attn.q_norm, k_norm=attn.k_norm)
            qkv = type(attn).project_qkv(view, full, rope_freqs)
            incoming.append(lambda qkv=qkv: qkv)
        return incoming

    def _all_gather(self, t, rows, bounds, exact=False):
        """This rank's rows ``t`` -> every rank's in order (this rank's own copied, not sent)."""
        n, me = self.world_size, self.rank
        full = t.new_empty(bounds[-1], *t.shape[1:])
        full[bounds[me]:bounds[me + 1]] = t
        self._exchange([t] * n, [full[bounds[i]:bounds[i + 1]] for i in range(n)],
                       [[(0 if i == j else rows[i], *t.shape[1:]) for j in range(n)] for i in range(n)], exact)()
        return full

    def _exchange(self, sends, recvs, shapes, exact=False):
        """all_to_all of ``sends[j]`` into rank j's ``recvs[rank]``; ``shapes[i][j]``: the shape of rank i's piece
        for rank j (every rank knows them all). -> a function that waits until this rank's ``recvs`` hold
        what its peers sent (dequantized if the exchange is fp8)."""
        n = self.world_size
        if exact or not self.fp8:
            item = recvs[0].element_size()
            work = self.transport.all_to_all([t.contiguous() for t in sends], recvs,
                                             [[math.prod(shapes[i][j]) * item for j in range(n)] for i in range(n)])
            return work.wait
        sizes = [[_fp8_bytes(shapes[i][j]) for j in range(n)] for i in range(n)]
        raw = [torch.empty(sizes[i][self.rank], dtype=torch.uint8, device=recvs[i].device) for i in range(n)]
        packed = {id(t): t for t in sends}  # a gather sends one tensor to every rank: packed once
        packed = {k: _fp8_pack(t) for k, t in packed.items()}
        work = self.transport.all_to_all([packed[id(t)] for t in sends], raw, sizes)

        def wait():
            work.wait()
            for r, t in zip(raw, recvs):
                if r.numel():  # nothing comes where nothing was sent (a gather's own rows)
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
