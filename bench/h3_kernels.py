"""Which kernels H3 should run: A/Bs of the kernel choices at one H3 layer's shapes.

Sections: graph_profile (kernel time of the native block, eager vs CUDA graph), attention_ab
(kernels.attention vs the bare cuDNN SDPA call), fusions (RMSNorm + adaLN fused vs unfused, with
its error vs fp32; SwiGLU's activation; a segment's rows redone), kernels (SDPA backends on strided
vs contiguous q/k/v, fused q/k RMSNorm + rope vs torch, packing q|k|v for the all-to-all).

  COMFYUI_DIR=/path/to/ComfyUI python bench/h3_kernels.py --layers 2 --out bench/results/h3_h200_kernels.json [--sections ...]
"""

import torch

from h3_gpu_common import capture, cuda_time, gpu_kernel_s, interleaved, kernel_spans, main, pack_heads, rank_ulysses, tokens


def section_attention_ab(out, seq=15356, rounds=5):
    """kernels.attention vs the bare cuDNN SDPA call on the same strided q/k/v views, interleaved (is
    the wrapper free?), plus the bare call followed by the same output reshape."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from comfy.ldm.minimax_h3 import kernels
    heads, dim = 56, 128
    qkv = torch.randn(seq, 3 * heads * dim, device="cuda", dtype=torch.bfloat16)
    q, k, v = (t.view(seq, heads, dim) for t in qkv.split(heads * dim, dim=-1))  # [S, H, D] views, as the block has them
    q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))

    def bare():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q4, k4, v4)

    def bare_reshaped():
        return bare().transpose(1, 2).reshape(seq, heads * dim)

    with torch.no_grad():
        times = interleaved({"kernels_attention": lambda: kernels.attention(q, k, v, heads, {}), "sdpa_cudnn_bare": bare,
                             "sdpa_cudnn_bare_reshaped": bare_reshaped}, rounds=rounds, warmup=3, iters=10)
        o = bare()
        res = {k: v for k, v in times.items()}
        res["bare_output_strides"] = list(o.stride())
    out["attention_ab"] = {"seq": seq, "rounds": rounds, "results": res}
    print("attention_ab: " + ", ".join(f"{k}={v * 1e3:.3f} ms" if isinstance(v, float) else f"{k}={v}" for k, v in res.items()),
          flush=True)


def section_graph_profile(ours, out, res="832x480x124", n=10):
    """Kernel time per kernel name of the native block run eagerly vs replayed from a CUDA graph:
    which kernels run faster in the graph."""
    from comfy.ldm.minimax_h3.embedding import rope_rotation_table
    block, seq = ours.blocks[0], tokens(res)
    x = torch.randn(seq, 5376, device="cuda").bfloat16()
    t_emb = torch.randn(2, 2688, device="cuda").bfloat16()
    rope = rope_rotation_table(torch.randn(seq, 96, device="cuda"), torch.bfloat16)
    mods = [(0, 512, 1), (512, seq, 0)]
    with torch.no_grad():
        def eager():
            block(x.clone(), t_emb, mods, rope, {})
        g = capture(eager)
        result = {}
        for name, fn in (("eager", eager), ("graph", g.replay), ("eager_2", eager), ("graph_2", g.replay)):
            fn(), fn()
            by = {}
            for a, b, kernel in kernel_spans(fn, n):
                by[kernel[:90]] = by.get(kernel[:90], 0.0) + (b - a) / n / 1e6
            result[name] = dict(sorted(by.items(), key=lambda kv: -kv[1]))
            print(f"graph_profile {name}: total {sum(by.values()) * 1e3:.3f} ms; " +
                  "; ".join(f"{k[:40]} {v * 1e3:.3f}" for k, v in list(result[name].items())[:5]), flush=True)
    out["graph_profile"] = {"resolution": res, "tokens": seq, "per_block_kernel_s": result}


def section_fusions(out, seq=15356, hidden=5376, ffn=14336):
    """RMSNorm + adaLN modulation fused (comfy_kitchen rms_adaln) vs the unfused ops; what SwiGLU's
    activation and v's copy cost."""
    import torch.nn.functional as F

    from comfy.ldm.minimax_h3 import kernels
    from comfy.ldm.minimax_h3.modulation import mod_scale_shift, norm_scale_shift
    g = torch.Generator("cuda").manual_seed(3)
    x = torch.randn(seq, hidden, generator=g, device="cuda").bfloat16()
    shift = (0.5 * torch.randn(3, hidden, generator=g, device="cuda")).bfloat16()
    scale = (0.5 * torch.randn(3, hidden, generator=g, device="cuda")).bfloat16()
    segments = [(0, 512, 1), (512, 700, 2), (700, seq, 0)]
    norm = torch.nn.RMSNorm(hidden, eps=1e-6, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.2 * torch.randn(hidden, generator=g, device="cuda"))
        row_scale, row_shift = scale[0], shift[0]
        h = norm(x)
        res = interleaved({
            "norm_modulation_unfused_s": lambda: mod_scale_shift(norm(x), shift, scale, segments),
            "norm_modulation_fused_s": lambda: norm_scale_shift(norm, x, shift, scale, segments),
            "rms_norm_only_s": lambda: norm(x),
            "mul_add_one_segment_s": lambda: h.mul_(1.0 + row_scale).add_(row_shift),
            "addcmul_one_segment_s": lambda: torch.addcmul(row_shift, h, 1.0 + row_scale, out=h),
            "kitchen_rms_adaln_one_pass_s": lambda: kernels.rms_adaln(x, row_scale, row_shift, 1e-6),
        }, iters=20)
        norm32 = torch.nn.RMSNorm(hidden, eps=1e-6, device="cuda")
        norm32.weight.copy_(norm.weight.float())
        ref = mod_scale_shift(norm32(x.float()), shift.float(), scale.float(), segments)

        def rel(a):
            return float((a.float() - ref).norm() / ref.norm())
        res["norm_modulation_unfused_rel_err_vs_fp32"] = rel(mod_scale_shift(norm(x), shift, scale, segments))
        res["norm_modulation_fused_rel_err_vs_fp32"] = rel(norm_scale_shift(norm, x, shift, scale, segments))
        res["norm_modulation_fused_used_kernel"] = kernels.fused_adaln(x)
        # one segment's rows redone with its own modulation: kitchen's kernel vs torch's rms_norm + one addcmul into place
        import torch.nn.functional as F2
        for rows in (64, 512, 2048, 8192):
            xs, dst = x[:rows], torch.empty(rows, hidden, device="cuda", dtype=torch.bfloat16)
            one = (1.0 + row_scale).to(torch.bfloat16)
            res[f"segment_kitchen_rms_adaln_{rows}_rows_s"] = gpu_kernel_s(
                lambda: dst.copy_(kernels.rms_adaln(xs, row_scale, row_shift, 1e-6)))
            res[f"segment_torch_rms_norm_addcmul_{rows}_rows_s"] = gpu_kernel_s(
                lambda: torch.addcmul(row_shift, F2.rms_norm(xs, (hidden,), eps=1e-6), one, out=dst))
        gu = torch.randn(seq, 2 * ffn, generator=g, device="cuda").bfloat16()
        res["swiglu_silu_mul_s"] = cuda_time(lambda: F.silu(gu[:, :ffn]).mul_(gu[:, ffn:]), 3, 20)["median_s"]
        res["swiglu_input_bytes"] = gu.numel() * 2
        v = torch.randn(seq, 3, 56 * 128, device="cuda").bfloat16()[:, 2]
        res["v_clone_s"] = cuda_time(lambda: v.clone(), 3, 20)["median_s"]
    out["fusions"] = {"seq": seq, "hidden": hidden, "segments": segments, "results": res}
    print("fusions: " + ", ".join(f"{k}={v:.3e}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items()), flush=True)


def section_kernels(out, seq=15356):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from comfy.ldm.minimax_h3 import kernels
    heads, dim = 56, 128
    qkv = torch.randn(seq, 3 * heads * dim, device="cuda", dtype=torch.bfloat16)
    q, k, v = (t.view(seq, heads, dim).transpose(0, 1).unsqueeze(0) for t in qkv.split(heads * dim, dim=-1))
    qc, kc, vc = (t.contiguous() for t in (q, k, v))
    res = {}
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                          ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        for layout, tensors in (("strided_qkv_views", (q, k, v)), ("contiguous", (qc, kc, vc))):
            try:
                with sdpa_kernel([backend]):
                    res[f"sdpa_{name}_{layout}"] = cuda_time(lambda: F.scaled_dot_product_attention(*tensors), 2, 5)["median_s"]
            except RuntimeError as e:
                res[f"sdpa_{name}_{layout}"] = f"unavailable: {str(e)[:80]}"
    res["h3_kernels_attention"] = cuda_time(
        lambda: kernels.attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), heads, {}), 2, 5)["median_s"]
    # fused per-head RMSNorm + split-half rope (kitchen) vs a torch reference
    from comfy.ldm.minimax_h3.embedding import rope_rotation_table
    angles = torch.randn(seq, 96, device="cuda")
    table = rope_rotation_table(angles, torch.bfloat16)
    w = torch.ones(dim, device="cuda", dtype=torch.bfloat16)
    buf = torch.randn(seq, 3 * heads * dim, device="cuda", dtype=torch.bfloat16)

    def fused():
        qq, kk, _ = buf.split(heads * dim, dim=-1)
        kernels.rms_rope_(qq.view(1, seq, heads, dim), kk.view(1, seq, heads, dim), table, w, w, 1e-5)

    cos, sin = torch.cos(angles[:, :48]).to(torch.bfloat16), torch.sin(angles[:, :48]).to(torch.bfloat16)

    def reference():
        qq, kk, _ = buf.split(heads * dim, dim=-1)
        outs = []
        for t in (qq.view(seq, heads, dim), kk.view(seq, heads, dim)):
            t = F.rms_norm(t, (dim,), w, 1e-5)
            rot, rest = t[..., :96], t[..., 96:]
            x1, x2 = rot[..., :48], rot[..., 48:]
            c, s = cos[:, None], sin[:, None]
            outs.append(torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1))
        return outs

    res["rms_rope_fused_kitchen_s"] = cuda_time(fused, 3, 10)["median_s"]
    res["rms_rope_torch_reference_s"] = cuda_time(reference, 3, 10)["median_s"]
    # packing q|k|v head slices for the all-to-all (the only copy the sharded path adds per block)
    from comfy.ldm.minimax_h3.plan import balanced_ranges
    for world in (2, 4, 8):
        s = seq // world
        x = torch.randn(s, 3, heads, dim, device="cuda", dtype=torch.bfloat16)
        bounds = balanced_ranges(heads, world)
        packer = rank_ulysses(world, seq, heads, dim)
        res[f"qkv_pack_cat_N{world}_s"] = cuda_time(lambda: torch.cat([x[:, :, a:b].reshape(-1) for a, b in bounds]), 3, 10)["median_s"]
        res[f"qkv_pack_one_copy_N{world}_s"] = cuda_time(lambda: pack_heads(packer, x), 3, 10)["median_s"]
        # the same copy on bf16 elements, not 8-byte words
        res[f"qkv_pack_one_copy_bf16_elements_N{world}_s"] = cuda_time(lambda: pack_heads(packer, x, words=False), 3, 10)["median_s"]
    out["kernels"] = {"seq": seq, "heads": heads, "head_dim": dim, "results": res}
    print("kernels: " + ", ".join(f"{k}={v if isinstance(v, str) else round(v * 1000, 3)}" for k, v in res.items()), flush=True)


SECTIONS = {
    "graph_profile": lambda run: section_graph_profile(run.ours, run.out),
    "attention_ab": lambda run: section_attention_ab(run.out),
    "fusions": lambda run: section_fusions(run.out),
    "kernels": lambda run: section_kernels(run.out),
}

if __name__ == "__main__":
    main(__doc__, SECTIONS)
