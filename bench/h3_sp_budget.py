"""Where a sequence-parallel rank's block time goes, and what does not shrink with N (one GPU).

Sections: gaps (idle time between kernels over a step's 50 blocks back to back, and any host sync,
checked with torch.cuda's sync debug mode), budget (GPU kernel time of each op of one DiT block at
the rows and heads rank 0 of an N-way shard holds, against the native block split N ways).

  COMFYUI_DIR=/path/to/ComfyUI python bench/h3_sp_budget.py --layers 2 --out bench/results/h3_h200_budget.json [--sections budget]
"""

import os

import torch

from h3_gpu_common import cudnn_first_priority, ROOT, capture, cuda_time, emulated_ulysses, gpu_kernel_s, kernel_spans, main, pack_heads, rank_ulysses, tokens


BUDGET_NOTE = ("GPU kernel time (profiler) of each op of one DiT block (layer 0 weights, bf16) at the rows and heads rank 0 of an "
               "N-way shard holds: ceil(S/N) rows for per-token ops, ceil(56/N) heads over all S rows for attention (in "
               "{chunks} chunks as UlyssesAttention runs it, each chunk's output made contiguous for its all-to-all); "
               "count: calls per block. ideal_s = N=1 time / N; excess_s = per-block time - ideal. block_s: event time of "
               "the whole block (no transfers, host may add gaps), block_kernel_s: its kernel time")


def steady_blocks(block, x, t_emb, mods, rope, sp, repeat=8):
    """`repeat` blocks back to back (as in a step): event time, the kernel timeline (how much of the
    span the GPU is busy, how many kernels), and the same block replayed from a CUDA graph (no
    launch gaps) -- all per block."""
    xs = [x.clone() for _ in range(repeat)]

    def run():
        for xi in xs:
            block(xi, t_emb, mods, rope, {}, seq_parallel=sp)
    out = {"block_s": cuda_time(run, 3, 10)["median_s"] / repeat}
    spans = [(a, b) for a, b, _ in kernel_spans(run)]
    busy, end = 0.0, None
    for a, b in spans:
        if end is None or a >= end:
            busy, end = busy + (b - a), b
        elif b > end:
            busy, end = busy + (b - end), b
    small = [b - a for a, b in spans if b - a < 10]
    out.update({"kernels_per_block": len(spans) / repeat, "busy_s": busy / repeat / 1e6,
                "span_s": (spans[-1][1] - spans[0][0]) / repeat / 1e6 if spans else 0.0,
                "kernels_under_10us_per_block": len(small) / repeat, "kernels_under_10us_s": sum(small) / repeat / 1e6})
    try:
        graph = capture(lambda: block(xs[0], t_emb, mods, rope, {}, seq_parallel=sp))

        def replay():
            for _ in range(repeat):
                graph.replay()
        out["graph_block_s"] = cuda_time(replay, 3, 10)["median_s"] / repeat
    except Exception as e:  # a kernel that cannot be captured: say so, keep the rest
        out["graph_block_s"] = f"capture failed: {type(e).__name__}: {str(e)[:120]}"
    return out


