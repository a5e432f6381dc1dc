"""Could core's in-process MultiGPU facility (comfy/multigpu.py: one Python thread per GPU, one model
replica each, all in one process under the GIL) drive H3 Ulysses sequence parallelism instead of
worker processes? Measured on ONE GPU, on the host side.

Every rank runs upstream's own DiTBlock (comfy/ldm/minimax/model.py of COMFYUI_DIR, random bf16
weights at real size) on its S/N rows, through DiTBlock.forward's `attention=` seam: a rank's
attention projects q|k|v on its rows, norms and ropes them (comfy_kitchen, as upstream), then
exchanges heads for rows with every other rank (a stand-in for all_to_all_single: one device copy
per peer straight into that peer's receive buffer, then a CUDA event that the peer's stream waits
on after a host barrier, as threads driving N GPUs with P2P copies would do), runs attention over
all S rows on its 56/N heads, and exchanges the outputs back the same way before out_proj.

Sections (all per resolution, 50 blocks = one step):
  processes  N processes (N = 2, 4, 8) each driving one rank's share; the exchange is the same
             copies into buffers of its own (no peers: NCCL would move the bytes without the host)
  native     one thread driving the whole native step: GPU time per step and host time per block
  threads    one thread driving one rank alone (no GIL contention), then N threads driving the N
             ranks together: host time to enqueue one rank-step, and the wall time of a free-running
             step on the shared GPU (GPU idle = that minus the same step replayed from CUDA graphs);
             --round-robin: also one thread driving all N ranks in turn (no GIL hand-off: the floor
             for any design where one Python process drives every GPU); --switch-intervals: the N threads
             again at other GIL switch intervals
  graphs     each rank's step captured as CUDA graphs cut at every exchange (2 per block), replayed
             by N threads with the host barriers and events between the graphs (and round robin)

Host time is measured block by block: all drivers start a block together, each enqueues it (the
GPU is idle when they start, so no launch waits on it), and the GPU is synchronized before the next
block, outside the timed span. On one GPU the N ranks share it, so only host times are measured for
N GPUs; whether threads keep N GPUs fed is read off against the bar of one GPU's share of a step,
native step time / N (measured): a projection, not an N-GPU measurement.

  COMFYUI_DIR=/path/to/comfyui-h3-newest python bench/h3_inprocess.py --out bench/results/h3_h200_inprocess.json
"""

import argparse
import json
import os
import platform
import sys
import threading
import time
from types import SimpleNamespace

import torch

from h3_sp_emulation import init_random_

RESOLUTIONS = {"832x480x124": (480, 832, 124), "1344x768x124": (768, 1344, 124)}
TEXT_LEN = 512

HEADS, HEAD_DIM, HIDDEN, FFN, T_DIM = 56, 128, 5376, 14336, 2688
WORLDS = (2, 4, 8)
PROCESS_BLOCKS = 2  # distinct blocks each process holds (cycled over the step: launch cost does not depend on the weights)


