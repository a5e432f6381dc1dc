"""Ours vs upstream's H3 forward on CPU for a small config: time per forward and peak memory.

Each implementation runs in its own process (so its peak RSS is its own), with the same random
weights and inputs, through ComfyUI's ops; needs COMFYUI_DIR (the pinned base).

  COMFYUI_DIR=/path/to/ComfyUI python bench/h3_cpu_native.py --out bench/results/h3_cpu_native.json
"""

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = {"hidden_size": 512, "num_layers": 8, "token_refiner_num_layers": 1, "num_attention_heads": 8,
          "attention_head_dim": 64, "ffn_hidden_size": 1024, "text_dim": 384, "timestep_input_dim": 64,
          "time_embed_hidden_size": 512, "time_embed_dim": 256, "rope_inv_freq_len": 8}
SHAPE = {"kind": "keyframes", "text_len": 64, "frames": 5, "height": 24, "width": 32, "audio_t": 11}


def run_one(impl, repeat):
    sys.path.insert(0, ROOT)
    sys.path.append(os.environ["COMFYUI_DIR"])
    from comfy.cli_args import args
    args.cpu = True
    import torch
    import comfy.ops
    sys.path.insert(0, os.path.join(ROOT, "tests-unit"))
    from h3_files import random_state_dict, step_inputs
    if impl == "upstream":
        from comfy.ldm.minimax.model import MiniMaxH3Model
    else:
        from comfy.ldm.minimax_h3.model import MiniMaxH3Model
    torch.set_num_threads(2)
    model = MiniMaxH3Model(**CONFIG, dtype=torch.float32, operations=comfy.ops.disable_weight_init).requires_grad_(False)
    model.load_state_dict(random_state_dict(model, seed=0))
    x, t, c, p = step_inputs(CONFIG, **SHAPE)
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    with torch.no_grad():
        for i in range(repeat + 2):
            t0 = time.perf_counter()
            out = model(x, t, c, {}, minimax_payload=dict(p))
            if i >= 2:
                times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    checksum = [float(o.double().sum()) for o in out]
    return {"impl": impl, "median_s": statistics.median(times), "min_s": min(times), "n": len(times),
            "peak_rss_mib": peak / 1024, "forward_rss_growth_mib": (peak - base_rss) / 1024, "checksum": checksum}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "h3_cpu_native.json"))
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--impl", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.impl:
        print(json.dumps(run_one(a.impl, a.repeat)))
        return
    if not os.environ.get("COMFYUI_DIR"):
        sys.exit("set COMFYUI_DIR to a checkout of the pinned ComfyUI base")
    runs = []
    for impl in ("upstream", "ours", "upstream", "ours"):  # interleaved, each in a fresh process
        out = subprocess.run([sys.executable, __file__, "--impl", impl, "--repeat", str(a.repeat)],
                             check=True, capture_output=True, text=True).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
    best = {impl: min((r for r in runs if r["impl"] == impl), key=lambda r: r["median_s"]) for impl in ("upstream", "ours")}
    result = {"config": CONFIG, "shape": SHAPE, "runs": runs,
              "ratio_ours_over_upstream": best["ours"]["median_s"] / best["upstream"]["median_s"],
              "same_output": runs[0]["checksum"] == runs[1]["checksum"],
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                          "load_avg": os.getloadavg()}}
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    for impl, r in best.items():
        print(f"{impl:8s} {r['median_s'] * 1000:8.1f} ms/forward  peak RSS {r['peak_rss_mib']:7.1f} MiB "
              f"(forward growth {r['forward_rss_growth_mib']:.1f} MiB)")
    print(f"ratio ours/upstream {result['ratio_ours_over_upstream']:.3f}; identical outputs: {result['same_output']}")


if __name__ == "__main__":
    main()
