"""H3's nn.Modules. Parameter and buffer names are the checkpoint's and stable forever.

Every per-token op here works on whatever rows the caller holds (all of them natively, one shard
under sequence parallelism); only Attention mixes rows, through ``seq_parallel`` when sharded.
"""

import math

import torch
import torch.nn as nn

import comfy.model_management
import comfy.ops

from . import kernels
from .modulation import mod_gate, norm_scale_shift

# fp16 branches project their input scaled down by these and scale the fp32 result back up: in the
# full-size model the attention output projection and fc2 outputs peak above fp16's 65504
FP16_OUT_PROJ_SCALE = 64.0
FP16_FC2_SCALE = 256.0
from .pdd import PddHeads, bank_size


class TimeEmbedder(nn.Module):
    def __init__(self, freq_dim, hidden, out, dtype=None, device=None, operations=None):
        super().__init__()
        self.freq_dim = freq_dim
        self.proj_in = operations.Linear(freq_dim, hidden, bias=True, dtype=dtype, device=device)
        self.proj_out = operations.Linear(hidden, out, bias=True, dtype=dtype, device=device)

    def forward(self, t):
        # t: [M] in [0, 1]; fp32 throughout, cos before sin
        half = self.freq_dim // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = t.to(torch.float32)[:, None] * freqs[None]
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        return self.proj_out(nn.functional.silu(self.proj_in(emb)))


class Attention(nn.Module):
    def __init__(self, hidden, heads, head_dim, eps, dtype=None, device=None, operations=None, gate_compress=False):
        super().__init__()
        self.heads = heads
        self.head_dim = head_dim
        inner = heads * head_dim
        self.qkv_proj = operations.Linear(hidden, inner * 3, bias=False, dtype=dtype, device=device)
        self.q_norm = operations.RMSNorm(head_dim, eps=eps, dtype=dtype, device=device)
        self.k_norm = operations.RMSNorm(head_dim, eps=eps, dtype=dtype, device=device)
        self.out_proj = operations.Linear(inner, hidden, bias=False, dtype=dtype, device=device)
        self.to_gate_compress = None
        if gate_compress:
            self.add_gate_compress(operations, dtype=dtype, device=device)

    def add_gate_compress(self, operations, dtype=None, device=None):
        """The VSA gate [inner, hidden] of sparse-attention checkpoints: the dense forward never uses
        it; sparse attention patches (a DiTBlock ``attention=`` override) read it."""
        hidden, inner = self.qkv_proj.in_features, self.heads * self.head_dim
        self.to_gate_compress = operations.Linear(hidden, inner, bias=False, dtype=dtype, device=device)

    def forward(self, x, rope_freqs=None, transformer_options={}, seq_parallel=None):
        # x: [s, hidden] local rows -> [s, hidden]
        s, heads, dim = x.shape[0], self.heads, self.head_dim
        qkv = self.qkv_proj(x).view(s, 3, heads, dim)  # [q | k | v]
        if seq_parallel is None or seq_parallel.world_size == 1:
            q, k = self.norm_qk(qkv, 0, heads, rope_freqs)
            out = kernels.attention(q, k, qkv[:, 2], heads, transformer_options)
        elif rope_freqs is not None and kernels.rms_rope_in_place():
            # each chunk's heads are normed in place just before their all-to-all, overlapping the previous chunk's transfer
            out = seq_parallel.attention(qkv, transformer_options, prepare=lambda a, b: self.norm_qk(qkv, a, b, rope_freqs))
        else:  # out-of-place norm (training, or no rope): normed up front into a new q|k|v buffer
            q, k = self.norm_qk(qkv, 0, heads, rope_freqs)
            out = seq_parallel.attention(torch.stack([q, k, qkv[:, 2]], dim=1), transformer_options)
        if out.dtype == torch.float16:  # -> fp32
            return self.out_proj(out / FP16_OUT_PROJ_SCALE).float() * FP16_OUT_PROJ_SCALE
        return self.out_proj(out)

    def norm_qk(self, qkv, a, b, rope_freqs=None):
        """(q, k) of heads [a, b) of qkv [s, 3, H, D], per-head RMSNormed and, with rope_freqs, roped.

        With rope and kernels.rms_rope_in_place() the fused kernel writes into qkv and the results
        are views of it; otherwise they are new tensors.
        """
        q, k = qkv[:, 0, a:b], qkv[:, 1, a:b]  # [s, h, D] views
        if rope_freqs is None:
            return self.q_norm(q), self.k_norm(k)
        # the fused kernel takes its scales at q/k's dtype; stored ones may be fp8
        qw = comfy.model_management.cast_to(self.q_norm.weight, dtype=qkv.dtype, device=qkv.device)
        kw = comfy.model_management.cast_to(self.k_norm.weight, dtype=qkv.dtype, device=qkv.device)
        q, k = kernels.rms_rope_(q.unsqueeze(0), k.unsqueeze(0), rope_freqs, qw, kw, self.q_norm.eps)
        return q[0], k[0]


