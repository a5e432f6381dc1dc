"""How H3's sequence parallelism would scale, emulated on one GPU: rank 0's DiT block at real size
(S/N rows, ceil(56/N) heads) in the real UlyssesAttention, with only its all-to-alls replaced by a
side-stream stand-in of the same bytes at a given bandwidth; speed-up = native block / rank block.
No multi-GPU run is involved. Sections: overlap (speed-ups per N, pipeline depth, A/Bs), timeline.

  COMFYUI_DIR=/path/to/ComfyUI python bench/h3_sp_emulation.py --layers 2 --out bench/results/h3_h200_sp.json [options]
"""

import time

import torch

from h3_gpu_common import EmulatedComm, bytes_per_block, capture, emulated_ulysses, interleaved, kernel_spans, main, rank_ulysses, tokens


OVERLAP_NOTE = ("one DiT block at real dims per rank (rank 0, S/N rows, ceil(56/N) heads); no_comm: the chunked schedule without "
                "transfers; bwX: every all-to-all replaced by a side-stream stand-in issued in UlyssesAttention's order (a device "
                "copy of the bytes received, then idle until max(sent, received) / X GB/s + latency); NCCL's own SM use is not "
                "modelled; each time the median of {rounds} interleaved rounds of {repeat} blocks back to back (per block); "
                "host_s: the host's time to issue one block (the GPU is host-bound when it is close to block_s); "
                "*_shared_adaln: the adaLN projections shared across ranks (this rank projects one block in N; the "
                "~20 MB/step all-gather, ~1 us/block at 360 GB/s, not emulated); *_upfront: q/k of every head normed "
                "before the first chunk is packed (the schedule before per-chunk preparation); the real UlyssesAttention "
                "runs with only its _a2a replaced; *_last_rank: rank N-1's block (floor(S/N) rows, one modulation segment, "
                "no text rows) beside rank 0's; transfers run on a high-priority stream (as comfy.parallel's NCCL streams), "
                "*_normal_priority on a normal one")


