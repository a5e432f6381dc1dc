"""Markdown tables of bench/results/lora_sync_h200.json (bench/lora_sync_bench.py --merge).

    python bench/lora_sync_table.py [bench/results/lora_sync_h200.json]
"""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = (("first_load", "LoRA load"), ("strength_change", "strength 1.0 -> 0.5"), ("swap", "LoRA swap"), ("clear", "clear"))
GIB = 1024 ** 3


def _mb(n):
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.0f} kB"


def tables(r):
    w, c = r["worker"], r["comfyui_rank0"]
    m = r["machine"]
    lmg = {row["step"]: row["load_models_gpu_s"] for row in c["load_models_gpu"]}
    lines = [f"MiniMax H3 ({r['model']['parameters'] / 1e9:.1f} B parameters, bf16, {r['model']['weights_gib']} GiB), "
             f"rank-{r['lora']['rank']} LoRA on 208 linears; {m['gpu']}, torch {m['torch']}. Medians of "
             f"{len(w['changes']) // 4} rounds (worker), one round (ComfyUI).", "",
             "| change | ComfyUI load_models_gpu (rank 0; workers before) | worker now | worker: decode / merge | "
             "rank 0: capture + encode | tensor bytes sent |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for key, label in STEPS:
        s = w["changes_median"][key]
        lines.append(f"| {label} | {lmg[key]:.1f} s | {s['worker_total_s']:.2f} s | {s['decode_s']:.2f} / {s['load_s']:.2f} s | "
                     f"{s['rank0_capture_encode_s']:.2f} s | {_mb(s['tensor_bytes_sent']) if s['tensor_bytes_sent'] else '0'} |")
    d, step = c["direct"], w["step"]
    backups = max(row["backup_gib"] for row in w["changes"])
    lines += ["", "| | ComfyUI (rank 0; workers before) | worker now |", "| --- | ---: | ---: |",
              f"| patch_model() / unpatch_model() / strength change, called directly | {d['patch_model_s']:.1f} / "
              f"{d['unpatch_model_s']:.1f} / {d['strength_change_s']:.1f} s | - |",
              f"| backups of the 208 patched weights | {d['host_backup_gib']:.1f} GiB in host RAM | "
              f"{backups:.1f} GiB on the GPU (the original weights, no copy) |",
              f"| peak host RSS of the process (VmHWM) | {c['peak']['VmHWM'] / GIB:.1f} GiB | "
              f"{w['rss_before_mmap']['VmHWM'] / GIB:.1f} GiB |",
              "", f"Per step at {step['resolution']} ({step['tokens']:,} tokens), interleaved, median of "
              f"{len(step['times_s']['base'])}: base weights {step['base_median_s']:.3f} s; merged (worker) "
              f"{step['merged_median_s']:.3f} s ({step['merged_overhead_pct']:+.1f} %); forward-time patches "
              f"(LowVramPatch, DynamicVRAM's per-step work) {step['forward_time_patches_median_s']:.3f} s "
              f"({step['forward_time_patches_overhead_pct']:+.1f} %).",
              f"Restoring base weights from a page-cached safetensors file instead: {w['mmap_restore']['gb_per_s']} GB/s, "
              f"{w['mmap_restore']['restore_s_extrapolated_208']} s for the 208 keys (before any merge)."]
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    path = argv[0] if argv else os.path.join(ROOT, "bench", "results", "lora_sync_h200.json")
    with open(path) as f:
        print(tables(json.load(f)))


if __name__ == "__main__":
    main()