class MLP(nn.Module):
    def __init__(self, hidden, ffn, dtype=None, device=None, operations=None):
        super().__init__()
        self.fc1 = operations.Linear(hidden, ffn * 2, bias=False, dtype=dtype, device=device)
        self.fc2 = operations.Linear(ffn, hidden, bias=False, dtype=dtype, device=device)

    def forward(self, x):
        if x.dtype == torch.float16:  # -> fp32; the SwiGLU product runs in fp32 too
            gate, up = self.fc1(x).chunk(2, dim=-1)
            act = nn.functional.silu(gate.float()) * up.float()
            return self.fc2((act / FP16_FC2_SCALE).half()).float() * FP16_FC2_SCALE
        return comfy.ops.linear_input_act(self.fc2, self.fc1(x), "swiglu")


class AdalnProj(nn.Module):
    def __init__(self, t_dim, hidden, expand, modalities, apply_silu=True, dtype=None, device=None, operations=None):
        super().__init__()
        self.expand = expand
        self.modalities = modalities
        self.hidden = hidden
        self.apply_silu = apply_silu
        self.linear = operations.Linear(t_dim, expand * hidden * modalities, bias=True, dtype=dtype, device=device)

    def project(self, t_emb):
        # [M, t_dim] -> [M, expand * hidden * modalities]
        return self.linear(nn.functional.silu(t_emb) if self.apply_silu else t_emb)

    def split(self, x):
        # project()'s output -> `expand` tensors of [M*modalities, hidden]
        x = x.view(x.shape[0] * self.modalities, self.expand * self.hidden)
        return x.chunk(self.expand, dim=-1)

    def forward(self, t_emb):
        return self.split(self.project(t_emb))


class RefinerBlock(nn.Module):
    def __init__(self, hidden, heads, head_dim, ffn, eps, qk_eps, dtype=None, device=None, operations=None):
        super().__init__()
        self.norm1 = operations.RMSNorm(hidden, eps=eps, dtype=dtype, device=device)
        self.norm2 = operations.RMSNorm(hidden, eps=eps, dtype=dtype, device=device)
        self.attn = Attention(hidden, heads, head_dim, qk_eps, dtype=dtype, device=device, operations=operations)
        self.mlp = MLP(hidden, ffn, dtype=dtype, device=device, operations=operations)

    def forward(self, x, transformer_options={}):
        # attn/mlp outputs are fresh: accumulate residuals in place (fp16 branches come back in fp32)
        x = self.attn(self.norm1(x), transformer_options=transformer_options).to(x.dtype).add_(x)
        return self.mlp(self.norm2(x)).to(x.dtype).add_(x)


class TokenRefiner(nn.Module):
    def __init__(self, num_layers, hidden, heads, head_dim, ffn, eps, qk_eps, final_eps,
                 dtype=None, device=None, operations=None):
        super().__init__()
        self.blocks = nn.ModuleList([
            RefinerBlock(hidden, heads, head_dim, ffn, eps, qk_eps, dtype=dtype, device=device, operations=operations)
            for _ in range(num_layers)])
        self.final_norm = operations.RMSNorm(hidden, eps=final_eps, dtype=dtype, device=device)

    def forward(self, x, transformer_options={}):
        for block in self.blocks:
            x = block(x, transformer_options=transformer_options)
        return self.final_norm(x)