def section_overlap(res_list, ours, out, save=lambda: None, bandwidths=(360e9, 180e9), latency_s=20e-6, chunk_list=(1, 2, 4),
                    repeat=8, rounds=3, shared_chunks=(), unfused=True, graphs=False, upfront_ab=False,
                    last_rank=False, normal_priority_ab=False):
    """Per-rank block time for each all-to-all pipeline depth: without communication (what chunking
    costs the attention kernel) and with the all-to-alls emulated on a side stream; for the depths in
    `shared_chunks` also with the adaLN projections shared across ranks (and, with upfront_ab, the
    same with every head normed before the first chunk leaves: the schedule before per-chunk prep;
    with last_rank, the last rank's block beside rank 0's; with normal_priority_ab, the transfers on a
    normal-priority stream instead of a high-priority one)."""
    from comfy.ldm.minimax_h3.embedding import rope_rotation_table
    from comfy.ldm.minimax_h3 import kernels
    block = ours.blocks[0]
    heads, dim, hidden = 56, 128, 5376
    fused = kernels.fused_adaln
    rows = {}
    out["overlap_emulation"] = {"note": OVERLAP_NOTE.format(rounds=rounds, repeat=repeat), "latency_s_per_collective": latency_s,
                                "repeat": repeat, "rounds": rounds, "resolutions": rows}
    for res in res_list:
        seq = tokens(res)
        t_emb = torch.randn(2, 2688, device="cuda", dtype=torch.bfloat16)
        host = {}

        def block_fn(s, sp, name, fuse=True, share=None, graph=False, text=True):
            # `repeat` blocks back to back per timed call, as in a step: the host may run ahead of the GPU.
            # share=N: the adaLN projections are shared (UlyssesAttention.adaln_projections), so this rank
            # projects once every N blocks; the ~20 MB/step all-gather (~1 us/block at 360 GB/s) is not emulated.
            # text: the rows start with the 512 text rows (rank 0: two modulation segments), else one segment
            h = torch.randn(s, hidden, device="cuda", dtype=torch.bfloat16)
            rope = rope_rotation_table(torch.randn(s, 96, device="cuda"), torch.bfloat16)
            mods = [(0, min(512, s // 3), 1), (min(512, s // 3), s, 0)] if text else [(0, s, 0)]

            def fn():
                kernels.fused_adaln = fused if fuse else (lambda x: False)
                t0 = time.perf_counter()
                with torch.no_grad():
                    proj = None
                    for i in range(repeat):
                        if share and i % share == 0:
                            proj = block.adaln_proj.project(t_emb)
                        block(h.clone(), t_emb, mods, rope, {}, seq_parallel=sp, adaln=proj)
                host.setdefault(name, []).append((time.perf_counter() - t0) / repeat)
                kernels.fused_adaln = fused
            if not graph:
                return fn
            # the same block replayed from one CUDA graph (no per-kernel launch cost); the shared
            # projection runs eagerly into the graph's static input, once every `share` blocks
            share = share or 1  # unshared: every block projects its own (eagerly, as the others do)
            static = block.adaln_proj.project(t_emb)
            with torch.no_grad():
                g = capture(lambda: block(h.clone(), t_emb, mods, rope, {}, seq_parallel=sp, adaln=static))

            def replay():
                t0 = time.perf_counter()
                with torch.no_grad():
                    for i in range(repeat):
                        if share and i % share == 0:
                            static.copy_(block.adaln_proj.project(t_emb))
                        g.replay()
                host.setdefault(name, []).append((time.perf_counter() - t0) / repeat)
            replay.graph = g
            return replay

        def host_s(name):
            v = sorted(host.pop(name))
            return v[len(v) // 2]

        natives = {"native": block_fn(seq, None, "native")}
        if graphs:
            natives["native_graph"] = block_fn(seq, None, "native_graph", graph=True)
        native_times = interleaved(natives, rounds=rounds if graphs else 3, warmup=2 if graphs else 3, iters=6 if graphs else 10)
        base = native_times["native"] / repeat
        res_rows = {"1": {"block_s": base, "host_s": host_s("native")}}
        if graphs:
            res_rows["1"]["graph_block_s"] = native_times["native_graph"] / repeat
            res_rows["1"]["graph_host_s"] = host_s("native_graph")
        del natives
        comms = {int(bw / 1e9): EmulatedComm(bw, latency_s) for bw in bandwidths}
        normal = {int(bw / 1e9): EmulatedComm(bw, latency_s, high_priority=False) for bw in bandwidths} if normal_priority_ab else {}
        for world in (2, 4, 8):
            s = -(-seq // world)
            fns = {}
            if unfused:
                fns["chunks1_no_comm_unfused_adaln"] = block_fn(s, emulated_ulysses(world, seq, heads, dim, 1, None),
                                                                "chunks1_no_comm_unfused_adaln", fuse=False)
            for chunks in shared_chunks:
                if chunks > heads // world:
                    continue
                fns[f"chunks{chunks}_no_comm_shared_adaln"] = block_fn(
                    s, emulated_ulysses(world, seq, heads, dim, chunks, None), f"chunks{chunks}_no_comm_shared_adaln", share=world)
                if graphs:
                    fns[f"chunks{chunks}_no_comm_shared_adaln_graph"] = block_fn(
                        s, emulated_ulysses(world, seq, heads, dim, chunks, None), f"chunks{chunks}_no_comm_shared_adaln_graph",
                        share=world, graph=True)
                for gbps, comm in comms.items():
                    fns[f"chunks{chunks}_bw{gbps}_shared_adaln"] = block_fn(
                        s, emulated_ulysses(world, seq, heads, dim, chunks, comm), f"chunks{chunks}_bw{gbps}_shared_adaln",
                        share=world)
                    if upfront_ab:
                        name = f"chunks{chunks}_bw{gbps}_shared_adaln_upfront"
                        fns[name] = block_fn(s, emulated_ulysses(world, seq, heads, dim, chunks, comm, upfront=True), name, share=world)
                    if normal_priority_ab:
                        name = f"chunks{chunks}_bw{gbps}_shared_adaln_normal_priority"
                        fns[name] = block_fn(s, emulated_ulysses(world, seq, heads, dim, chunks, normal[gbps]), name, share=world)
                    if last_rank:  # the last rank: floor(S/N) rows, no text rows (one modulation segment)
                        name = f"chunks{chunks}_bw{gbps}_shared_adaln_last_rank"
                        fns[name] = block_fn(seq // world, emulated_ulysses(world, seq, heads, dim, chunks, comm, rank=world - 1),
                                             name, share=world, text=False)
            for chunks in chunk_list:
                if chunks > heads // world:
                    continue
                fns[f"chunks{chunks}_no_comm"] = block_fn(s, emulated_ulysses(world, seq, heads, dim, chunks, None),
                                                           f"chunks{chunks}_no_comm")
                for gbps, comm in comms.items():
                    fns[f"chunks{chunks}_bw{gbps}"] = block_fn(s, emulated_ulysses(world, seq, heads, dim, chunks, comm),
                                                               f"chunks{chunks}_bw{gbps}")
            times = interleaved(fns, rounds=rounds, warmup=2, iters=6)
            w_rows = {"rows_per_rank": s, "a2a_bytes_per_block": bytes_per_block(rank_ulysses(world, seq, heads, dim)),
                      "times": {k: {"block_s": v / repeat, "speedup": base / (v / repeat), "host_s": host_s(k)}
                                for k, v in times.items()}}
            res_rows[str(world)] = w_rows
            print(f"overlap {res} N={world}: " + ", ".join(f"{k} x{v['speedup']:.3f} (host {v['host_s'] * 1e3:.2f} ms)"
                                                         for k, v in w_rows["times"].items()), flush=True)
            del fns
        rows[res] = {"tokens": seq, "native_block_s": base, "native_host_s": res_rows["1"]["host_s"], "worlds": res_rows}
        print(f"overlap {res} native block {base * 1e3:.2f} ms (host {res_rows['1']['host_s'] * 1e3:.2f} ms)", flush=True)
        del comms, normal
        save()


def section_timeline(res, ours, out, worlds=(2, 8), chunks=2, bandwidth=360e9, latency_s=20e-6):
    """Kernel timeline of one rank block (the second of three back to back, profiler) with emulated
    transfers: per-chunk q/k preparation vs up front, transfers on a high- vs normal-priority stream.
    Shows where the first chunk's transfer starts and how long attention waits for it."""
    from comfy.ldm.minimax_h3.embedding import rope_rotation_table
    block, seq = ours.blocks[0], tokens(res)
    t_emb = torch.randn(2, 2688, device="cuda", dtype=torch.bfloat16)
    comms = {"high": EmulatedComm(bandwidth, latency_s), "normal": EmulatedComm(bandwidth, latency_s, high_priority=False)}
    rows = out["timeline"] = {"resolution": res, "tokens": seq, "chunks": chunks, "bandwidth_gbps": bandwidth / 1e9,
                              "note": "kernels of the second of 3 blocks back to back: (start us from the block's first "
                                      "kernel, duration us, name); all streams", "runs": {}}
    for world in worlds:
        s = -(-seq // world)
        h = torch.randn(s, 5376, device="cuda", dtype=torch.bfloat16)
        rope = rope_rotation_table(torch.randn(s, 96, device="cuda"), torch.bfloat16)
        mods = [(0, 512, 1), (512, s, 0)]
        proj = block.adaln_proj.project(t_emb)
        for prio, comm in comms.items():
            for upfront in (False, True):
                sp = emulated_ulysses(world, seq, 56, 128, chunks, comm, upfront=upfront)

                def fn():
                    block(h.clone(), t_emb, mods, rope, {}, seq_parallel=sp, adaln=proj)
                with torch.no_grad():
                    for _ in range(3):
                        fn()
                    ks = kernel_spans(lambda: [fn() for _ in range(3)])
                n = len(ks) // 3
                t0 = ks[n][0]
                key = f"N{world}_{prio}_priority_{'upfront' if upfront else 'per_chunk'}"
                attn = [a for a, _, name in ks[n:2 * n] if "sdpa" in name or "flash" in name]
                rows["runs"][key] = {"block_span_us": ks[2 * n][0] - t0, "first_attention_start_us": attn[0] - t0 if attn else None,
                                     "kernels": [(round(a - t0, 1), round(b - a, 1), name[:70]) for a, b, name in ks[n:2 * n]]}
                print(f"timeline {key}: block span {ks[2 * n][0] - t0:.1f} us, first attention at "
                      f"{rows['runs'][key]['first_attention_start_us']} us", flush=True)


def add_arguments(ap):
    ap.add_argument("--chunks", default="1,2,4", help="overlap: all-to-all pipeline depths")
    ap.add_argument("--shared-chunks", default="", help="overlap: depths also run with the adaLN projections shared")
    ap.add_argument("--bandwidths", default="360,180", help="overlap: emulated all-to-all bandwidths, GB/s")
    ap.add_argument("--rounds", type=int, default=3, help="overlap: interleaved rounds")
    ap.add_argument("--no-unfused", action="store_true", help="overlap: skip the unfused-adaLN reference")
    ap.add_argument("--repeat", type=int, default=8, help="overlap: blocks back to back per timing (50 = one H3 step)")
    ap.add_argument("--graphs", action="store_true", help="overlap: also the shared-adaLN block replayed from a CUDA graph")
    ap.add_argument("--normal-priority-ab", action="store_true",
                    help="overlap: also the shared-adaLN variants with the emulated transfers on a normal-priority stream")
    ap.add_argument("--last-rank", action="store_true", help="overlap: also the last rank's shared-adaLN block (no text rows)")
    ap.add_argument("--upfront-ab", action="store_true",
                    help="overlap: also the shared-adaLN variants with q/k normed up front (before per-chunk preparation)")


def overlap(run):
    args = run.args
    ints = lambda v: tuple(int(c) for c in v.split(",") if c)  # noqa: E731
    section_overlap(run.resolutions, run.ours, run.out, run.save, bandwidths=tuple(b * 1e9 for b in ints(args.bandwidths)),
                    chunk_list=ints(args.chunks), rounds=args.rounds, shared_chunks=ints(args.shared_chunks),
                    unfused=not args.no_unfused, repeat=args.repeat, graphs=args.graphs,
                    upfront_ab=args.upfront_ab, last_rank=args.last_rank,
                    normal_priority_ab=args.normal_priority_ab)


SECTIONS = {"overlap": overlap, "timeline": lambda run: section_timeline(run.resolutions[0], run.ours, run.out)}

if __name__ == "__main__":
    main(__doc__, SECTIONS, add_arguments)
