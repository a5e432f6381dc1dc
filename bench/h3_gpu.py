"""H3 at real dimensions on one GPU: ours vs upstream native forward, the emulated per-rank work
of an N-way Ulysses shard, kernel choices, and a profile of one step.

Runs on a CUDA machine with a ComfyUI checkout of the pinned base on COMFYUI_DIR (upstream's model
is imported from there). Both models share one set of random bf16 weights (upstream's parameters
are assigned into ours), so a 62 GiB model fits once. Results: JSON (one file, rewritten after
every section so a timeout still leaves what was measured).

  python bench/h3_gpu.py --out bench/results/h3_h200.json [--sections native,overlap,fusions,kernels,profile]

The committed results came from (one H200, trimmed base on COMFYUI_DIR, kitchen/aimdo wheels on PYTHONPATH):
  --sections native,kernels                          -> bench/results/h3_h200.json
  --sections overlap,fusions,accuracy,profile        -> bench/results/h3_h200_accuracy_profile.json
  --layers 2 --sections overlap                      -> bench/results/h3_h200_overlap.json (via bench/h3_overlap_log.py)
  --layers 2 --sections budget,kernels               -> bench/results/h3_h200_budget.json
  --layers 2 --sections gaps                         -> bench/results/h3_h200_gaps.json
  --layers 2 --sections fusions                      -> bench/results/h3_h200_fusions_segments.json (segment redo rows)
  --layers 2 --sections attention_ab,graph_profile   -> bench/results/h3_h200_attention_ab.json
  --layers 2 --sections overlap --resolutions 832x480x124 --repeat 50 --chunks 2 --shared-chunks 2 --bandwidths 360 \
      --graphs --no-unfused                          -> bench/results/h3_h200_shared_adaln_15k.json
  (the same with --resolutions 1344x768x124 --repeat 8 -> bench/results/h3_h200_shared_adaln_38k.json)
  --layers 2 --sections timeline,overlap --resolutions 832x480x124 --repeat 50 --chunks "" --shared-chunks 2 \
      --bandwidths 360 --no-unfused --upfront-ab --normal-priority-ab --last-rank
                                                     -> bench/results/h3_h200_chunk_prep_15k.json (current code)
  (the same without timeline, with --resolutions 1344x768x124 --repeat 8 -> bench/results/h3_h200_chunk_prep_38k.json)
The earlier overlap runs (before h3_h200_chunk_prep_*) used a stand-in that copied the chunk schedule;
the overlap section now runs the real UlyssesAttention with only its all-to-alls emulated.
The overlap, budget and gaps sections use blocks[0] only, so --layers 2 measures them at full block
size with a fast start.
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


def section_native(res_list, theirs, ours, out, save=lambda: None):
    import comfy.ldm.minimax.model as upstream
    from comfy.ldm.minimax_h3.layout import PackedLayout
    rows = out["native"] = {}
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
                    ("ours_unfused_adaln", ours, po, cudnn_first), ("upstream_2", theirs, pt, cudnn_first),
                    ("ours_2", ours, po, cudnn_first))
            fused = kernels.fused_adaln
            for name, model, p, prio in runs:
                kernels.SDPA_PRIORITY = prio
                kernels.fused_adaln = (lambda x: False) if name == "ours_unfused_adaln" else fused
                torch.cuda.reset_peak_memory_stats()
                result[name] = cuda_time(lambda: model._forward(x, t, c, {}, minimax_payload=p))
                result[name]["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            kernels.SDPA_PRIORITY = cudnn_first
            kernels.fused_adaln = fused
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
        save()
        print(f"native {res}: S={result['tokens']} upstream {up:.3f}s ours {us:.3f}s ratio {us / up:.3f} "
              f"(flash-first {result['ours_flash']['median_s']:.3f}s, unfused adaLN {result['ours_unfused_adaln']['median_s']:.3f}s) peak {result['ours']['peak_gib']} GiB "
              f"rel diffs: run-to-run {result['rel_diff_upstream_run_to_run']:.2e} flash {result['rel_diff_ours_flash_vs_upstream']:.2e} "
              f"cudnn {result['rel_diff_ours_cudnn_vs_upstream']:.2e}", flush=True)


def _ulysses(world, seq, heads, dim, chunks=1, rank=0, cls=None):
    """A real UlyssesAttention (its head geometry and packing) for rank `rank` of an N-way shard."""
    from types import SimpleNamespace

    from comfy.ldm.minimax_h3.plan import balanced_ranges
    from comfy.ldm.minimax_h3.ulysses import UlyssesAttention
    shard = SimpleNamespace(rank=rank, world_size=world, row_ranges=balanced_ranges(seq, world),
                            head_ranges=balanced_ranges(heads, world))
    return (cls or UlyssesAttention)(shard, heads, dim, chunks=chunks)


def chunk_bytes(ulysses, c, elem=2):
    """(in send, in recv, out send, out recv) bytes of rank `ulysses.rank` for chunk c of one block (bf16)."""
    sizes = ulysses.chunk_sizes[c]
    me, d = ulysses.rank, ulysses.head_dim
    s_r = ulysses.rows[me]
    others_rows = sum(ulysses.rows) - s_r
    mine, total = sizes[me], sum(sizes)
    return (s_r * 3 * (total - mine) * d * elem, others_rows * 3 * mine * d * elem,
            others_rows * mine * d * elem, s_r * (total - mine) * d * elem)


def bytes_per_block(ulysses):
    """Bytes one rank moves per block: each all-to-all counted as max(sent, received)."""
    return sum(max(b[0], b[1]) + max(b[2], b[3]) for b in (chunk_bytes(ulysses, c) for c in range(ulysses.chunks)))


def tokens(res):
    from comfy.ldm.minimax_h3.layout import PackedLayout
    h, w, f = RESOLUTIONS[res]
    vs, as_ = latent_shapes(h, w, f)
    return PackedLayout(TEXT_LEN, vs[2], vs[3], vs[4], as_[-1]).seq_len


class _EmulatedComm:
    """One all-to-all as seen by one rank, on a side stream standing in for NCCL's: it starts when
    its input is ready (an event on the compute stream), writes random values into its receive
    buffer (a device copy, the receive side's memory traffic), then idles until
    max(sent, received) / bandwidth + latency has passed (torch.cuda._sleep). Not modelled: the SMs
    NCCL's kernels occupy. The first call at each size measures that copy (a host sync): warm up."""

    def __init__(self, bandwidth, latency_s, high_priority=True):
        # comfy.parallel creates NCCL's streams at high priority (pg.init_groups): a transfer issued
        # before a compute kernel gets SMs ahead of that kernel's waiting blocks
        self.stream = torch.cuda.Stream(priority=-100 if high_priority else 0)
        self.bandwidth, self.latency_s = bandwidth, latency_s
        self.source = torch.zeros(0, dtype=torch.bfloat16, device="cuda")
        t = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t[0].record()
        torch.cuda._sleep(20_000_000)
        t[1].record()
        torch.cuda.synchronize()
        self.cycles_per_s = 20_000_000 / (t[0].elapsed_time(t[1]) / 1000)
        self.copy_s = {}

    def _copy_time(self, recv):
        n = recv.numel()
        if n not in self.copy_s:
            self.copy_s[n] = cuda_time(lambda: recv.copy_(self._source(n)), 2, 5)["median_s"]
        return self.copy_s[n]

    def _source(self, n):
        """n bytes of random bf16 values (what arrives is data, not zeros: see _emulated_ulysses)."""
        if self.source.numel() * 2 < n:
            self.source = torch.randn(-(-n // 2), dtype=torch.bfloat16, device="cuda")
        return self.source.view(torch.uint8)[:n]

    def start(self, recv, send_bytes, recv_bytes):
        """Fill `recv` (as a uint8 view) like a transfer of these sizes would; -> an event the consumer waits on."""
        recv = recv.view(torch.uint8)
        total = max(send_bytes, recv_bytes) / self.bandwidth + self.latency_s
        idle = max(0.0, total - self._copy_time(recv))
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            recv.copy_(self._source(recv.numel()))
            torch.cuda._sleep(int(idle * self.cycles_per_s))
            done = torch.cuda.Event()
            done.record()
        return done


class _EventWork:
    """What _a2a returns in the emulation: wait() orders the compute stream after the transfer."""

    def __init__(self, event):
        self.event = event

    def wait(self):
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)


def _emulated_ulysses(world, seq, heads, dim, chunks, comm, rank=0, upfront=False):
    """The real UlyssesAttention of rank `rank` of an N-way shard (its packing, chunk schedule and
    attention over the full sequence) on one GPU, with every all-to-all replaced by an
    _EmulatedComm of the bytes that rank sends and receives (comm None: no transfer). Receive
    buffers are views of one random-valued pool. upfront: every head is normed before the first chunk is packed
    (the schedule before per-chunk preparation), for an A/B in the same run."""
    from comfy.ldm.minimax_h3.ulysses import UlyssesAttention

    pool = []

    class Emulated(UlyssesAttention):
        def _buffer(self, numel, like):
            # random bf16 values, never zeros or stale memory: attention's speed on an H200 depends on
            # the data (all-zero inputs ran the block ~5% faster in a first run of this emulation)
            if not pool or pool[0].numel() < numel:
                pool[:] = [torch.randn(numel, dtype=like.dtype, device=like.device)]
            return pool[0][:numel]

        def attention(self, qkv, transformer_options, prepare=None):
            if upfront and prepare is not None:
                prepare(0, heads)
                prepare = None
            return super().attention(qkv, transformer_options, prepare=prepare)

        def _a2a(self, recv, send, out_splits, in_splits):
            if comm is None:
                return _EventWork(None)
            me, elem = self.rank, send.element_size()
            return _EventWork(comm.start(recv, (sum(in_splits) - in_splits[me]) * elem, (sum(out_splits) - out_splits[me]) * elem))

    return _ulysses(world, seq, heads, dim, chunks=chunks, rank=rank, cls=Emulated)


def interleaved(fns, rounds=3, warmup=3, iters=10):
    """{name: median over rounds of the per-round median}, the candidates measured round-robin so
    that clock and thermal drift fall on all of them alike."""
    per = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            per[k].append(cuda_time(fn, warmup=warmup, iters=iters, budget_s=1e9)["median_s"])
    return {k: sorted(v)[len(v) // 2] for k, v in per.items()}


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
        comms = {int(bw / 1e9): _EmulatedComm(bw, latency_s) for bw in bandwidths}
        normal = {int(bw / 1e9): _EmulatedComm(bw, latency_s, high_priority=False) for bw in bandwidths} if normal_priority_ab else {}
        for world in (2, 4, 8):
            s = -(-seq // world)
            fns = {}
            if unfused:
                fns["chunks1_no_comm_unfused_adaln"] = block_fn(s, _emulated_ulysses(world, seq, heads, dim, 1, None),
                                                                "chunks1_no_comm_unfused_adaln", fuse=False)
            for chunks in shared_chunks:
                if chunks > heads // world:
                    continue
                fns[f"chunks{chunks}_no_comm_shared_adaln"] = block_fn(
                    s, _emulated_ulysses(world, seq, heads, dim, chunks, None), f"chunks{chunks}_no_comm_shared_adaln", share=world)
                if graphs:
                    fns[f"chunks{chunks}_no_comm_shared_adaln_graph"] = block_fn(
                        s, _emulated_ulysses(world, seq, heads, dim, chunks, None), f"chunks{chunks}_no_comm_shared_adaln_graph",
                        share=world, graph=True)
                for gbps, comm in comms.items():
                    fns[f"chunks{chunks}_bw{gbps}_shared_adaln"] = block_fn(
                        s, _emulated_ulysses(world, seq, heads, dim, chunks, comm), f"chunks{chunks}_bw{gbps}_shared_adaln",
                        share=world)
                    if upfront_ab:
                        name = f"chunks{chunks}_bw{gbps}_shared_adaln_upfront"
                        fns[name] = block_fn(s, _emulated_ulysses(world, seq, heads, dim, chunks, comm, upfront=True), name, share=world)
                    if normal_priority_ab:
                        name = f"chunks{chunks}_bw{gbps}_shared_adaln_normal_priority"
                        fns[name] = block_fn(s, _emulated_ulysses(world, seq, heads, dim, chunks, normal[gbps]), name, share=world)
                    if last_rank:  # the last rank: floor(S/N) rows, no text rows (one modulation segment)
                        name = f"chunks{chunks}_bw{gbps}_shared_adaln_last_rank"
                        fns[name] = block_fn(seq // world, _emulated_ulysses(world, seq, heads, dim, chunks, comm, rank=world - 1),
                                             name, share=world, text=False)
            for chunks in chunk_list:
                if chunks > heads // world:
                    continue
                fns[f"chunks{chunks}_no_comm"] = block_fn(s, _emulated_ulysses(world, seq, heads, dim, chunks, None),
                                                           f"chunks{chunks}_no_comm")
                for gbps, comm in comms.items():
                    fns[f"chunks{chunks}_bw{gbps}"] = block_fn(s, _emulated_ulysses(world, seq, heads, dim, chunks, comm),
                                                               f"chunks{chunks}_bw{gbps}")
            times = interleaved(fns, rounds=rounds, warmup=2, iters=6)
            w_rows = {"rows_per_rank": s, "a2a_bytes_per_block": bytes_per_block(_ulysses(world, seq, heads, dim)),
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


def kernel_spans(fn, n=1):
    """(start_us, end_us, name) of every kernel, copy and memset that n calls of fn run on the GPU,
    in start order (torch profiler)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    return sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events() if e.device_type == DeviceType.CUDA)


def gpu_kernel_s(fn, n=10):
    """Seconds of GPU kernel time one call of fn launches (profiler kernel durations; no launch gaps)."""
    fn(), fn()
    return sum(b - a for a, b, _ in kernel_spans(fn, n)) / n / 1e6


def capture(fn):
    """fn captured as a CUDA graph, after two warm-up calls on a side stream (as torch.cuda.graph asks)."""
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(), fn()
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        fn()
    return graph


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
    cudnn_first = kernels.SDPA_PRIORITY
    flash_first = [kernels.SDPBackend.FLASH_ATTENTION] + [b for b in cudnn_first if b != kernels.SDPBackend.FLASH_ATTENTION]
    with torch.no_grad():
        shift, scale, gate = (t[:2] for t in block.adaln_proj(t_emb)[:3])
        for res in res_list:
            seq = tokens(res)
            per_world = {}
            for world in worlds:
                s = -(-seq // world)
                sp = _ulysses(world, seq, heads, dim, chunks=chunks) if world > 1 else None
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
                       "swiglu_fc2": (lambda: kernels.swiglu_linear(mlp.fc2, fc1_out), 1)}
                if sp is not None:
                    qkv4 = qkv.view(s, 3, heads, dim)
                    ops["pack"] = (lambda: sp.pack_heads(qkv4), 1)
                    pieces = [a[:, :sp.chunk_sizes[c][j] * dim].contiguous() for j in range(world) for c in range(sp.chunks)]
                    ops["unpack_cat"] = (lambda: torch.cat(pieces, dim=1), 1)
                r = {"rows": s, "heads": h_r, "ops": {}}
                for name, (fn, count) in ops.items():
                    r["ops"][name] = {"s": gpu_kernel_s(fn), "count": count}
                kernels.SDPA_PRIORITY = flash_first
                r["attention_flash_first_s"] = gpu_kernel_s(attention)
                kernels.SDPA_PRIORITY = cudnn_first
                r["gate_residual_clone_s"] = gpu_kernel_s(lambda: x.clone())  # the clone inside the gate_residual timing
                r["ops"]["gate_residual"]["s"] -= r["gate_residual_clone_s"]
                emu = _emulated_ulysses(world, seq, heads, dim, chunks, None) if world > 1 else None
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
            sp = _emulated_ulysses(world, seq, heads, dim, 2, None) if world > 1 else None
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


def section_timeline(res, ours, out, worlds=(2, 8), chunks=2, bandwidth=360e9, latency_s=20e-6):
    """Kernel timeline of one rank block (the second of three back to back, profiler) with emulated
    transfers: per-chunk q/k preparation vs up front, transfers on a high- vs normal-priority stream.
    Shows where the first chunk's transfer starts and how long attention waits for it."""
    from comfy.ldm.minimax_h3.embedding import rope_rotation_table
    block, seq = ours.blocks[0], tokens(res)
    t_emb = torch.randn(2, 2688, device="cuda", dtype=torch.bfloat16)
    comms = {"high": _EmulatedComm(bandwidth, latency_s), "normal": _EmulatedComm(bandwidth, latency_s, high_priority=False)}
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
                sp = _emulated_ulysses(world, seq, 56, 128, chunks, comm, upfront=upfront)

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
        packer = _ulysses(world, seq, heads, dim)
        res[f"qkv_pack_cat_N{world}_s"] = cuda_time(lambda: torch.cat([x[:, :, a:b].reshape(-1) for a, b in bounds]), 3, 10)["median_s"]
        res[f"qkv_pack_one_copy_N{world}_s"] = cuda_time(lambda: packer.pack_heads(x), 3, 10)["median_s"]
        send = torch.empty(x.numel(), dtype=x.dtype, device="cuda")  # the same copy on bf16 elements, not 8-byte words
        res[f"qkv_pack_one_copy_bf16_elements_N{world}_s"] = cuda_time(lambda: packer._pack_into(send, x), 3, 10)["median_s"]
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
    ap.add_argument("--sections", default="native,accuracy,overlap,budget,gaps,fusions,kernels,profile")
    ap.add_argument("--resolutions", default=",".join(RESOLUTIONS))
    ap.add_argument("--layers", type=int, default=None, help="fewer blocks for a quick check")
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
        section_native(res_list, theirs, ours, out, save)
        save()
    if "profile" in sections:
        section_profile(res_list[0], theirs, ours, out)
        save()
    if "accuracy" in sections:
        section_accuracy(ours, out)
        save()
    if "overlap" in sections:
        ints = lambda v: tuple(int(c) for c in v.split(",") if c)  # noqa: E731
        section_overlap(res_list, ours, out, save, bandwidths=tuple(b * 1e9 for b in ints(args.bandwidths)),
                        chunk_list=ints(args.chunks), rounds=args.rounds, shared_chunks=ints(args.shared_chunks),
                        unfused=not args.no_unfused, repeat=args.repeat, graphs=args.graphs,
                        upfront_ab=args.upfront_ab, last_rank=args.last_rank,
                        normal_priority_ab=args.normal_priority_ab)
        save()
    if "graph_profile" in sections:
        section_graph_profile(ours, out)
        save()
    if "timeline" in sections:
        section_timeline(res_list[0], ours, out)
        save()
    if "attention_ab" in sections:
        section_attention_ab(out)
        save()
    if "gaps" in sections:
        section_gaps(res_list, ours, out, save)
        save()
    if "budget" in sections:
        section_budget(res_list, ours, out, save)
        save()
    if "fusions" in sections:
        section_fusions(out)
        save()
    if "kernels" in sections:
        section_kernels(out)
        save()


if __name__ == "__main__":
    main()