class DiTBlock(nn.Module):
    def __init__(self, hidden, heads, head_dim, ffn, t_dim, eps, qk_eps,
                 apply_silu=True, adaln_dtype=None, dtype=None, device=None, operations=None, gate_compress=False):
        super().__init__()
        self.norm1 = operations.RMSNorm(hidden, eps=eps, dtype=dtype, device=device)
        self.norm2 = operations.RMSNorm(hidden, eps=eps, dtype=dtype, device=device)
        self.attn = Attention(hidden, heads, head_dim, qk_eps, dtype=dtype, device=device, operations=operations,
                              gate_compress=gate_compress)
        self.mlp = MLP(hidden, ffn, dtype=dtype, device=device, operations=operations)
        self.adaln_proj = AdalnProj(t_dim, hidden, 6, 3, apply_silu=apply_silu,
                                    dtype=adaln_dtype if adaln_dtype is not None else dtype,
                                    device=device, operations=operations)

    def forward(self, x, t_emb, mod_segments, rope_freqs, transformer_options={}, attention=None, seq_parallel=None, adaln=None,
                compute_dtype=None):
        # attention: a replacement for self.attn, called as attention(h, rope_freqs=, transformer_options=)
        # (sparse-attention block patches); adaln: this block's adaln_proj.project(t_emb) when the caller
        # computed it already (sequence parallel ranks share that work, see UlyssesAttention.adaln_projections);
        # compute_dtype: the attention and MLP inputs' dtype where the residual x is wider (fp32 under fp16)
        if attention is not None and seq_parallel is not None and seq_parallel.world_size > 1:
            raise ValueError("MiniMax H3 sequence parallelism cannot run a DiTBlock attention= override: it would attend "
                             "over this rank's rows only. Run the patch on one GPU, or select a registered attention "
                             "function (optimized_attention_override), which sees every row")
        mods = self.adaln_proj(t_emb) if adaln is None else self.adaln_proj.split(adaln)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mods
        branch = compute_dtype or x.dtype
        h = norm_scale_shift(self.norm1, x, shift_msa, scale_msa, mod_segments).to(branch)
        if attention is None:
            attn = self.attn(h, rope_freqs=rope_freqs, transformer_options=transformer_options, seq_parallel=seq_parallel)
        else:
            attn = attention(h, rope_freqs=rope_freqs, transformer_options=transformer_options)
        x = mod_gate(x, gate_msa, attn, mod_segments)
        h = norm_scale_shift(self.norm2, x, shift_mlp, scale_mlp, mod_segments).to(branch)
        return mod_gate(x, gate_mlp, self.mlp(h), mod_segments)


class FinalLayer(nn.Module):
    def __init__(self, hidden, t_dim, video_dim, audio_dim, eps, apply_silu=True, adaln_dtype=None,
                 dtype=None, device=None, operations=None):
        super().__init__()
        self.norm = operations.RMSNorm(hidden, eps=eps, dtype=dtype, device=device)
        self.adaln_proj = AdalnProj(t_dim, hidden, 2, 1, apply_silu=apply_silu,
                                    dtype=adaln_dtype if adaln_dtype is not None else dtype,
                                    device=device, operations=operations)
        # output heads are the checkpoint's fp32 island; norm/adaln are stored at model dtype
        self.video_out = operations.Linear(hidden, video_dim, bias=True, dtype=torch.float32, device=device)
        self.audio_out = operations.Linear(hidden, audio_dim, bias=True, dtype=torch.float32, device=device)

    def forward(self, x, t_emb, video_seg, audio_seg, sigma=None, sample_sigmas=None, shifts=None, pdd=None):
        # video_seg / audio_seg: (start, stop, timestep_row) of the target rows held, possibly empty.
        # Output layers holding a PDD head bank run the heads of the step: pdd (the plan's PddHeads), else
        # picked from the video sigma, the sampler's sigmas and the (video, audio) sigma shifts
        shift, scale = self.adaln_proj(t_emb)
        va, vb, vrow = video_seg
        aa, ab, arow = audio_seg
        hv = (self.norm(x[va:vb]) * (1.0 + scale[vrow]) + shift[vrow]).to(torch.float32)
        ha = (self.norm(x[aa:ab]) * (1.0 + scale[arow]) + shift[arow]).to(torch.float32)
        if pdd is None and bank_size(self.video_out) > 1:
            pdd = PddHeads.select(bank_size(self.video_out), sigma, sample_sigmas, shifts)
        if pdd is None:
            return self.video_out(hv), self.audio_out(ha)
        return pdd.apply(self.video_out, hv, 0), pdd.apply(self.audio_out, ha, 1)
