"""The shipped sequence-parallel path for real on ONE GPU: N ranks of a comfy.parallel group, every one on
cuda:0, move H3's real exchanges through the shared-memory transport (device -> pinned host -> device),
as between N GPUs. The ranks share the GPU's compute, so step times here are no speed-up; what this
measures is (1) sharded vs native output at H3's real width on CUDA, bf16 and fp8 exchange, (2)
the transport itself: bandwidth per rank for large all-to-alls and the cost of one round, and (3) with
--control, what a Fun ControlNet-Union tower (comfy/ldm/minimax/controlnet.py at its real width, one
tower block per model block) adds to a forward, native and sharded: the shipped ``patched_blocks``
(the model's block sharded, the patch on rank 0 on the gathered rows) and, for comparison, the design
it replaced (the model's block too on rank 0's whole sequence). While rank 0 runs the patch the other
ranks wait, so that cost is rank 0's alone even on a shared GPU.

  cd <patched tree> && python /path/bench/h3_shared_gpu.py --out shared_gpu.json
"""

import argparse
import hashlib
import json
import os
import platform
import statistics
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
OP_CONTROL = "bench.h3_control"


@register_op(OP_PARITY)
def parity(ctx, meta):
    """Every rank builds the same seeded model; rank 0 runs it natively too -> max rel diff per exchange."""
    from comfy.ldm.minimax.ulysses import UlyssesParallel
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
            out[exchange] = {"rel_diff": rel_diff(sharded, native),
                             "sha256": hashlib.sha256(b"".join(t.float().cpu().numpy().tobytes() for t in sharded)).hexdigest(),
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
    lane = ctx.transport.lane if ctx.transport.stream_path is None else ctx.transport.stream_path.lane
    return {"s": seconds, "rounds": -(-size // lane)}


def whole_block_on_rank0(sp, replace, blocks):
    """The design patched_blocks replaced (commit 5f33375): the patch and the model's block on rank 0's whole sequence."""
    def patched(patch):
        def block(args, extra):
            shard = args["shard"]
            img, rope = sp.gather_rows(shard, args["img"]), sp.gather_rows(shard, args["rope_freqs"], dim=1)
            if sp.rank == 0:
                whole = shard.plan.shard()
                img = patch(dict(args, img=img, rope_freqs=rope, mod_segments=whole.mod_segments, shard=whole, attention=None),
                            extra)["img"]
            return {"img": sp.scatter_rows(shard, img, args["img"])}
        return block
    dit = replace.get("dit", {}) if sp.rank == 0 else {("double_block", i): None for i in blocks}
    return dict(replace, dit={key: patched(patch) for key, patch in dit.items()})


@register_op(OP_CONTROL)
def control(ctx, meta):
    """Forward seconds (median of ``repeats``) with and without a Fun ControlNet tower, native (rank 0 alone) and
    sharded, and the sharded-vs-native difference with the tower."""
    import comfy.ops
    from comfy.ldm.minimax.controlnet import MiniMaxH3FunControl
    from comfy.ldm.minimax.sequence_parallel import patched_blocks
    from comfy.ldm.minimax.ulysses import UlyssesParallel
    from h3_real_checkpoint import random_value
    from h3_sp_emulation import init_random_
    model = build(meta["layers"], ctx.device)
    args, tokens = inputs(meta["case"], model, ctx.device)
    b = model.blocks[0]  # the tower at the model's width (H3's real one, or the tiny smoke config)
    tower = MiniMaxH3FunControl(injection_layers=tuple(range(meta["layers"])), hidden_size=b.attn.out_proj.out_features,
                                num_attention_heads=b.attn.heads, attention_head_dim=b.attn.head_dim, ffn_hidden_size=b.mlp.fc2.in_features,
                                time_embed_dim=b.adaln_proj.linear.in_features, dtype=b.attn.qkv_proj.weight.dtype, device=ctx.device,
                                operations=comfy.ops.disable_weight_init).requires_grad_(False)
    if meta.get("scaled"):  # h3_real_checkpoint.py's weights: the tower's hint does not swamp the model's rows
        gen = torch.Generator(ctx.device).manual_seed(1)
        for net in (model, tower):
            for name, t in net.state_dict().items():
                if not name.endswith("rope.inv_freq"):
                    t.copy_(random_value(name, t.shape, gen, ctx.device))
    else:  # std 0.02 (the run in bench/results/h3_gpu_controlnet.json)
        init_random_(tower, seed=1)
    strength = 0.1 if meta.get("scaled") else 0.5
    video = args[0][0]
    latent = torch.randn((1, tower.control_in_dim, *video.shape[2:]), generator=torch.Generator(ctx.device).manual_seed(2), device=ctx.device)
    state = {}

    def patch(a, extra):
        i = a["transformer_options"]["block_index"]
        if i == 0:
            state["c"] = tower.init_stream(a["img"], latent, a["layout"], a["t_emb"])
        state["c"], hint = tower.step(i, state["c"], a["t_emb"], a["mod_segments"], a["rope_freqs"], a["transformer_options"])
        return {"img": extra["original_block"](a)["img"] + strength * hint}
    replace = {"dit": {("double_block", i): patch for i in tower.injection_layers}}
    sp = UlyssesParallel(ctx.rank, ctx.world_size, model.blocks[0].attn.heads, ctx.transport, chunks=meta["chunks"])
    runs = {"sharded": {"minimax_h3_sequence_parallel": sp},
            "sharded_tower": {"minimax_h3_sequence_parallel": sp, "patches_replace": patched_blocks(sp, replace, tower.injection_layers)},
            "sharded_tower_whole_block_on_rank0": {"minimax_h3_sequence_parallel": sp,
                                                   "patches_replace": whole_block_on_rank0(sp, replace, tower.injection_layers)}}
    if ctx.rank == 0:  # the native runs on rank 0 alone, before the sharded ones of the same round
        runs = {"native": {}, "native_tower": {"patches_replace": replace}, **runs}
    seconds, outs = {k: [] for k in runs}, {}
    for r in range(meta["repeats"] + 1):
        for name, options in runs.items():
            sync(ctx.device)
            t0 = time.perf_counter()
            out = model._forward(*args, dict(options))
            sync(ctx.device)
            if r:
                seconds[name].append(time.perf_counter() - t0)
            outs[name] = out
    if ctx.rank:
        return {}
    med = {k: statistics.median(v) for k, v in seconds.items()}
    rel = {k: rel_diff(outs[k], outs["native_tower"]) for k in ("sharded_tower", "sharded_tower_whole_block_on_rank0")}
    return {"tokens": tokens, "tower_blocks": len(tower.injection_layers), "model_blocks": meta["layers"], "seconds": seconds,
            "median_s": med, "tower_added_s": {"native": med["native_tower"] - med["native"],
                                               "sharded": med["sharded_tower"] - med["sharded"],
                                               "sharded_whole_block_on_rank0": med["sharded_tower_whole_block_on_rank0"] - med["sharded"]},
            "rel_diff_vs_native_tower": rel, "rel_diff_tower_vs_no_tower_native": rel_diff(outs["native_tower"], outs["native"])}


def staged_only(on):
    """No stream path set up, as on GPUs without stream memory operations: CUDA tensors are staged in CPU memory
    and copied on the calling thread (data_path "host, on the calling thread")."""
    from comfy.parallel import stream_path
    real = getattr(stream_path, "_real_attach", stream_path.attach)
    stream_path._real_attach = real
    stream_path.attach = (lambda host, device_path=True: None) if on else real


staged_only(os.environ.get("H3SP_BENCH_STAGED") == "1")  # a worker of a "staged" run


def rel_diff(outs, refs):
    """max |a - b| / max |b| over the (video, audio) outputs."""
    return max(float((a.float() - b.float()).abs().max() / b.float().abs().max()) for a, b in zip(outs, refs))


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--case", default="38k")
    ap.add_argument("--control", action="store_true", help="also time a Fun ControlNet tower (one tower block per model block)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--scaled", action="store_true", help="--control with scaled weights and hint 0.1 (see control())")
    ap.add_argument("--skip-link", action="store_true", help="only the parity (and --control) runs")
    ap.add_argument("--skip-parity", action="store_true", help="only the link runs")
    ap.add_argument("--paths", default="device,host,staged",
                    help="the data paths to run: device, host (comfy.parallel's stream path), staged (its fallback through CPU memory)")
    ap.add_argument("--device", default="cuda:0", help="every rank's device (cpu with H3SP_BENCH_TINY=1 --case tiny: a smoke run)")
    a = ap.parse_args()
    result = {"what": __doc__.split("\n\n")[0], "gpu": torch.cuda.get_device_name() if a.device != "cpu" else "cpu", "torch": torch.__version__,
              "machine": platform.node(), "commit": os.environ.get("H3SP_COMMIT"), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "runs": []}
    for n, path in ((n, p) for n in map(int, a.ranks.split(",")) for p in a.paths.split(",")):
        staged_only(path == "staged")
        with ParallelGroup(f"bench-{n}", device_path=path == "device") as group:
            group.start([a.device] * n, ["h3_shared_gpu"], env={"H3SP_BENCH_STAGED": "1" if path == "staged" else ""})
            if group.data_path != {"staged": "host, on the calling thread"}.get(path, path):
                print(json.dumps({"ranks": n, "asked": path, "data_path": group.data_path}), flush=True)
            links = []
            for mb in () if a.skip_link else (0.001, 0.1, 1, 4, 64, 256):
                r = group.run(OP_LINK, {"mb": mb, "repeats": 200 if mb < 1 else 20 if mb < 64 else 5}).values
                s = max(v["s"] for v in r)
                links.append({"mb_per_pair": mb, "s_per_call": s, "rounds": r[0]["rounds"],
                              "gb_per_s_per_rank_each_way": mb * (n - 1) / 1e3 / s})
                print(json.dumps({"ranks": n, "data_path": group.data_path, **links[-1]}), flush=True)
            parity_out = None if a.skip_parity else group.run(OP_PARITY, {"layers": a.layers, "case": a.case, "chunks": 2},
                                                              timeout=1200).values[0]
            print(json.dumps({"ranks": n, "data_path": group.data_path, **(parity_out or {})}), flush=True)
            run = {"ranks": n, "data_path": group.data_path, "link": links, "parity": parity_out, "startup_s": group.startup_seconds}
            if a.control:
                run["control"] = group.run(OP_CONTROL, {"layers": a.layers, "case": a.case, "chunks": 2, "repeats": a.repeats,
                                                        "scaled": a.scaled},
                                           timeout=1200).values[0]
                print(json.dumps({"ranks": n, "control": run["control"]["median_s"]}), flush=True)
            result["runs"].append(run)
        save(a.out, result)
    save(a.out, result, finished=True)


if __name__ == "__main__":
    main()