def latent_shapes(height, width, frames):
    """EmptyMiniMaxH3LatentAV's shapes: 17k+5 frame grid, 16x spatial, 5-frame temporal grouping, 40 Hz audio."""
    latent_t = 2 if frames <= 5 else ((frames - 5) // 17) * 5 + 2
    return (1, 24, latent_t, height // 16, width // 16), (1, 32, 2, round(frames / 24 * 40))


def comfy_modules(comfy_dir):
    """Upstream's H3 model module (and the kitchen) from COMFYUI_DIR, ahead of anything else named comfy."""
    sys.path.insert(0, comfy_dir)
    import comfy.ldm.minimax.model as upstream
    import comfy.model_management  # noqa: F401  (ComfyUI's device set-up, as in a server)
    import comfy.ops
    import comfy.quant_ops
    from comfy.ldm.modules.attention import AttentionTensorContainer, optimized_attention
    return SimpleNamespace(upstream=upstream, ops=comfy.ops.disable_weight_init, ck=comfy.quant_ops.ck,
                           cast_to=comfy.model_management.cast_to, Container=AttentionTensorContainer,
                           attention=optimized_attention)


def balanced_ranges(total, parts):
    base, extra = divmod(total, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def clip_segments(segments, start, stop):
    """Modulation segments (a, b, row) of the packed sequence, clipped to rows [start, stop) and rebased."""
    return [(max(a, start) - start, min(b, stop) - start, row) for a, b, row in segments if a < stop and b > start]


def step_inputs(c, res, model=None):
    """What the block loop of one step sees: the packed rows h, t_emb, the modulation segments and the
    rope table, built as MiniMaxH3Model._forward builds them (t2va, sigma 0.4; the embedding itself is
    replaced by random rows). model None: the rope table from random angles (the processes)."""
    h_, w_, f_ = RESOLUTIONS[res]
    vs, as_ = latent_shapes(h_, w_, f_)
    layout = c.upstream.PackedLayout(TEXT_LEN, vs[2], vs[3], vs[4], as_[-1])
    t_v = 0.6
    t_a = float(1.0 - c.upstream.time_shift_sigma(torch.tensor(0.4), 12.0, 3.0))
    t_row = {t: i for i, t in enumerate(sorted({t_v, t_a}))}
    seg_t = {"text": (t_v, 1), "video": (t_v, 0), "audio": (t_a, 2)}
    segments = [(a, b, t_row[seg_t[kind][0]] * 3 + seg_t[kind][1]) for a, b, kind in layout.segments]
    g = torch.Generator("cuda").manual_seed(1)
    seq = layout.seq_len
    h = torch.randn(seq, HIDDEN, generator=g, device="cuda").to(torch.bfloat16)
    t_emb = torch.randn(len(t_row), T_DIM, generator=g, device="cuda").to(torch.bfloat16)
    if model is not None:
        angles = model.rope_freqs(layout.position_ids, "cuda")
    else:
        angles = torch.rand(seq, 96, generator=g, device="cuda") * 100
    rope = c.upstream.rope_rotation_table(angles, torch.bfloat16)
    return SimpleNamespace(seq=seq, h=h, t_emb=t_emb, segments=segments, rope=rope)


class Exchange:
    """The two all-to-alls of one block between the N ranks of one world on one GPU, as threads
    driving N GPUs would do them with P2P copies: rank r copies what rank j needs straight into rank
    j's receive buffer (one copy launch per peer, itself included), records an event, waits at a host
    barrier until every rank has recorded its own, then makes its stream wait on all of them.

    barrier None: one driver alone (a process, or one thread without peers): the same copies into
    buffers of its own, ordered on its stream, no barrier; NCCL would move the bytes off the host.
    capture: {rank: Segments} while ranks are captured as CUDA graphs: an exchange cuts the graph.
    Two event sets (in, out) suffice: a rank re-records an event only after the barrier that follows
    every peer's wait on it."""

    def __init__(self, world, seq, barrier):
        self.world, self.rows, self.heads = world, balanced_ranges(seq, world), balanced_ranges(HEADS, world)
        self.barrier, self.capture = barrier, None
        self.recv_in = [torch.randn(3, b - a, seq, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for a, b in self.heads]
        self.recv_out = [torch.randn(b - a, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for a, b in self.rows]
        self.events = {"in": [torch.cuda.Event() for _ in range(world)], "out": [torch.cuda.Event() for _ in range(world)]}

    def send_in(self, rank, qkv):
        """qkv [s_r, 3, H, D] of rank's rows -> every rank j's recv_in[j][:, :, rank's rows] (j's heads)."""
        a, b = self.rows[rank]
        for j, (h0, h1) in enumerate(self.heads):
            self.recv_in[j][:, :, a:b].copy_(qkv[:, :, h0:h1].permute(1, 2, 0, 3))

    def send_out(self, rank, out):
        """out [S, H_r * D] (all rows, rank's heads) -> every rank j's recv_out[j][:, rank's heads]."""
        h0, h1 = self.heads[rank]
        for j, (a, b) in enumerate(self.rows):
            self.recv_out[j][:, h0:h1].copy_(out[a:b].view(b - a, h1 - h0, HEAD_DIM))

    def sync(self, rank, which):
        """A thread's side of exchange `which` ("in" or "out"), after its copies were enqueued."""
        if self.capture is not None:
            self.capture[rank].cut()
            return
        self.events[which][rank].record()
        if self.barrier is not None:
            self.barrier.wait()
            self.wait(rank, which)

    def wait(self, rank, which):
        """rank's stream (the current one) waits for every peer's copies of exchange `which`."""
        stream = torch.cuda.current_stream()
        for j, e in enumerate(self.events[which]):
            if j != rank:
                stream.wait_event(e)


def drive_round_robin(ex, streams, gens):
    """One thread driving every rank: advances each rank's generator (one per rank, yielding at every
    exchange after its copies) to the next exchange in turn, records the ranks' events, then resumes
    each rank after its stream waits on its peers' events. No barrier, no GIL hand-off."""
    points = [None] * len(gens)
    for r, g in enumerate(gens):
        with torch.cuda.stream(streams[r]):
            points[r] = next(g, None)
    while points[0] is not None:
        for r in range(len(gens)):
            with torch.cuda.stream(streams[r]):
                ex.events[points[r]][r].record()
        for r, g in enumerate(gens):
            with torch.cuda.stream(streams[r]):
                ex.wait(r, points[r])
                points[r] = next(g, None)


class RankAttention:
    """DiTBlock.forward's `attention=` for rank `rank`: upstream Attention.forward's q|k|v projection
    and fused norm + rope on the local rows, heads exchanged for rows, attention over all S rows on
    this rank's heads (ComfyUI's optimized_attention, as upstream calls it), outputs exchanged back,
    out_proj on the local rows."""

    def __init__(self, c, ex, rank):
        self.c, self.ex, self.rank = c, ex, rank

    def __call__(self, attn, x, rope_freqs=None, transformer_options={}):
        steps = self.steps(attn, x, rope_freqs, transformer_options)
        while True:
            try:
                which = next(steps)
            except StopIteration as done:
                return done.value
            self.ex.sync(self.rank, which)

    def steps(self, attn, x, rope_freqs, transformer_options):
        """The same as a generator that yields "in" / "out" after this rank's copies of each exchange."""
        c, ex, r = self.c, self.ex, self.rank
        s, hd = x.shape[0], attn.heads * attn.head_dim
        qkv = attn.qkv_proj(x)
        q, k, _ = qkv.split(hd, dim=-1)
        q, k = q.view(1, s, attn.heads, attn.head_dim), k.view(1, s, attn.heads, attn.head_dim)
        qw = c.cast_to(attn.q_norm.weight, device=x.device)
        kw = c.cast_to(attn.k_norm.weight, device=x.device)
        c.ck.rms_rope_split_half_(q, k, rope_freqs, qw, kw, epsilon=attn.q_norm.eps, rot_dim=rope_freqs.shape[-3] * 2)
        ex.send_in(r, qkv.view(s, 3, attn.heads, attn.head_dim))
        yield "in"
        h0, h1 = ex.heads[r]
        q, k, v = (c.Container(t.unsqueeze(0)) for t in ex.recv_in[r].unbind(0))
        out = c.attention(q, k, v, h1 - h0, preferred_attention=attn.comfy_attention, mask=None, skip_reshape=True,
                          transformer_options=transformer_options)
        ex.send_out(r, out[0])
        yield "out"
        return attn.out_proj(ex.recv_out[r].view(s, hd))


class Rank:
    """One rank's share of a step: its rows of h, clipped segments and rope rows, and one block call."""

    def __init__(self, c, ex, rank, inp, blocks):
        a, b = ex.rows[rank]
        self.ex, self.rank, self.blocks = ex, rank, blocks
        self.h = inp.h[a:b].clone()
        self.t_emb, self.segments, self.rope = inp.t_emb, clip_segments(inp.segments, a, b), inp.rope[:, a:b]
        self.upstream = c.upstream
        self.attention = attention = RankAttention(c, ex, rank)
        self.attn = [lambda x, rope_freqs=None, transformer_options={}, blk=blk: attention(blk.attn, x, rope_freqs, transformer_options)
                     for blk in blocks]

    def block(self, i):
        j = i % len(self.blocks)
        self.h = self.blocks[j](self.h, self.t_emb, self.segments, self.rope, transformer_options={}, attention=self.attn[j])

    def block_steps(self, i):
        """Block i as a generator yielding at each exchange, for drive_round_robin: upstream
        DiTBlock.forward's five lines (with its own helpers), the attention being this rank's steps."""
        up, blk, segs, x = self.upstream, self.blocks[i % len(self.blocks)], self.segments, self.h
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = blk.adaln_proj(self.t_emb)
        h = up._mod_scale_shift(blk.norm1(x), shift_msa, scale_msa, segs)
        x = up._mod_gate(x, gate_msa, (yield from self.attention.steps(blk.attn, h, self.rope, {})), segs)
        h = up._mod_scale_shift(blk.norm2(x), shift_mlp, scale_mlp, segs)
        self.h = up._mod_gate(x, gate_mlp, blk.mlp(h), segs)


class Segments:
    """One rank's step as CUDA graphs, cut at every exchange (2 per block, 2 * blocks + 1 graphs),
    all in one memory pool: they are replayed in capture order."""

    def __init__(self):
        self.pool, self.graphs = torch.cuda.graph_pool_handle(), []

    def begin(self):
        self.graphs.append(torch.cuda.CUDAGraph())
        self.graphs[-1].capture_begin(pool=self.pool)

    def cut(self):
        self.graphs[-1].capture_end()
        self.begin()


def median(v):
    v = sorted(v)
    return v[len(v) // 2] if v else None


def run_threads(n, fn):
    """fn(rank) in n threads (each under inference_mode, which is thread-local); re-raises the first error."""
    errors, barriers = [], [b for b in getattr(fn, "barriers", ())]

    def body(r):
        try:
            with torch.inference_mode():
                fn(r)
        except BaseException as e:  # a failed rank must not leave the others at a barrier
            errors.append(e)
            for b in barriers:
                b.abort()
    threads = [threading.Thread(target=body, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def host_per_block(n, enqueue, blocks):
    """Host time to enqueue `blocks` blocks, block by block: the n drivers (threads) start each block at a
    barrier with the GPU idle, and the GPU is synchronized after it (outside the timed span).
    enqueue(rank, i) enqueues rank's block i. -> per-rank sums and the sum of per-block group spans."""
    start, done = threading.Barrier(n), threading.Barrier(n)
    spans = [[None] * blocks for _ in range(n)]
    cpu = [0.0] * n

    def fn(r):
        for i in range(blocks):
            start.wait()
            t0, c0 = time.perf_counter(), time.thread_time()
            enqueue(r, i)
            spans[r][i] = (t0, time.perf_counter())
            cpu[r] += time.thread_time() - c0
            done.wait()
            if r == 0:
                torch.cuda.synchronize()
    fn.barriers = (start, done) + getattr(enqueue, "barriers", ())
    run_threads(n, fn)
    group = sum(max(spans[r][i][1] for r in range(n)) - min(spans[r][i][0] for r in range(n)) for i in range(blocks))
    per_rank = [sum(b - a for a, b in s) for s in spans]
    per_block = [max(spans[r][i][1] for r in range(n)) - min(spans[r][i][0] for r in range(n)) for i in range(blocks)]
    return {"group_s": group, "per_rank_s": per_rank, "per_rank_median_s": median(per_rank), "blocks": blocks,
            "per_rank_cpu_s": cpu,
            "group_per_block_s": [round(v, 6) for v in per_block]}


def free_step(n, enqueue, blocks, reps=1):
    """Wall time of `blocks` blocks enqueued by n threads with no synchronization until the end (the GPU
    shared by all ranks), median of reps; and when the last driver finished enqueuing."""
    walls, enq = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        go = threading.Barrier(n)
        starts, ends = [None] * n, [None] * n

        def fn(r):
            go.wait()
            starts[r] = time.perf_counter()
            for i in range(blocks):
                enqueue(r, i)
            ends[r] = time.perf_counter()
        fn.barriers = (go,) + getattr(enqueue, "barriers", ())
        run_threads(n, fn)
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - min(starts))
        enq.append(max(ends) - min(starts))
    return {"wall_s": median(walls), "enqueue_s": median(enq), "reps": reps}


def rel_diff(a, b):
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


# ---------------------------------------------------------------------------------------------- processes

def _process_rank(slot, comfy_dir, tasks, results, barriers):
    """A spawned process: one rank's driver, holding PROCESS_BLOCKS real-size blocks of its own."""
    try:
        c = comfy_modules(comfy_dir)
        blocks = [c.upstream.DiTBlock(HIDDEN, HEADS, HEAD_DIM, FFN, T_DIM, 1e-5, 1e-5, dtype=torch.bfloat16,
                                      device="cuda", operations=c.ops).requires_grad_(False) for _ in range(PROCESS_BLOCKS)]
        for b in blocks:
            init_random_(b, seed=slot)
        results.put((slot, "ready", None))
        while True:
            task = tasks.get()
            if task is None:
                return
            res, world, n_blocks = task
            with torch.inference_mode():
                inp = step_inputs(c, res)
                stream = torch.cuda.Stream()
                with torch.cuda.stream(stream):
                    ex = Exchange(world, inp.seq, None)
                    rank = Rank(c, ex, slot, inp, blocks)
                    for i in range(2):
                        rank.block(i)
                    torch.cuda.synchronize()
                    times = []
                    for i in range(n_blocks):
                        barriers[world].wait()
                        t0 = time.perf_counter()
                        rank.block(i)
                        times.append(time.perf_counter() - t0)
                        torch.cuda.synchronize()
                del rank, ex, inp
                torch.cuda.empty_cache()
            results.put((slot, "done", times))
    except BaseException as e:
        for b in barriers.values():
            b.abort()
        results.put((slot, "error", repr(e)))


def section_processes(args, out, save):
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    n = max(WORLDS)
    barriers = {w: ctx.Barrier(w) for w in WORLDS}
    tasks, results = [ctx.Queue() for _ in range(n)], ctx.Queue()
    procs = [ctx.Process(target=_process_rank, args=(s, args.comfy_dir, tasks[s], results, barriers)) for s in range(n)]
    t0 = time.perf_counter()
    for p in procs:
        p.start()

    def collect(k, kind):
        got = {}
        for _ in range(k):
            slot, status, payload = results.get(timeout=300)
            if status == "error":
                raise RuntimeError(f"process {slot}: {payload}")
            assert status == kind, (slot, status)
            got[slot] = payload
        return got
    rows = out["processes"] = {"note": f"N spawned processes, each rank's driver with {PROCESS_BLOCKS} real-size blocks of its own "
                                       "cycled over the step; each block started together (a process barrier), timed on the "
                                       "host, then that process synchronized; exchange: the same copies into its own buffers",
                               "results": {}}
    try:
        collect(n, "ready")
        rows["start_s"] = time.perf_counter() - t0
        print(f"processes: {n} ready in {rows['start_s']:.1f} s", flush=True)
        for res in args.resolutions:
            for world in WORLDS:
                for s in range(world):
                    tasks[s].put((res, world, args.host_blocks))
                got = collect(world, "done")
                per_rank = [sum(got[s]) for s in range(world)]
                rows["results"].setdefault(res, {})[str(world)] = {"per_rank_s": per_rank, "per_rank_median_s": median(per_rank),
                                                                   "blocks": args.host_blocks}
                print(f"processes {res} N={world}: host per rank-step {median(per_rank) * 1e3:.1f} ms "
                      f"(max {max(per_rank) * 1e3:.1f})", flush=True)
                save()
    finally:
        for q in tasks:
            q.put(None)
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()


# --------------------------------------------------------------------------------------- one process

def build_model(c, layers):
    cfg = {} if layers is None else {"num_layers": layers}
    model = c.upstream.MiniMaxH3Model(**cfg, dtype=torch.bfloat16, device="cuda", operations=c.ops).requires_grad_(False)
    init_random_(model)
    return model


def section_native(c, model, res, args, rows):
    """One thread, the whole native step (all rows, 56 heads): GPU time per step and host per block."""
    inp = step_inputs(c, res, model)
    blocks = list(model.blocks)

    def step(h):
        for b in blocks:
            h = b(h, inp.t_emb, inp.segments, inp.rope, transformer_options={})
        return h
    if not args.native_reps:  # the inputs only (the native step measured in another run)
        return inp
    with torch.inference_mode():
        step(inp.h.clone())  # warm-up
        torch.cuda.synchronize()
        times = []
        for _ in range(args.native_reps):
            h = inp.h.clone()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            step(h)
            e1.record()
            torch.cuda.synchronize()
            times.append(e0.elapsed_time(e1) / 1e3)
        host = []
        h = inp.h.clone()
        for b in blocks[:args.host_blocks]:
            t0 = time.perf_counter()
            h = b(h, inp.t_emb, inp.segments, inp.rope, transformer_options={})
            host.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
    rows["native"] = {"step_s": median(times), "step_s_all": times, "host_per_step_s": sum(host) * len(blocks) / len(host),
                      "host_blocks": len(host)}
    print(f"native {res}: step {median(times):.3f} s GPU, host {rows['native']['host_per_step_s'] * 1e3:.1f} ms per step", flush=True)
    if args.cudnn_bar and args.native_reps:
        import comfy.ops
        from torch.nn.attention import SDPBackend
        saved = comfy.ops.SDPA_BACKEND_PRIORITY
        comfy.ops.SDPA_BACKEND_PRIORITY = [SDPBackend.CUDNN_ATTENTION] + [b for b in saved if b != SDPBackend.CUDNN_ATTENTION]
        try:
            with torch.inference_mode():
                step(inp.h.clone())
                t = []
                for _ in range(max(1, args.native_reps - 1)):
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    step(inp.h.clone())
                    e1.record()
                    torch.cuda.synchronize()
                    t.append(e0.elapsed_time(e1) / 1e3)
        finally:
            comfy.ops.SDPA_BACKEND_PRIORITY = saved
        rows["native"]["step_s_cudnn_first"] = median(t)
        print(f"native {res} cuDNN-first: step {median(t):.3f} s", flush=True)
    return inp


def section_world(c, model, res, world, inp, args, rows):
    """For one N: one rank driven alone, the N ranks driven by N threads, by one thread in turn
    (round robin), and both again from CUDA-graph segments."""
    blocks = list(model.blocks)
    nb = len(blocks)
    hb = min(args.host_blocks, nb)
    scale = nb / hb  # per step
    streams = [torch.cuda.Stream() for _ in range(world)]
    out = rows.setdefault("worlds", {})[str(world)] = {}

    # one thread driving rank 0 alone: no peers, no barrier, no GIL contention
    solo = Rank(c, Exchange(world, inp.seq, None), 0, inp, blocks)
    with torch.inference_mode(), torch.cuda.stream(streams[0]):
        for i in range(2):
            solo.block(i)
    host = host_per_block(1, lambda r, i: _on(streams[0], solo.block, i), hb)
    out["solo"] = {"host_per_rank_step_s": host["per_rank_s"][0] * scale, "cpu_per_rank_step_s": host["per_rank_cpu_s"][0] * scale}
    if not args.no_free:
        out["solo"]["rank_step_s"] = free_step(1, lambda r, i: _on(streams[0], solo.block, i), nb, reps=args.rank_reps)["wall_s"]
    torch.cuda.synchronize()

    # N ranks and the real exchange (events; a host barrier between threads)
    barrier = threading.Barrier(world)
    ex = Exchange(world, inp.seq, barrier)
    ranks = [Rank(c, ex, r, inp, blocks) for r in range(world)]

    def reset():
        torch.cuda.synchronize()
        for rk in ranks:
            a, b = ex.rows[rk.rank]
            rk.h.copy_(inp.h[a:b])
        torch.cuda.synchronize()

    def rows_out():
        torch.cuda.synchronize()
        return torch.cat([rk.h for rk in ranks])

    enqueue = with_barriers(lambda r, i: _on(streams[r], ranks[r].block, i), barrier)
    run_threads(world, with_barriers(lambda r: [enqueue(r, i) for i in range(2)], barrier))  # warm-up
    if args.check:  # two blocks sharded vs the native two blocks, from the same rows
        with torch.inference_mode():
            ref = inp.h.clone()
            for b in blocks[:2]:
                ref = b(ref, inp.t_emb, inp.segments, inp.rope, transformer_options={})
        reset()
        run_threads(world, with_barriers(lambda r: [enqueue(r, i) for i in range(2)], barrier))
        out["check_rel_diff_vs_native_2_blocks"] = rel_diff(rows_out(), ref)
        out["check_native_update_rel"] = rel_diff(ref, inp.h)  # how far the 2 blocks moved the rows: the check is not vacuous
        out["check_finite"] = bool(torch.isfinite(ref).all())
    reset()
    host = host_per_block(world, enqueue, hb)
    eager_out = rows_out() if args.check and hb == nb else None
    t = out["threads"] = {"host_group_per_step_s": host["group_s"] * scale, "host_per_rank_step_s": host["per_rank_median_s"] * scale,
                          "host_per_rank_step_s_all": [v * scale for v in host["per_rank_s"]],
                          "cpu_per_rank_step_s": median(host["per_rank_cpu_s"]) * scale, "host_group_per_block_s": host["group_per_block_s"]}
    for interval in args.switch_intervals if world in args.switch_worlds else ():  # the GIL's hand-off interval (default 5 ms)
        saved = sys.getswitchinterval()
        sys.setswitchinterval(interval)
        try:
            reset()
            h = host_per_block(world, enqueue, hb)
        finally:
            sys.setswitchinterval(saved)
        t.setdefault("switch_interval", {})[str(interval)] = {"host_group_per_step_s": h["group_s"] * scale,
                                                              "cpu_per_rank_step_s": median(h["per_rank_cpu_s"]) * scale}
    if not args.no_free:
        reset()
        free = free_step(world, enqueue, nb, reps=1)
        t["free_step_wall_s"], t["free_step_enqueue_s"] = free["wall_s"], free["enqueue_s"]
    line = (f"{res} N={world}: solo host {out['solo']['host_per_rank_step_s'] * 1e3:.1f} ms; {world} threads: group host "
            f"{t['host_group_per_step_s'] * 1e3:.1f} ms per step, per rank {t['host_per_rank_step_s'] * 1e3:.1f} ms "
            f"(cpu {t['cpu_per_rank_step_s'] * 1e3:.1f})")
    if args.round_robin:  # one thread driving every rank in turn
        reset()
        rr = host_per_block(1, lambda r, i: drive_round_robin(ex, streams, [rk.block_steps(i) for rk in ranks]), hb)
        out["round_robin"] = {"host_group_per_step_s": rr["group_s"] * scale}
        if eager_out is not None:
            out["round_robin"]["check_rel_diff_vs_threads"] = rel_diff(rows_out(), eager_out)
        line += f"; round robin {rr['group_s'] * scale * 1e3:.1f} ms"
    print(line, flush=True)

    if args.graphs:
        try:
            out["graphs"] = graphs_world(ex, ranks, streams, barrier, reset, rows_out, nb, hb, eager_out, args)
        except Exception as e:  # report, keep the rest
            out["graphs"] = {"error": repr(e)}
            print(f"graphs {res} N={world}: failed: {e!r}", flush=True)
    torch.cuda.synchronize()  # the buffers go with this frame: nothing may still use them


def _on(stream, fn, *a):
    with torch.cuda.stream(stream):
        fn(*a)


def with_barriers(fn, *barriers):
    """fn, marked with the barriers its threads may wait at (run_threads aborts them when a rank fails)."""
    fn.barriers = barriers
    return fn


def graphs_world(ex, ranks, streams, barrier, reset, rows_out, nb, hb, eager_out, args):
    """Each rank's step captured as 2 * nb + 1 CUDA graphs (cut at every exchange; the copies into the
    peers' buffers are inside the graphs), replayed by N threads with the host barrier and the
    cross-stream events between graphs, and by one thread in turn."""
    world = len(ranks)
    caps = {r: Segments() for r in range(world)}
    reset()
    t0 = time.perf_counter()
    ex.capture = caps
    try:
        with torch.inference_mode():
            for r, rk in enumerate(ranks):  # rk.h is the graphs' static input and output
                with torch.cuda.stream(streams[r]):
                    caps[r].begin()
                    for i in range(nb):
                        rk.block(i)
                    caps[r].graphs[-1].capture_end()
    finally:
        ex.capture = None
    capture_s = time.perf_counter() - t0

    def steps(r, i):
        g = caps[r].graphs
        g[2 * i].replay()
        yield "in"
        g[2 * i + 1].replay()
        yield "out"
        if i == nb - 1:
            g[2 * nb].replay()

    def replay_block(r, i):
        with torch.cuda.stream(streams[r]):
            for which in steps(r, i):
                ex.sync(r, which)
    with_barriers(replay_block, barrier)
    reset()
    host = host_per_block(world, replay_block, hb)
    result = {"graphs_per_rank": len(caps[0].graphs), "capture_s": capture_s,
              "host_group_per_step_s": host["group_s"] * nb / hb, "host_per_rank_step_s": host["per_rank_median_s"] * nb / hb,
              "cpu_per_rank_step_s": median(host["per_rank_cpu_s"]) * nb / hb}
    if eager_out is not None:
        result["check_rel_diff_vs_eager_threads"] = rel_diff(rows_out(), eager_out)
    line = f"graphs N={world}: {len(caps[0].graphs)} graphs per rank, {world} threads: group host {result['host_group_per_step_s'] * 1e3:.1f} ms"
    if not args.no_free:
        reset()
        free = free_step(world, replay_block, nb, reps=1)
        result["free_step_wall_s"], result["free_step_enqueue_s"] = free["wall_s"], free["enqueue_s"]
        line += f", free step {free['wall_s']:.3f} s"
    if args.round_robin:
        reset()
        rr = host_per_block(1, lambda r, i: drive_round_robin(ex, streams, [steps(q, i) for q in range(world)]), hb)
        result["round_robin_host_group_per_step_s"] = rr["group_s"] * nb / hb
        if eager_out is not None:
            result["round_robin_check_rel_diff_vs_eager_threads"] = rel_diff(rows_out(), eager_out)
        line += f"; round robin {rr['group_s'] * nb / hb * 1e3:.1f} ms"
    print(line, flush=True)
    return result


METHOD = ("one NVIDIA GPU; upstream DiTBlock (comfy/ldm/minimax/model.py of the h3-newest base) with random bf16 weights at real "
          "size, its attention replaced through DiTBlock.forward's attention= seam by a rank's Ulysses attention (q|k|v projection "
          "and comfy_kitchen norm + rope on S/N rows, heads exchanged for rows, optimized_attention over all S rows on 56/N heads, "
          "outputs exchanged back). EMULATED all-to-alls: one device copy per peer into that peer's buffer, a CUDA event, a host "
          "barrier, cross-stream waits (threads); processes copy into their own buffers (no host exchange). Host time: every driver "
          "starts each block together with the GPU idle, enqueues it, and the GPU is synchronized after the block outside the timed "
          "span; per step = per block sum scaled to 50 blocks when fewer were timed. group = the span from the first driver's "
          "start to the last driver's end of each block, summed: the host time to enqueue one rank-step on every GPU. bar = native "
          "step GPU time / N, one GPU's share of a step: threads keep N GPUs fed while group host time < bar (a projection: the N "
          "ranks share one GPU here). free_step_wall_s: a whole step enqueued by N threads with no synchronization on the one shared "
          "GPU; graphs: each rank's step captured as CUDA graphs cut at every exchange, replayed by the N threads. round_robin: one "
          "thread drives all N ranks in turn (each rank's block a generator that yields at its exchanges; upstream DiTBlock.forward's "
          "five lines with its helpers), no barrier. cpu_*: the threads' CPU time (time.thread_time) over the same spans: far "
          "below the wall time when a thread waits for the GIL.")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--sections", default="processes,native,threads,graphs")
    ap.add_argument("--resolutions", default=",".join(RESOLUTIONS))
    ap.add_argument("--layers", type=int, default=None, help="fewer blocks (a quick check); the default is H3's 50")
    ap.add_argument("--host-blocks", type=int, default=50, help="blocks timed block by block on the host (scaled to the step)")
    ap.add_argument("--native-reps", type=int, default=3)
    ap.add_argument("--rank-reps", type=int, default=2, help="free-running steps of one rank alone (its GPU time)")
    ap.add_argument("--cudnn-bar", action="store_true", help="native: also the step with cuDNN-first attention (a tighter bar)")
    ap.add_argument("--check", action="store_true", help="threads: sharded output vs native (2 blocks); graphs and round "
                                                         "robin vs the threads (the whole step, when --host-blocks is all of it)")
    ap.add_argument("--round-robin", action="store_true", help="threads, graphs: also one thread driving every rank in turn")
    ap.add_argument("--switch-intervals", default="", help="threads: also the N threads at these GIL switch intervals (s)")
    ap.add_argument("--switch-worlds", default="8", help="the N for --switch-intervals")
    ap.add_argument("--no-free", action="store_true", help="skip the free-running steps (the shared GPU's idle time)")
    args = ap.parse_args()
    args.comfy_dir = os.environ.get("COMFYUI_DIR") or sys.exit("set COMFYUI_DIR to the h3-newest ComfyUI tree")
    args.resolutions = args.resolutions.split(",")
    args.switch_intervals = [float(v) for v in args.switch_intervals.split(",") if v]
    args.switch_worlds = [int(v) for v in args.switch_worlds.split(",") if v]
    sections = args.sections.split(",")
    args.graphs = "graphs" in sections
    out = {"machine": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
                       "python": platform.python_version(), "cpus": os.cpu_count(), "gil_switch_interval_s": sys.getswitchinterval(),
                       "command": " ".join(sys.argv)},
           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "method": METHOD, "emulated": True,
           "layers": args.layers or 50, "process_blocks": PROCESS_BLOCKS, "resolutions": {}}

    def save():
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    if "processes" in sections:
        section_processes(args, out, save)
        save()
    c = comfy_modules(args.comfy_dir)
    from importlib.metadata import version
    out["machine"]["comfy_kitchen"] = version("comfy-kitchen")
    out["machine"]["attention"] = c.attention.__name__
    if "native" not in sections and "threads" not in sections:
        return save()
    model = build_model(c, args.layers)
    for res in args.resolutions:
        rows = out["resolutions"].setdefault(res, {})
        inp = section_native(c, model, res, args, rows)
        rows["tokens"] = inp.seq
        save()
        if "threads" in sections:
            for world in WORLDS:
                section_world(c, model, res, world, inp, args, rows)
                torch.cuda.empty_cache()
                save()
        del inp
        torch.cuda.empty_cache()
    out["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    save()


if __name__ == "__main__":
    main()
