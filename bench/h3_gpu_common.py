"""What the bench/h3_*.py GPU scripts share: H3 at real size (upstream's and ours on one set of
random bf16 weights), step inputs, CUDA timing and profiler helpers, the real UlyssesAttention of
one rank with its all-to-alls emulated on a side stream, and the command line every script runs.
Needs a CUDA GPU and COMFYUI_DIR (a checkout of the pinned base: upstream's model comes from there).
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


def cudnn_first_priority():
    """ComfyUI's SDPA backend order with cuDNN first: what patch 0005 makes the default on Hopper and newer.

    Sets ``comfy.ops.SDPA_BACKEND_PRIORITY`` (read on every attention call) and returns it.
    """
    import comfy.ops
    from torch.nn.attention import SDPBackend
    order = [SDPBackend.CUDNN_ATTENTION] + [b for b in comfy.ops.SDPA_BACKEND_PRIORITY if b != SDPBackend.CUDNN_ATTENTION]
    comfy.ops.SDPA_BACKEND_PRIORITY = order
    return order


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


def rank_ulysses(world, seq, heads, dim, chunks=1, rank=0, cls=None):
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


class EmulatedComm:
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
        """n bytes of random bf16 values (what arrives is data, not zeros: see emulated_ulysses)."""
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


def emulated_ulysses(world, seq, heads, dim, chunks, comm, rank=0, upfront=False):
    """The real UlyssesAttention of rank `rank` of an N-way shard (its packing, chunk schedule and
    attention over the full sequence) on one GPU, with every all-to-all replaced by an
    EmulatedComm of the bytes that rank sends and receives (comm None: no transfer). Receive
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

    return rank_ulysses(world, seq, heads, dim, chunks=chunks, rank=rank, cls=Emulated)


def interleaved(fns, rounds=3, warmup=3, iters=10):
    """{name: median over rounds of the per-round median}, the candidates measured round-robin so
    that clock and thermal drift fall on all of them alike."""
    per = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            per[k].append(cuda_time(fn, warmup=warmup, iters=iters, budget_s=1e9)["median_s"])
    return {k: sorted(v)[len(v) // 2] for k, v in per.items()}


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


def pack_heads(ulysses, qkv, words=True):
    """[s_r, 3, H, D] -> the flat send buffer of every chunk, chunk-major then rank-major, packed as
    UlyssesAttention packs each chunk for its all-to-all; words=False: the same copy on the tensor's
    own elements instead of 8-byte words (the A/B of the kernels section)."""
    from comfy.ldm.minimax_h3 import ulysses as ulysses_module
    send = torch.empty(qkv.numel(), dtype=qkv.dtype, device=qkv.device)
    offsets = ulysses._send_offsets(qkv.shape[0])
    saved = ulysses_module._words
    if not words:
        ulysses_module._words = lambda t: t
    try:
        for c in range(ulysses.chunks):
            ulysses._pack_chunk(send[offsets[c]:offsets[c + 1]], qkv, c)
    finally:
        ulysses_module._words = saved
    return send


class Run:
    """What a section gets: the arguments, the result dict `out`, save(), and the two models, built
    on first use (sections that time kernels alone never build them)."""

    def __init__(self, args, command):
        import comfy_kitchen
        self.args, self.resolutions, self._models = args, args.resolutions.split(","), None
        self.out = {"machine": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
                                "comfy_kitchen": getattr(comfy_kitchen, "__version__", "?"), "python": platform.python_version(),
                                "command": command},
                    "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    def _build(self):
        if self._models is None:
            theirs, ours, info = build_models(self.args)
            self.out["model"] = info
            print(f"model: {info}", flush=True)
            self.save()
            self._models = theirs, ours
        return self._models

    @property
    def theirs(self):
        return self._build()[0]

    @property
    def ours(self):
        return self._build()[1]

    def save(self):
        os.makedirs(os.path.dirname(os.path.abspath(self.args.out)), exist_ok=True)
        with open(self.args.out, "w") as f:
            json.dump(self.out, f, indent=1)


def main(doc, sections, add_arguments=None, argv=None):
    """The command line of one script: `sections` is {name: fn(run)}, run in that order; the JSON at
    --out is rewritten after every section, so a timeout still leaves what was measured."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the JSON file to write")
    ap.add_argument("--sections", default=",".join(sections), help=f"comma-separated, of: {', '.join(sections)} (default: all)")
    ap.add_argument("--resolutions", default=",".join(RESOLUTIONS), help=f"comma-separated, of: {', '.join(RESOLUTIONS)}")
    ap.add_argument("--layers", type=int, default=None, help="fewer blocks for a quick check (block-level sections use "
                                                            "blocks[0] only: --layers 2 measures them at full size)")
    if add_arguments is not None:
        add_arguments(ap)
    args = ap.parse_args(argv)
    chosen = [s for s in args.sections.split(",") if s]
    unknown = [s for s in chosen if s not in sections] + [r for r in args.resolutions.split(",") if r not in RESOLUTIONS]
    if unknown:
        ap.error(f"unknown section or resolution {', '.join(unknown)}: choose from the lists in --help")
    comfy_dir = os.environ.get("COMFYUI_DIR")
    if not comfy_dir:
        sys.exit("set COMFYUI_DIR to a checkout of the pinned ComfyUI base")
    if not torch.cuda.is_available():
        sys.exit(f"{ap.prog} measures on a CUDA GPU and this torch ({torch.__version__}) sees none")
    sys.path.append(comfy_dir)
    run = Run(args, " ".join(sys.argv))
    run.save()
    for name, fn in sections.items():
        if name in chosen:
            fn(run)
            run.save()
