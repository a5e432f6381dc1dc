"""The shipped sequence-parallel path for real on ONE GPU: N ranks of a comfy.parallel group, every one on
cuda:0, move H3's real exchanges through the shared-memory transport (device -> pinned host -> device),
as between N GPUs. The ranks share the GPU's compute, so step times here are no speed-up; what this
measures is (1) sharded vs native output at H3's real width on CUDA, bf16 and fp8 exchange, and (2)
the transport itself: bandwidth per rank for large all-to-alls and the cost of one round.

  cd <patched tree> && python /path/bench/h3_h200_shared_gpu.py --out shared_gpu.json
"""

import argparse
import json
import os
import platform
import sys
import time

import torch

sys.path[:0] = [os.getcwd(), os.path.dirname(os.path.abspath(__file__))]  # the tree (cwd), this folder
from comfy.parallel import ParallelGroup, register_op  # noqa: E402

if not torch.cuda.is_available():  # a smoke run on the CPU
    from comfy.cli_args import args
    args.cpu = True
from h3_sp_emulation import build, inputs, save  # noqa: E402

OP_PARITY = "bench.h3_parity"
OP_LINK = "bench.link"


@register_op(OP_PARITY)
def parity(ctx, meta):
    """Every rank builds the same seeded model; rank 0 runs it natively too -> max rel diff per exchange."""
    from comfy.ldm.minimax_h3.ulysses import UlyssesParallel
    model = build(meta["layers"], ctx.device)
    args, tokens = inputs(meta["case"], model, ctx.device)
    native = model._forward(*args, {}) if ctx.rank == 0 else None
    out = {"tokens": tokens}
    for exchange in ("bf16", "fp8"):
        sp = UlyssesParallel(ctx.rank, ctx.world_size, model.blocks[0].attn.heads, ctx.transport, chunks=meta["chunks"],
                             fp8=exchange == "fp8")
        sync(ctx.device)
        t0 = time.perf_counter()
        sharded = model._forward(*args, {"minimax_h3_sequence_parallel": sp})
        sync(ctx.device)
        if ctx.rank == 0:
            out[exchange] = {"rel_diff": max(float((s.float() - n.float()).abs().max() / n.float().abs().max()) for s, n in zip(sharded, native)),
                             "bit_identical": all(torch.equal(s, n) for s, n in zip(sharded, native)),
                             "forward_s_shared_gpu": time.perf_counter() - t0}
    return out if ctx.rank == 0 else {}


@register_op(OP_LINK)
def link(ctx, meta):
    """Times all_to_alls of ``meta['mb']`` MB per peer pair (device buffers) -> seconds per call."""
    n, mb = ctx.world_size, meta["mb"]
    size = int(mb * 1e6) // 4 * 4
    sends = [torch.ones(size // 2, dtype=torch.bfloat16, device=ctx.device) for _ in range(n)]
    recvs = [torch.empty(size // 2, dtype=torch.bfloat16, device=ctx.device) for _ in range(n)]
    sizes = [[size] * n for _ in range(n)]
    for _ in range(2):
        ctx.transport.all_to_all(sends, recvs, sizes).wait()
    sync(ctx.device)
    t0 = time.perf_counter()
    for _ in range(meta["repeats"]):
        ctx.transport.all_to_all(sends, recvs, sizes).wait()
    sync(ctx.device)
    seconds = (time.perf_counter() - t0) / meta["repeats"]
    return {"s": seconds, "rounds": -(-size // ctx.transport.lane)}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--case", default="38k")
    ap.add_argument("--device", default="cuda:0", help="every rank's device (cpu with H3SP_BENCH_TINY=1 --case tiny: a smoke run)")
    a = ap.parse_args()
    result = {"what": __doc__.split("\n\n")[0], "gpu": torch.cuda.get_device_name() if a.device != "cpu" else "cpu", "torch": torch.__version__,
              "machine": platform.node(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "runs": []}
    for n in map(int, a.ranks.split(",")):
        with ParallelGroup(f"bench-{n}") as group:
            group.start([a.device] * n, ["h3_h200_shared_gpu"])
            links = []
            for mb in (0.001, 0.1, 4, 64, 256):
                r = group.run(OP_LINK, {"mb": mb, "repeats": 20 if mb < 64 else 5}).values
                s = max(v["s"] for v in r)
                links.append({"mb_per_pair": mb, "s_per_call": s, "rounds": r[0]["rounds"],
                              "gb_per_s_per_rank_each_way": mb * (n - 1) / 1e3 / s})
                print(json.dumps({"ranks": n, **links[-1]}), flush=True)
            parity_out = group.run(OP_PARITY, {"layers": a.layers, "case": a.case, "chunks": 2}, timeout=1200).values[0]
            print(json.dumps({"ranks": n, **parity_out}), flush=True)
            result["runs"].append({"ranks": n, "link": links, "parity": parity_out, "startup_s": group.startup_seconds})
        save(a.out, result)
    save(a.out, result, finished=True)


if __name__ == "__main__":
    main()
