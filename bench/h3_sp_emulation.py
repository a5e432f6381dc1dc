"""Sequence-parallel scaling of the shipped H3 Ulysses code, EMULATED on one GPU.

Rank 0's share of one denoising step runs for real: the patched tree's MiniMaxH3Model._forward at
H3's real width (hidden 5376, 56 heads of 128), random bf16 weights, on its S/N rows and its head
share, through comfy/ldm/minimax/ulysses.py exactly as shipped (head chunks, fp8 exchange, the q|k|v
all-to-all or, where it moves fewer bytes, the hidden-row gather; --qkv auto,all_to_all runs both). Only
the transport is replaced: each all-to-all waits for what the compute stream queued before it,
copies the bytes the real one would deliver into this rank's receive buffers (device copies), and
spins until the time the link takes for them has passed: the larger of the bytes sent and received
over the link bandwidth (the host path copies both directions at once), plus the fixed cost of one
collective of the shipped transport at that rank count, measured on this machine by
h3_shared_gpu.py (a 1 KB all-to-all; --latency-from its JSON). The compute stream waits on that, so the chunk pipeline overlaps
communication with compute as the code makes it. The peers are symmetric and not run. Host-side
waits of the real transport are not modelled (this only removes host latency).

Per-block times come from CUDA events at block starts; a step is projected to H3's 50 blocks:
  step = before the first block + 50 x median block + after the last block.
Speed-up = native step (N = 1, same model, same attention) / emulated step. Exposed communication =
emulated step at a link - emulated step with a free link (compute only).

Links: nvlink 400 GB/s, pcie4x16 25 GB/s, pcie3x8 7 GB/s, and two matched to the peers' boxes:
B = B_peer x (peer's 1-GPU step / our native step at the same token count), so that communication
takes the same share of a step as there. Everything here says EMULATED.

  cd <patched tree> && python /path/bench/h3_sp_emulation.py --out emulation.json
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

# (height, width, frames, text rows): the packed lengths 38,222 and 75,794 (the peer's 243-frame case)
CASES = {"15k": (480, 832, 124, 512), "38k": (768, 1344, 124, 512), "75k": (768, 1344, 243, 2408), "tiny": (64, 64, 9, 16)}  # tiny: CPU smoke runs
LINKS = {"nvlink": 400.0, "pcie5x16": 50.0, "pcie4x16": 25.0, "pcie3x8": 7.0}
# the data path each link is paced as: the fixed cost per collective measured for that path (h3_shared_gpu.py)
PATH_OF = {"nvlink": "device", "pcie5x16": "host", "pcie4x16": "host", "pcie3x8": "host", "matched_3gpu": "host", "matched_2gpu": "host"}
# (link GB/s, that box's 1-GPU s/step, tokens, what) from bench/peers.json
PEERS = {"matched_3gpu": (25.0, 65.0, 75794, "MultiStream, 3x RTX PRO 4000 24 GB, PCIe, 65.0 s/step on one GPU at 75,794 tokens"),
         "matched_2gpu": (7.0, 86.7, 75794, "MultiStream, 2x RTX 5060 Ti 16 GB, PCIe 3 x8, 86.7 s/step on one GPU at 75,794 tokens")}
BLOCKS = 50


class EmulatedWork:
    def __init__(self, event):
        self.event = event

    def wait(self):
        torch.cuda.current_stream().wait_event(self.event)


class EmulatedTransport:
    """The all_to_all of comfy.parallel.transport.HostTransport, for rank 0, timed as a link of ``gbps`` GB/s."""

    def __init__(self, world_size, gbps, latency_s, slot_bytes=64 << 20):
        self.world_size, self.gbps, self.latency_s = world_size, gbps, latency_s
        self.lane = slot_bytes // world_size
        self.stream = torch.cuda.Stream()
        self.cycles_per_s = calibrate_sleep()  # again for every link: the SM clock follows the load
        self.scratch = torch.empty(0, dtype=torch.uint8, device="cuda")
        self.rounds = self.bytes_in = self.bytes_out = 0

    def all_to_all(self, sends, recvs, sizes):
        n = self.world_size
        out_bytes = sum(sizes[0][j] for j in range(1, n))
        in_bytes = sum(sizes[i][0] for i in range(1, n))
        rounds = max([-(-sizes[i][j] // self.lane) for i in range(n) for j in range(n) if i != j] + [0])
        self.rounds, self.bytes_in, self.bytes_out = self.rounds + rounds, self.bytes_in + in_bytes, self.bytes_out + out_bytes
        ready = torch.cuda.Event()
        ready.record()
        if self.scratch.numel() < max(in_bytes, 2):
            # valid bf16 values: what the peers send is never NaN
            self.scratch = torch.randn(max(in_bytes, 2) // 2 + 1, dtype=torch.bfloat16, device="cuda").view(torch.uint8)
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            recvs[0].view(-1).view(torch.uint8).copy_(sends[0].contiguous().view(-1).view(torch.uint8))
            offset = 0
            for i in range(1, n):
                flat = recvs[i].view(-1).view(torch.uint8)
                flat.copy_(self.scratch[offset:offset + flat.numel()])
                offset += flat.numel()
            if self.gbps is not None:
                seconds = max(out_bytes, in_bytes) / (self.gbps * 1e9) + self.latency_s - in_bytes / 2.5e12
                if seconds > 0:
                    torch.cuda._sleep(int(seconds * self.cycles_per_s))
            done = torch.cuda.Event()
            done.record()
        return EmulatedWork(done)


def calibrate_sleep(cycles=50_000_000):
    """GPU cycles per second of torch.cuda._sleep, measured now."""
    torch.cuda._sleep(1000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) / 1000)


def build(layers, device="cuda"):
    """H3 at its real width with random bf16 weights (H3SP_BENCH_TINY=1: the tests' tiny config in fp32, for CPU smoke runs)."""
    import comfy.ldm.minimax.model as h3
    import comfy.ops
    tiny = {"hidden_size": 64, "token_refiner_num_layers": 1, "num_attention_heads": 8, "attention_head_dim": 8, "ffn_hidden_size": 96,
            "text_dim": 48, "timestep_input_dim": 32, "time_embed_hidden_size": 64, "time_embed_dim": 32, "rope_inv_freq_len": 1}
    config = tiny if os.environ.get("H3SP_BENCH_TINY") else {}
    dtype = torch.float32 if config else torch.bfloat16
    model = h3.MiniMaxH3Model(num_layers=layers, **config, dtype=dtype, device=device, operations=comfy.ops.disable_weight_init)
    init_random_(model.requires_grad_(False))
    return model


def init_random_(model, seed=0):
    """Random weights in place: normal (std 0.02), norms 1, rope frequencies as the model's."""
    gen = None
    for name, t in model.state_dict().items():
        gen = gen or torch.Generator(t.device).manual_seed(seed)
        if name.endswith("rope.inv_freq"):
            n = t.shape[0]
            t.copy_(1.0 / (10000.0 ** (torch.arange(n, dtype=torch.float64, device=t.device) / n)))
        elif "norm" in name:
            t.fill_(1.0)
        else:
            t.normal_(0.0, 0.02, generator=gen)


def save(path, result, finished=False):
    """The JSON of a run, rewritten as it grows (a run cut short still leaves what it measured)."""
    if finished:
        result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def inputs(case, model, device="cuda"):
    from comfy.ldm.minimax.model import PackedLayout
    from comfy_extras.nodes_minimax_h3 import EmptyMiniMaxH3LatentAV
    h, w, f, text = CASES[case]
    latent = EmptyMiniMaxH3LatentAV.execute(w, h, f).result[0]["samples"]
    video, audio = latent.unbind()
    g = torch.Generator(device).manual_seed(1)
    video = torch.randn(video.shape, generator=g, device=device)
    audio = torch.randn(audio.shape, generator=g, device=device)
    dtype = model.blocks[0].attn.qkv_proj.weight.dtype
    context = torch.randn(1, text, model.hidden_size, generator=g, device=device).to(dtype)  # refined text (extra_conds)
    tokens = PackedLayout(text, video.shape[2], video.shape[3], video.shape[4], audio.shape[-1]).seq_len
    return ([video, audio], torch.tensor([600.0], device=device), context), tokens


def timed(model, args, options, repeats):
    """(ms before the first block, median ms per block, ms after the last block) of model._forward."""
    marks = []
    hooks = [b.register_forward_pre_hook(lambda m, a: marks.append(_event())) for b in model.blocks]
    try:
        pre, blocks, post = [], [], []
        for r in range(repeats + 1):
            marks.clear()
            torch.cuda.synchronize()
            start = _event()
            model._forward(*args, dict(options))
            end = _event()
            end.synchronize()
            if r == 0:
                continue  # warm-up: lazy inits, autotuning
            pre.append(start.elapsed_time(marks[0]))
            blocks += [a.elapsed_time(b) for a, b in zip(marks[1:-1], marks[2:])] or [marks[0].elapsed_time(marks[-1])]
            post.append(marks[-1].elapsed_time(end) - statistics.median(blocks))
        return statistics.median(pre), statistics.median(blocks), statistics.median(post)
    finally:
        for h in hooks:
            h.remove()


def _event():
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    return e


def step_s(parts):
    pre, block, post = parts
    return (pre + BLOCKS * block + post) / 1000


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="15k,38k,75k")
    ap.add_argument("--ranks", default="2,3,4,8")
    ap.add_argument("--layers", type=int, default=4, help="real-width blocks built (the median block is projected to 50)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--chunks", default="2")
    ap.add_argument("--qkv", default="auto", help="auto (the shipped choice) and/or all_to_all (forced), comma-separated")
    ap.add_argument("--latency-from", required=True, help="h3_shared_gpu.py's JSON: the transport's cost of one collective by rank count")
    a = ap.parse_args()
    with open(a.latency_from) as f:
        measured = {(r.get("data_path", "host"), r["ranks"]): next(link["s_per_call"] for link in r["link"] if link["mb_per_pair"] == 0.001)
                    for r in json.load(f)["runs"] if r["link"]}
    sys.path.insert(0, os.getcwd())
    from comfy.ldm.minimax.ulysses import UlyssesParallel
    torch.backends.cuda.matmul.allow_tf32 = True
    model = build(a.layers)
    result = {"emulated": True, "what": __doc__.split("\n\n")[0], "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "machine": platform.node(), "commit": os.environ.get("H3SP_COMMIT"), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "layers_built": a.layers,
              "blocks_projected": BLOCKS, "collective_latency_s": {}, "links_gbps": dict(LINKS), "peers": {}, "cases": {}}
    for case in a.cases.split(","):
        args, tokens = inputs(case, model)
        native = timed(model, args, {}, a.repeats)
        entry = result["cases"][case] = {"tokens": tokens, "native": {"parts_ms": native, "step_s": step_s(native)}, "runs": []}
        links = dict(LINKS)
        for name, (gbps, peer_step, peer_tokens, what) in PEERS.items():
            if peer_tokens == tokens:
                links[name] = gbps * peer_step / step_s(native)
                result["peers"][name] = {"peer_gbps": gbps, "peer_one_gpu_step_s": peer_step, "our_native_step_s": step_s(native),
                                         "emulated_gbps": links[name], "source": what}
        for n in map(int, a.ranks.split(",")):
            # measured at 2, 4, 8 ranks; 3 between 2 and 4
            latency = {p: measured.get((p, n)) or (measured[(p, 2)] + measured[(p, 4)]) / 2 for p in ("device", "host")}
            result["collective_latency_s"][n] = latency
            for chunks, qkv in ((c, q) for c in map(int, a.chunks.split(",")) for q in a.qkv.split(",")):
                for fp8 in (False, True):
                    for link, gbps in [("compute only", None)] + sorted(links.items(), key=lambda kv: -kv[1]):
                        if fp8 and gbps is None:
                            continue
                        t = EmulatedTransport(n, gbps, latency[PATH_OF.get(link, "device")])
                        sp = UlyssesParallel(0, n, model.blocks[0].attn.heads, t, chunks=chunks, fp8=fp8,
                                             gather=None if qkv == "auto" else False)
                        parts = timed(model, args, {"minimax_h3_sequence_parallel": sp}, a.repeats)
                        per_step = (a.repeats + 1) * a.layers / BLOCKS  # forwards run, in steps of 50 blocks
                        run = {"ranks": n, "chunks": chunks, "exchange": "fp8" if fp8 else "bf16", "link": link, "gbps": gbps,
                               "qkv": "gather" if sp.gathers(model.blocks[0].attn) else "all_to_all", "qkv_choice": qkv,
                               "parts_ms": parts, "step_s": step_s(parts), "speedup": step_s(native) / step_s(parts),
                               "step_gb_in": t.bytes_in / per_step / 1e9, "step_gb_out": t.bytes_out / per_step / 1e9,
                               "step_rounds": t.rounds / per_step}
                        entry["runs"].append(run)
                        print(json.dumps({"case": case, **{k: v for k, v in run.items() if k != "parts_ms"}}), flush=True)
                        save(a.out, result)
        for run in entry["runs"]:
            free = next(r for r in entry["runs"] if r["ranks"] == run["ranks"] and r["chunks"] == run["chunks"]
                        and r.get("qkv_choice") == run.get("qkv_choice") and r["gbps"] is None)
            run["exposed_comm_s"] = run["step_s"] - free["step_s"]
        save(a.out, result)
    save(a.out, result, finished=True)


if __name__ == "__main__":
    main()