def section_budget(res_list, ours, out, save=lambda: None, worlds=(1, 2, 4, 8), chunks=None):
    """Where a rank's block time goes, op by op, against the native block split N ways."""
    import comfy.ops
    from torch.nn.attention import SDPBackend
    from comfy.ldm.minimax_h3 import kernels
    from comfy.ldm.minimax_h3.embedding import rope_rotation_table
    from comfy.ldm.minimax_h3.modulation import mod_gate, norm_scale_shift
    from comfy.ldm.minimax_h3.ulysses import DEFAULT_CHUNKS
    chunks = chunks or DEFAULT_CHUNKS
    block, heads, dim, hidden = ours.blocks[0], 56, 128, 5376
    attn, mlp = block.attn, block.mlp
    rows = out["budget"] = {"note": BUDGET_NOTE.format(chunks=chunks), "chunks": chunks, "resolutions": {}}
    g = torch.Generator("cuda").manual_seed(11)
    t_emb = torch.randn(2, 2688, generator=g, device="cuda").bfloat16()
    cudnn_first = cudnn_first_priority()
    flash_first = [SDPBackend.FLASH_ATTENTION] + [b for b in cudnn_first if b != SDPBackend.FLASH_ATTENTION]
    with torch.no_grad():
        shift, scale, gate = (t[:2] for t in block.adaln_proj(t_emb)[:3])
        for res in res_list:
            seq = tokens(res)
            per_world = {}
            for world in worlds:
                s = -(-seq // world)
                sp = rank_ulysses(world, seq, heads, dim, chunks=chunks) if world > 1 else None
                h_r = -(-heads // world)
                x = torch.randn(s, hidden, generator=g, device="cuda").bfloat16()
                mods = [(0, min(512, s // 3), 1), (min(512, s // 3), s, 0)]
                rope = rope_rotation_table(torch.randn(s, 96, generator=g, device="cuda"), torch.bfloat16)
                qkv = attn.qkv_proj(x)
                w = attn.q_norm.weight
                sizes = [heads] if sp is None else [c[0] for c in sp.chunk_sizes]
                full = [torch.randn(seq, 3, c, dim, generator=g, device="cuda").bfloat16() for c in sizes]
                o = torch.randn(s, hidden, generator=g, device="cuda").bfloat16()
                a = torch.randn(s, heads * dim, generator=g, device="cuda").bfloat16()  # attention output rows
                fc1_out = mlp.fc1(x)

                def rms_rope():
                    q, k, _ = qkv.split(heads * dim, dim=-1)
                    kernels.rms_rope_(q.view(1, s, heads, dim), k.view(1, s, heads, dim), rope, w, w, 1e-5)

                def attention():
                    for f, c in zip(full, sizes):
                        kernels.attention(f[:, 0], f[:, 1], f[:, 2], c, {}).contiguous()

                ops = {"adaln_proj": (lambda: block.adaln_proj.project(t_emb), 1),
                       "norm_modulation": (lambda: norm_scale_shift(block.norm1, x, shift, scale, mods), 2),
                       "qkv_proj": (lambda: attn.qkv_proj(x), 1),
                       "rms_rope": (rms_rope, 1),
                       "attention": (attention, 1),
                       "out_proj": (lambda: attn.out_proj(a), 1),
                       "gate_residual": (lambda: mod_gate(x.clone(), gate, o, mods), 2),
                       "fc1": (lambda: mlp.fc1(x), 1),
                       "swiglu_fc2": (lambda: comfy.ops.linear_input_act(mlp.fc2, fc1_out, "swiglu"), 1)}
                if sp is not None:
                    qkv4 = qkv.view(s, 3, heads, dim)
                    ops["pack"] = (lambda: pack_heads(sp, qkv4), 1)
                    pieces = [a[:, :sp.chunk_sizes[c][j] * dim].contiguous() for j in range(world) for c in range(sp.chunks)]
                    ops["unpack_cat"] = (lambda: torch.cat(pieces, dim=1), 1)
                r = {"rows": s, "heads": h_r, "ops": {}}
                for name, (fn, count) in ops.items():
                    r["ops"][name] = {"s": gpu_kernel_s(fn), "count": count}
                comfy.ops.SDPA_BACKEND_PRIORITY = flash_first
                r["attention_flash_first_s"] = gpu_kernel_s(attention)
                comfy.ops.SDPA_BACKEND_PRIORITY = cudnn_first
                r["gate_residual_clone_s"] = gpu_kernel_s(lambda: x.clone())  # the clone inside the gate_residual timing
                r["ops"]["gate_residual"]["s"] -= r["gate_residual_clone_s"]
                emu = emulated_ulysses(world, seq, heads, dim, chunks, None) if world > 1 else None
                mods_full = [(0, min(512, s // 3), 1), (min(512, s // 3), s, 0)]

                def whole():
                    block(x.clone(), t_emb, mods_full, rope, {}, seq_parallel=emu)
                r["block_kernel_s"] = gpu_kernel_s(whole) - r["gate_residual_clone_s"]
                r["steady"] = steady_blocks(block, x, t_emb, mods_full, rope, emu, repeat=8)
                r["block_s"] = cuda_time(whole, 3, 10)["median_s"] - r["gate_residual_clone_s"]
                r["ops_sum_s"] = sum(v["s"] * v["count"] for v in r["ops"].values())
                per_world[str(world)] = r
            one = per_world["1"]["ops"]
            for world, r in per_world.items():
                n = int(world)
                for name, v in r["ops"].items():
                    ideal = one[name]["s"] * one[name]["count"] / n if name in one else 0.0
                    v["ideal_s"] = ideal
                    v["excess_s"] = v["s"] * v["count"] - ideal
                r["ideal_block_s"] = per_world["1"]["block_kernel_s"] / n
                r["ceiling_speedup_kernels"] = per_world["1"]["block_kernel_s"] / r["block_kernel_s"]
                st = r["steady"]
                graph = st["graph_block_s"]
                print(f"budget {res} N={n} steady: block {st['block_s'] * 1e3:.3f} ms, busy {st['busy_s'] * 1e3:.3f}, span "
                      f"{st['span_s'] * 1e3:.3f}, kernels {st['kernels_per_block']:.0f} ({st['kernels_under_10us_per_block']:.0f} "
                      f"under 10 us, {st['kernels_under_10us_s'] * 1e3:.3f} ms), graph "
                      f"{graph * 1e3 if isinstance(graph, float) else graph}", flush=True)
                print(f"budget {res} N={n}: block {r['block_s'] * 1e3:.3f} ms (kernels {r['block_kernel_s'] * 1e3:.3f}, "
                      f"ideal {r['ideal_block_s'] * 1e3:.3f}, x{r['ceiling_speedup_kernels']:.2f}); excess ms: " +
                      ", ".join(f"{k} {v['excess_s'] * 1e3:+.3f}" for k, v in r["ops"].items()) +
                      f"; attention flash-first {r['attention_flash_first_s'] * 1e3:.3f} vs {r['ops']['attention']['s'] * 1e3:.3f}",
                      flush=True)
            rows["resolutions"][res] = {"tokens": seq, "worlds": per_world}
            save()


def section_gaps(res_list, ours, out, save=lambda: None, worlds=(1, 2, 4, 8), repeat=50, top=12):
    """Where the GPU idles between kernels in `repeat` blocks back to back (a step), and whether any
    op in a block synchronizes the host (torch.cuda sync debug mode)."""
    import warnings

    from comfy.ldm.minimax_h3.embedding import rope_rotation_table
    block, heads, dim, hidden = ours.blocks[0], 56, 128, 5376
    rows = out["gaps"] = {"repeat": repeat, "resolutions": {}}
    t_emb = torch.randn(2, 2688, device="cuda").bfloat16()
    for res in res_list:
        seq = tokens(res)
        per = rows["resolutions"][res] = {"tokens": seq, "worlds": {}}
        for world in worlds:
            s = -(-seq // world)
            sp = emulated_ulysses(world, seq, heads, dim, 2, None) if world > 1 else None
            xs = [torch.randn(s, hidden, device="cuda").bfloat16() for _ in range(4)]
            rope = rope_rotation_table(torch.randn(s, 96, device="cuda"), torch.bfloat16)
            mods = [(0, min(512, s // 3), 1), (min(512, s // 3), s, 0)]

            def run(n):
                with torch.no_grad():
                    proj = None
                    for i in range(n):
                        if sp is not None and i % world == 0:
                            proj = block.adaln_proj.project(t_emb)
                        block(xs[i % 4].clone(), t_emb, mods, rope, {}, seq_parallel=sp, adaln=proj)
            run(3)
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    run(1)
                    n_block = len(caught)
                    torch.zeros(1, device="cuda").item()  # positive control: the detector sees a known sync
                    control = any("synchroniz" in str(w.message) and "prototype" not in str(w.message) for w in caught[n_block:])
                    del caught[n_block:]
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            syncs = sorted({f"{os.path.relpath(w.filename, ROOT) if w.filename.startswith(ROOT) else w.filename}:{w.lineno}: "
                            f"{str(w.message)[:80]}" for w in caught if "synchroniz" in str(w.message) and "prototype" not in str(w.message)})
            ks = kernel_spans(lambda: run(repeat))
            gaps = {}
            idle = 0.0
            for (a0, b0, n0), (a1, b1, n1) in zip(ks, ks[1:]):
                gap = a1 - b0
                if gap > 0:
                    idle += gap
                    key = f"{n0[:60]} -> {n1[:60]}"
                    g = gaps.setdefault(key, [0.0, 0])
                    g[0] += gap
                    g[1] += 1
            worst = sorted(gaps.items(), key=lambda kv: -kv[1][0])[:top]
            busy = sum(b - a for a, b, _ in ks)
            by_name = {}
            for a, b, name in ks:
                by_name[name[:90]] = by_name.get(name[:90], 0.0) + (b - a)
            per["worlds"][str(world)] = {
                "host_syncs": syncs, "sync_detector_saw_control": control, "kernels_per_block": len(ks) / repeat, "busy_s_per_block": busy / repeat / 1e6,
                "idle_s_per_block": idle / repeat / 1e6,
                "largest_gaps": [{"between": k, "s_per_block": v[0] / repeat / 1e6, "count_per_block": v[1] / repeat} for k, v in worst],
                "kernel_s_per_block": {k: v / repeat / 1e6 for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])}}
            w = per["worlds"][str(world)]
            print(f"gaps {res} N={world}: {w['kernels_per_block']:.0f} kernels, busy {w['busy_s_per_block'] * 1e3:.3f} ms, idle "
                  f"{w['idle_s_per_block'] * 1e3:.3f} ms per block; host syncs {syncs or 'none'} (detector control {control}); largest: " +
                  "; ".join(f"{g['between']} {g['s_per_block'] * 1e6:.1f} us" for g in w["largest_gaps"][:6]), flush=True)
            save()


SECTIONS = {
    "gaps": lambda run: section_gaps(run.resolutions, run.ours, run.out, run.save),
    "budget": lambda run: section_budget(run.resolutions, run.ours, run.out, run.save),
}

if __name__ == "__main__":
    main(__doc__, SECTIONS)
