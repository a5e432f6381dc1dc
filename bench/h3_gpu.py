"""H3 at real dimensions on one GPU: ours vs upstream native forward, the emulated per-rank work
of an N-way Ulysses shard, kernel choices, and a profile of one step.

Runs on a CUDA machine with a ComfyUI checkout of the pinned base on COMFYUI_DIR (upstream's model
is imported from there). Both models share one set of random bf16 weights (upstream's parameters
are assigned into ours), so a 62 GiB model fits once. Results: JSON (one file, rewritten after
every section so a timeout still leaves what was measured).

  python bench/h3_gpu.py --out bench/results/h3_h200.json [--sections native,shard,kernels,profile]
"""

import argparse
import json
import os
import platform
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

RESOLUTIONS = {"832x480x124": (480, 832, 124), "1344x768x124": (768, 1344, 124)}
TEXT_LEN = 512


def latent_shapes(height, width, frames):
    # EmptyMiniMaxH3LatentAV: 17k+5 frame grid, 16x spatial, 5-frame temporal grouping, 40 Hz audio
    latent_t = 2 if frames <= 5 else ((frames - 5) // 17) * 5 + 2
    return (1, 24, latent_t, height // 16, width // 16), (1, 32, 2, round(frames / 24 * 40))


def cuda_time(fn, warmup=2, iters=5, budget_s=20.0):
    t0 = time.perf_counter()
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    # long steps: fewer repeats (the spread of multi-second steps is well under 1%)
    iters = max(3, min(iters, int(budget_s / max((time.perf_counter() - t0) / max(warmup, 1), 1e-6))))
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1000.0)
    times.sort()
    return {"median_s": times[len(times) // 2], "min_s": times[0], "max_s": times[-1], "n": len(times)}


def init_random_(model, seed=0):
    gen = torch.Generator("cuda").manual_seed(seed)
    for name, t in model.state_dict().items():
        if name.endswith("rope.inv_freq"):
            n = t.shape[0]
            t.copy_(1.0 / (10000.0 ** (torch.arange(n, dtype=torch.float64, device=t.device) / n)))
        elif "norm" in name:
            t.fill_(1.0)
        else:
            t.normal_(0.0, 0.02, generator=gen)


def build_models(args):
    import comfy.ldm.minimax.model as upstream
    import comfy.ops
    from comfy.ldm.minimax_h3.model import MiniMaxH3Model
    ops = comfy.ops.disable_weight_init
    cfg = {} if args.layers is None else {"num_layers": args.layers}
    theirs = upstream.MiniMaxH3Model(**cfg, dtype=torch.bfloat16, device="cuda", operations=ops).requires_grad_(False)
    init_random_(theirs)
    ours = MiniMaxH3Model(**cfg, dtype=torch.bfloat16, device="meta", operations=ops)
    ours.load_state_dict(theirs.state_dict(), assign=True)
    ours.requires_grad_(False)
    n = sum(p.numel() for p in theirs.parameters())
    gib = sum(t.numel() * t.element_size() for t in theirs.state_dict().values()) / 2**30
    return theirs, ours, {"parameters": n, "weights_gib": round(gib, 2), "layers": len(theirs.blocks)}


def inputs(res, seed=0):
    h, w, f = RESOLUTIONS[res]
    vs, as_ = latent_shapes(h, w, f)
    g = torch.Generator("cuda").manual_seed(seed)
    video = torch.randn(vs, generator=g, device="cuda")
    audio = torch.randn(as_, generator=g, device="cuda")
    context = torch.randn(1, TEXT_LEN, 5376, generator=g, device="cuda").to(torch.bfloat16)  # refined (extra_conds)
    t = torch.tensor([600.0], device="cuda")
    return [video, audio], t, context


def section_native(res_list, theirs, ours, out):
    import comfy.ldm.minimax.model as upstream
    from comfy.ldm.minimax_h3.layout import PackedLayout
    rows = {}
    for res in res_list:
        x, t, c = inputs(res)
        sig = (c.shape[1], x[0].shape[2], x[0].shape[3], x[0].shape[4], x[1].shape[-1])
        pt = {"layout": upstream.PackedLayout(*sig), "seed": 0}
        po = {"layout": PackedLayout(*sig), "seed": 0}
        from comfy.ldm.minimax_h3 import kernels
        cudnn_first = kernels.SDPA_PRIORITY
        flash_first = [kernels.SDPBackend.FLASH_ATTENTION] + [b for b in cudnn_first if b != kernels.SDPBackend.FLASH_ATTENTION]

        def rel(a, b):
            return max(float((u.float() - v.float()).abs().max() / v.float().abs().max()) for u, v in zip(a, b))

        with torch.no_grad():
            a = theirs._forward(x, t, c, {}, minimax_payload=pt)
            a2 = theirs._forward(x, t, c, {}, minimax_payload=pt)
            kernels.SDPA_PRIORITY = flash_first
            b_flash = ours._forward(x, t, c, {}, minimax_payload=po)
            kernels.SDPA_PRIORITY = cudnn_first
            b = ours._forward(x, t, c, {}, minimax_payload=po)
            result = {"tokens": PackedLayout(*sig).seq_len,
                      "rel_diff_upstream_run_to_run": rel(a2, a),
                      "rel_diff_ours_flash_vs_upstream": rel(b_flash, a),
                      "rel_diff_ours_cudnn_vs_upstream": rel(b, a),
                      "output_max_abs": max(float(u.float().abs().max()) for u in a)}
            del a, a2, b, b_flash
            runs = (("upstream", theirs, pt, cudnn_first), ("ours", ours, po, cudnn_first), ("ours_flash", ours, po, flash_first),
                    ("upstream_2", theirs, pt, cudnn_first), ("ours_2", ours, po, cudnn_first))
            for name, model, p, prio in runs:
                kernels.SDPA_PRIORITY = prio
                torch.cuda.reset_peak_memory_stats()
                result[name] = cuda_time(lambda: model._forward(x, t, c, {}, minimax_payload=p))
                result[name]["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            kernels.SDPA_PRIORITY = cudnn_first
            # the plan is pure CPU work done once per step on every rank
            plan_t = time.perf_counter()
            for _ in range(20):
                ours.plan(x[0], tuple(x[0].shape[2:]), x[1], t, c, {}, po)
            result["plan_build_ms"] = (time.perf_counter() - plan_t) / 20 * 1000
        up = min(result["upstream"]["median_s"], result["upstream_2"]["median_s"])
        us = min(result["ours"]["median_s"], result["ours_2"]["median_s"])
        result["ratio_ours_over_upstream"] = us / up
        rows[res] = result
        result["ratio_ours_flash_over_upstream"] = result["ours_flash"]["median_s"] / up
        print(f"native {res}: S={result['tokens']} upstream {up:.3f}s ours {us:.3f}s ratio {us / up:.3f} "
              f"(flash-first {result['ours_flash']['median_s']:.3f}s) peak {result['ours']['peak_gib']} GiB "
              f"rel diffs: run-to-run {result['rel_diff_upstream_run_to_run']:.2e} flash {result['rel_diff_ours_flash_vs_upstream']:.2e} "
              f"cudnn {result['rel_diff_ours_cudnn_vs_upstream']:.2e}", flush=True)
    out["native"] = rows


class _EmulatedShard:
    """Stands in for UlyssesAttention on one GPU: the real head packing, then full-sequence
    attention over the largest head share, then the unpacking concat (collectives left out)."""

    def __init__(self, world, seq, heads, dim, device):
        from comfy.ldm.minimax_h3.plan import balanced_ranges
        from comfy.ldm.minimax_h3.ulysses import UlyssesAttention
        self.world_size = world
        self.h = -(-heads // world)
        self.full = torch.randn(seq, 3, self.h, dim, device=device, dtype=torch.bfloat16)
        self.real = UlyssesAttention.__new__(UlyssesAttention)
        self.real.head_ranges, self.real.head_dim = balanced_ranges(heads, world), dim

    def attention(self, qkv, transformer_options):
        from comfy.ldm.minimax_h3 import kernels
        self.real.pack_heads(qkv)
        out = kernels.attention(self.full[:, 0], self.full[:, 1], self.full[:, 2], self.h, transformer_options)
        s = qkv.shape[0]
        return torch.cat([out[:s]] * self.world_size, dim=1)[:, :qkv.shape[2] * qkv.shape[3]]


def section_shard(res_list, ours, out, bandwidths=(180e9, 360e9)):
    from comfy.ldm.minimax_h3.embedding import rope_rotation_table
    block = ours.blocks[0]
    heads, dim, hidden = 56, 128, 5376
    rows = {}
    for res in res_list:
        x, t, c = inputs(res)
        from comfy.ldm.minimax_h3.layout import PackedLayout
        seq = PackedLayout(c.shape[1], x[0].shape[2], x[0].shape[3], x[0].shape[4], x[1].shape[-1]).seq_len
        t_emb = torch.randn(2, 2688, device="cuda", dtype=torch.bfloat16)
        res_rows = {}
        for world in (1, 2, 4, 8):
            s = -(-seq // world)
            h = torch.randn(s, hidden, device="cuda", dtype=torch.bfloat16)
            rope = rope_rotation_table(torch.randn(s, 96, device="cuda"), torch.bfloat16)
            mods = [(0, s // 3, 1), (s // 3, s, 0)]
            sp = None if world == 1 else _EmulatedShard(world, seq, heads, dim, "cuda")
            with torch.no_grad():
                tm = cuda_time(lambda: block(h.clone(), t_emb, mods, rope, {}, seq_parallel=sp), warmup=3, iters=10)
            a2a = 4 * s * heads * dim * 2 * (world - 1) / world  # bytes each rank sends per block (q|k|v + out)
            res_rows[world] = {"rows_per_rank": s, "block_s": tm["median_s"], "a2a_bytes_per_rank_per_block": a2a}
        base = res_rows[1]["block_s"]
        for world, r in res_rows.items():
            r["compute_speedup"] = base / r["block_s"]
            for bw in bandwidths:
                comm = r["a2a_bytes_per_rank_per_block"] / bw
                r[f"projected_speedup_at_{int(bw / 1e9)}GBps"] = base / (r["block_s"] + comm)
        rows[res] = {"tokens": seq, "worlds": res_rows}
        print(f"shard {res}: " + ", ".join(f"N={w} x{r['compute_speedup']:.2f} (proj {r['projected_speedup_at_360GBps']:.2f})"
                                           for w, r in res_rows.items()), flush=True)
    out["shard_emulation"] = {"note": "one DiT block at real dims; per-rank rows S/N for per-token ops, full-sequence "
                                      "attention over ceil(56/N) heads; projection adds all-to-all bytes / bandwidth, no overlap",
                              "resolutions": rows}


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
    from comfy.ldm.minimax_h3.ulysses import UlyssesAttention
    for world in (2, 4, 8):
        s = seq // world
        x = torch.randn(s, 3, heads, dim, device="cuda", dtype=torch.bfloat16)
        bounds = balanced_ranges(heads, world)
        packer = UlyssesAttention.__new__(UlyssesAttention)
        packer.head_ranges, packer.head_dim = bounds, dim
        res[f"qkv_pack_cat_N{world}_s"] = cuda_time(lambda: torch.cat([x[:, :, a:b].reshape(-1) for a, b in bounds]), 3, 10)["median_s"]
        res[f"qkv_pack_one_copy_N{world}_s"] = cuda_time(lambda: packer.pack_heads(x), 3, 10)["median_s"]
    out["kernels"] = {"seq": seq, "heads": heads, "head_dim": dim, "results": res}
    print("kernels: " + ", ".join(f"{k}={v if isinstance(v, str) else round(v * 1000, 3)}" for k, v in res.items()), flush=True)


def section_profile(res, theirs, ours, out, top=25):
    from torch.profiler import ProfilerActivity, profile
    import comfy.ldm.minimax.model as upstream
    from comfy.ldm.minimax_h3.layout import PackedLayout
    x, t, c = inputs(res)
    sig = (c.shape[1], x[0].shape[2], x[0].shape[3], x[0].shape[4], x[1].shape[-1])
    prof_out = {}
    for name, model, p in (("upstream", theirs, {"layout": upstream.PackedLayout(*sig)}), ("ours", ours, {"layout": PackedLayout(*sig)})):
        with torch.no_grad():
            model._forward(x, t, c, {}, minimax_payload=p)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                model._forward(x, t, c, {}, minimax_payload=p)
                torch.cuda.synchronize()
        events = sorted(prof.key_averages(), key=lambda e: e.device_time_total, reverse=True)
        total = sum(e.self_device_time_total for e in prof.key_averages())
        prof_out[name] = {"total_device_ms": total / 1000,
                          "top": [{"name": e.key[:120], "device_ms": e.self_device_time_total / 1000, "count": e.count}
                                  for e in sorted(prof.key_averages(), key=lambda e: e.self_device_time_total, reverse=True)[:top]]}
        del events
        print(f"profile {name}: total device {total / 1000:.1f} ms; top: " +
              "; ".join(f"{r['name'][:50]} {r['device_ms']:.1f}ms x{r['count']}" for r in prof_out[name]["top"][:8]), flush=True)
    out["profile"] = {"resolution": res, **prof_out}


def section_accuracy(ours, out, seq=15356):
    """cuDNN vs flash attention, and one whole DiT block, against fp32 references (fresh inputs)."""
    import copy

    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from comfy.ldm.minimax_h3 import kernels
    from comfy.ldm.minimax_h3.embedding import rope_rotation_table
    heads, dim, hidden = 56, 128, 5376
    g = torch.Generator("cuda").manual_seed(7)
    res = {}

    def rel(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm())

    q, k, v = (torch.randn(1, heads, seq, dim, generator=g, device="cuda") for _ in range(3))
    with torch.no_grad():
        ref = torch.cat([F.scaled_dot_product_attention(q[:, i:i + 4].double(), k[:, i:i + 4].double(), v[:, i:i + 4].double())
                         for i in range(0, heads, 4)], dim=1)
        for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                              ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
            with sdpa_kernel([backend]):
                res[f"attention_{name}_bf16_rel_err"] = rel(F.scaled_dot_product_attention(*(t.bfloat16() for t in (q, k, v))), ref)
        del ref
        # one DiT block (layer 0 weights) in bf16 with each backend vs the same block in fp32
        block = ours.blocks[0]
        block32 = copy.deepcopy(block).float()
        h = torch.randn(seq, hidden, generator=g, device="cuda")
        t_emb = torch.randn(2, 2688, generator=g, device="cuda")
        angles = torch.randn(seq, 96, generator=g, device="cuda") * 3
        mods = [(0, 512, 1), (512, 1000, 5), (1000, seq, 0)]
        ref = block32(h.clone(), t_emb, mods, rope_rotation_table(angles, torch.float32), {})
        saved = kernels.SDPA_PRIORITY
        for name, first in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            kernels.SDPA_PRIORITY = [first] + [b for b in saved if b != first]
            outb = block(h.bfloat16(), t_emb.bfloat16(), mods, rope_rotation_table(angles, torch.bfloat16), {})
            res[f"block_{name}_bf16_rel_err_vs_fp32"] = rel(outb - h.bfloat16(), ref - h)  # error of the block's update
        kernels.SDPA_PRIORITY = saved
        del block32
    out["accuracy"] = {"seq": seq, "note": "relative L2 error vs fp64 (attention) / fp32 (block update x_out - x_in) "
                                            "references; random inputs", "results": res}
    print("accuracy: " + ", ".join(f"{k}={v:.2e}" for k, v in res.items()), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--sections", default="native,accuracy,shard,kernels,profile")
    ap.add_argument("--resolutions", default=",".join(RESOLUTIONS))
    ap.add_argument("--layers", type=int, default=None, help="fewer blocks for a quick check")
    args = ap.parse_args()
    comfy_dir = os.environ.get("COMFYUI_DIR")
    if not comfy_dir:
        sys.exit("set COMFYUI_DIR to a checkout of the pinned ComfyUI base")
    sys.path.append(comfy_dir)
    import comfy_kitchen
    out = {"machine": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
                       "comfy_kitchen": getattr(comfy_kitchen, "__version__", "?"), "python": platform.python_version(),
                       "command": " ".join(sys.argv)},
           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    def save():
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)

    sections = args.sections.split(",")
    res_list = args.resolutions.split(",")
    theirs, ours, info = build_models(args)
    out["model"] = info
    print(f"model: {info}", flush=True)
    save()
    if "native" in sections:
        section_native(res_list, theirs, ours, out)
        save()
    if "profile" in sections:
        section_profile(res_list[0], theirs, ours, out)
        save()
    if "accuracy" in sections:
        section_accuracy(ours, out)
        save()
    if "shard" in sections:
        section_shard(res_list, ours, out)
        save()
    if "kernels" in sections:
        section_kernels(out)
        save()


if __name__ == "__main__":
    main()
