"""Markdown tables (and PNG plots) generated from bench/results/*.json.

    python bench/tables.py            # rewrite the generated sections of README.md and bench/README.md
    python bench/tables.py --into rfc/0000-minimax-h3-sequence-parallel.md   # ... and the RFC's appendix
    python bench/tables.py --plots    # also draw the PNGs into bench/results/ (needs matplotlib)
    python bench/tables.py --check    # exit 1 when a generated section is stale or a results file is not indexed

Only the text between ``<!-- tables:begin -->`` and ``<!-- tables:end -->`` is replaced; everything
else in a target file stays byte-identical. What goes in depends on the file: README.md gets
README_TABLES, bench/README.md gets BENCH_TABLES (with the results index), any other file (the RFC's
appendix) APPENDIX_TABLES. A target without the file or the markers is skipped with a message (README.md
or bench/README.md under --check: that is a failure). A table whose JSON file or section is missing
becomes a comment line, never a crash. The output depends only on the JSON files (no clocks, no environment, not
the code's defaults), so --check is reproducible.
Superseded runs live in bench/results/archive/ and are in no table.
"""

import argparse
import difflib
import fnmatch
import json
import math
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_chunks(found):
    """The all-to-all pipeline depth the scaling runs timed with shared adaLN projections (the smallest
    one their JSON holds): read from the results, so the tables depend on the JSON alone."""
    depths = {int(m.group(1)) for _, _, sec in found for r in sec["resolutions"].values() for w in (r.get("worlds") or {}).values()
              for k in (w.get("times") or {}) for m in [re.fullmatch(r"chunks(\d+)_bw\d+_shared_adaln", k)] if m}
    if not depths:
        raise Skip("no chunks<c>_bw<b>_shared_adaln timing")
    return min(depths)

RESULTS = ROOT / "bench" / "results"
README = ROOT / "README.md"
BENCH_README = ROOT / "bench" / "README.md"
BEGIN = "<!-- tables:begin -->"
END = "<!-- tables:end -->"

PLOT_NATIVE = "h3_native_step_time.png"
PLOT_SCALING = "h3_sp_emulated_speedup.png"

H3_JSON = "h3_h200.json"
H3_PROFILE_JSON = "h3_h200_accuracy_profile.json"
H3_BUDGET_JSON = "h3_h200_budget.json"
H3_GAPS_JSON = "h3_h200_gaps.json"
H3_AB_JSON = "h3_h200_attention_ab.json"
H3_SEGMENTS_JSON = "h3_h200_fusions_segments.json"
H3_LAYOUTS_JSON = "h3_attention_layouts.json"
H3_PREP_JSONS = ("h3_h200_chunk_prep_15k.json", "h3_h200_chunk_prep_38k.json")
H3_CPU_JSON = "h3_cpu_native.json"
PARALLEL_JSON = "parallel_cpu.json"
SNAPSHOT_JSON = "snapshot_cpu.json"
PATCH_CHECK_JSON = "patch_check.json"
INPROCESS_JSON = "h3_h200_inprocess.json"
INPROCESS_RR_JSON = "h3_h200_inprocess_round_robin.json"
SEAM_CUDA_JSON = "h3_h200_seam_cuda.json"

# bench/README.md's index: results file (a glob) -> the command that writes it -> the question it answers.
# --check fails on a JSON in bench/results/ that no entry matches, and on a named file that is missing
# (a glob that matches nothing is listed as pending). The H200 files were written by bench/h3_gpu.py
# before it was split by question; the command in each file's machine.command is that run's.
INDEX = (
    (H3_JSON, "`h3_native.py --sections native`; its `kernels` section: `h3_kernels.py --sections kernels`",
     "How long does one H3 step take on one GPU, ours vs upstream, and how far apart are the outputs?"),
    (H3_PROFILE_JSON, "`h3_accuracy.py`; `h3_native.py --sections profile`; `h3_kernels.py --sections fusions` "
                      "(its `overlap_emulation` section is superseded by the chunk_prep files)",
     "How accurate is each attention backend, alone and in a DiT block; where does a step's kernel time go; "
     "what does the fused RMSNorm + adaLN save?"),
    (H3_AB_JSON, "`h3_kernels.py --layers 2 --sections attention_ab,graph_profile`",
     "Does `kernels.attention` cost anything over the bare cuDNN call; which kernels speed up in a CUDA graph?"),
    (H3_SEGMENTS_JSON, "`h3_kernels.py --layers 2 --sections fusions`",
     "A modulation segment's rows redone: comfy_kitchen's kernel or torch's, by row count?"),
    (H3_LAYOUTS_JSON, "`h3_attention_layouts.py`",
     "Does attention on q|k|v buffer views, and cloning v as upstream does, change its time?"),
    (H3_PREP_JSONS[0], "`h3_sp_emulation.py --layers 2 --sections timeline,overlap --resolutions 832x480x124 --repeat 50 "
                       "--chunks \"\" --shared-chunks 2 --bandwidths 360 --no-unfused --upfront-ab --normal-priority-ab --last-rank`",
     "How would the Ulysses code of that run scale with N at 15k tokens (emulated on one GPU), and when does attention start?"),
    (H3_PREP_JSONS[1], "the same as the line above without `timeline`, `--resolutions 1344x768x124 --repeat 8`",
     "The same at 38k tokens."),
    (H3_BUDGET_JSON, "`h3_sp_budget.py --layers 2 --sections budget`; its `kernels` section: `h3_kernels.py --sections kernels`",
     "Which ops of a rank's block do not shrink with N; which kernels to use for attention, q/k norm + rope, the q|k|v pack?"),
    (H3_GAPS_JSON, "`h3_sp_budget.py --layers 2 --sections gaps`",
     "Does the GPU idle between a rank's kernels over a step, and does any op sync the host?"),
    (H3_CPU_JSON, "`h3_cpu_native.py`", "Is ours as fast as upstream on CPU (small config, one process each)?"),
    (PARALLEL_JSON, "`parallel_bench.py`", "What do comfy/parallel's start-up and op round trips cost (CPU, gloo)?"),
    (SNAPSHOT_JSON, "`snapshot_bench.py`", "What do patch snapshots cost for a real-size H3 LoRA, and a worker's merge?"),
    (PATCH_CHECK_JSON, "`patches/check`", "Does the series apply to the base, pass our tests there, and regress none of ComfyUI's?"),
    ("lora_sync_*.json", "`lora_sync_bench.py`", "LoRA sync at H3 scale: is a LoRA change in force on every rank within a second?"),
    (INPROCESS_JSON, "`h3_inprocess.py --check --cudnn-bar` (`COMFYUI_DIR`: the h3-newest base, upstream's own DiTBlock; run "
                     "by the script's first revision, which took the same measurements without the second file's additions)",
     "Can N Python threads in one process (core's MultiGPU design) keep N GPUs fed with H3 Ulysses, against one "
     "thread and N processes (host side, on one GPU; all-to-alls emulated)?"),
    (INPROCESS_RR_JSON, "`h3_inprocess.py --sections native,threads,graphs --native-reps 0 --no-free --round-robin --check "
                        "--switch-intervals 0.0005,0.05`",
     "The same again (a second run), plus one thread driving all N ranks in turn, the threads' CPU time and other GIL "
     "switch intervals: is it the GIL?"),
    (SEAM_CUDA_JSON, "`h3_seam_cuda.py --out` in the unpatched and in the patched tree, then `--compare`",
     "Does patch 0001 change a number or a kernel on CUDA (every case of minimax_h3_cases.py)?"),
)


class Skip(Exception):
    """A table cannot be built from what the JSON holds."""


# ---------------------------------------------------------------- loading and formatting

def load(results, name):
    """The parsed JSON file, or None when it is absent; unreadable JSON raises Skip."""
    path = Path(results) / name
    if not path.is_file():
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise Skip(f"{name} unreadable: {e}")


def _section(results, name, key, inner=None):
    """(the JSON, its non-empty section `key`), with `inner` in the section non-empty when given; else Skip."""
    d = load(results, name)
    if d is None:
        raise Skip(f"{name} not found")
    sec = d.get(key)
    if not sec or (inner is not None and not sec.get(inner)):
        raise Skip(f"{name} has no '{key}' section" + (f" with '{inner}'" if inner else ""))
    return d, sec


def _num(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def fmt(x, digits):
    return f"{x:.{digits}f}" if _num(x) else "—"


def f_s(x):  # seconds; a sub-millisecond value keeps one significant digit instead of reading 0.000
    if _num(x) and 0 < abs(x) < 0.0005:
        return f"{x:.1g}"
    return fmt(x, 3)


def f_ratio(x):
    return fmt(x, 3)


def f_speedup(x):
    return fmt(x, 2)


def f_ms(x):
    return fmt(x, 2)


def f_ms_from_s(x):
    return fmt(x * 1e3, 2) if _num(x) else "—"


def f_sci(x):
    return f"{x:.2e}" if _num(x) else "—"


def f_bytes(n):
    if not _num(n):
        return "—"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def f_bytes_exact(n):
    return f"{f_bytes(n)} ({int(n):,} B)" if _num(n) else "—"


def f_int(n):
    return f"{int(n):,}" if _num(n) else "—"


def table(header, rows, align=None, keep=None):
    """A Markdown table; align: one of 'l'/'r' per column (default: first left, rest right); keep: the
    names of the columns to show (default all)."""
    align = align or ["l"] + ["r"] * (len(header) - 1)
    if keep is not None:
        cols = [i for i, h in enumerate(header) if h in keep]
        header, align, rows = [header[i] for i in cols], [align[i] for i in cols], [[row[i] for i in cols] for row in rows]
    sep = ["---" if a == "l" else "--:" for a in align]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(sep) + " |"]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return lines


def gpu_machine(d):
    m = d.get("machine") or {}
    parts = [m.get("gpu") or "GPU not recorded"]
    if m.get("torch"):
        parts.append(f"torch {m['torch']}")
    if m.get("cuda"):
        parts.append(f"CUDA {m['cuda']}")
    if m.get("comfy_kitchen") not in (None, "", "?"):
        parts.append(f"comfy_kitchen {m['comfy_kitchen']}")
    s = ", ".join(parts)
    if d.get("started"):
        s += f" (run started {d['started']})"
    return s


def cpu_machine(d):
    m = d.get("machine") or {}
    parts = []
    cores = m.get("cpus_usable", m.get("cpu_count"))
    if cores:
        parts.append(f"{cores} CPU cores")
    if m.get("platform"):
        parts.append(m["platform"])
    if m.get("torch"):
        parts.append(f"torch {m['torch']}")
    if m.get("python"):
        parts.append(f"Python {m['python']}")
    return ", ".join(parts) or "machine not recorded"


def caption(title, name, machine):
    return f"**{title}** Source: `bench/results/{name}`; {machine}."


def best_median(section, key):
    """min over the interleaved repeats (key, key_2) of the median, as the benchmark's ratios use."""
    vals = [section[k]["median_s"] for k in (key, f"{key}_2") if isinstance(section.get(k), dict) and _num(section[k].get("median_s"))]
    if not vals:
        raise Skip(f"no {key}.median_s")
    return min(vals)


def _worlds(res):
    return sorted(((int(n), r) for n, r in (res.get("worlds") or {}).items()), key=lambda t: t[0])


def _speedup(w, key):
    return ((w.get("times") or {}).get(key) or {}).get("speedup")


def _indexed(name):
    return any(fnmatch.fnmatch(name, pattern) for pattern, _, _ in INDEX)


def index_problems(results=RESULTS):
    """What --check reports about INDEX: results files it lacks, files it names that are missing."""
    results = Path(results)
    found = sorted(p.name for p in results.glob("*.json"))
    problems = [f"bench/results/{n} is not in bench/tables.py's INDEX: add the command that writes it and its question"
                for n in found if not _indexed(n)]
    problems += [f"bench/tables.py's INDEX names {p}, which is not in bench/results/"
                 for p, _, _ in INDEX if not any(ch in p for ch in "*?[") and p not in found]
    return problems


# ---------------------------------------------------------------- tables

def t_index(results):
    rows = []
    for pattern, command, question in INDEX:
        names = sorted(p.name for p in Path(results).glob(pattern))
        if names:
            rows.append([", ".join(f"`{n}`" for n in names), command, question])
        else:
            rows.append([f"`{pattern}`", "pending", question])
    out = ["**Results index.** Every JSON in `bench/results/`, the command that writes it (scripts in `bench/`; "
           "the H3 GPU scripts need `COMFYUI_DIR` and a CUDA GPU) and the question it answers.", ""]
    out += table(["results file", "command", "question"], rows, ["l", "l", "l"])
    out += ["", "The H200 files were recorded by `bench/h3_gpu.py` before it was split into the `h3_*.py` scripts, "
                "whose measuring code is the same; each file's `machine.command` is the command of its run."]
    return out


NATIVE_BRIEF = ("resolution (WxHxF)", "tokens", "n", "upstream s (flash-first)", "ours s (flash-first)",
                "ours / upstream (both flash-first)", "peak GiB (upstream / ours)", "rel diff upstream run-to-run",
                "rel diff ours flash-first vs upstream")


def _attention_order_note(results):
    """Upstream's own model, flash-first vs cuDNN-first, from the in-process run (same code, one run)."""
    d = load(results, INPROCESS_JSON)
    rows = [(res, r["native"]) for res, r in ((d or {}).get("resolutions") or {}).items()
            if _num((r.get("native") or {}).get("step_s")) and _num((r.get("native") or {}).get("step_s_cudnn_first"))]
    if not rows:
        return []
    parts = "; ".join(f"{res}: {f_s(n['step_s'])} s flash-first, {f_s(n['step_s_cudnn_first'])} s cuDNN-first "
                      f"({f_ratio(n['step_s_cudnn_first'] / n['step_s'])})" for res, n in rows)
    return [f"The attention order alone, on upstream's own model (the h3-newest base, `{INPROCESS_JSON}`, another run): {parts}. "
            "So cuDNN-first attention speeds upstream up as much as ours; no row here compares ours with upstream across orders."]


def t_native(results, brief=False):
    d, native = _section(results, H3_JSON, "native")
    model = d.get("model") or {}
    extra = ""
    if model:
        extra = (f"; {model.get('layers', '?')} blocks, {model.get('parameters', 0) / 1e9:.1f} B parameters, "
                 f"bf16 weights {model.get('weights_gib', '?')} GiB, random init")
    out = [caption("H3 native forward (one step, batch 1) on one GPU, ours vs upstream in the same attention order "
                   "(the base's, flash first).", H3_JSON, gpu_machine(d) + extra), ""]
    header = ["resolution (WxHxF)", "tokens", "n", "upstream s (flash-first)", "ours s (flash-first)",
              "ours / upstream (both flash-first)", "ours s (cuDNN-first)", "ours s (cuDNN-first, unfused adaLN)",
              "fused / unfused adaLN (ours, cuDNN-first)", "peak GiB (upstream / ours)", "rel diff upstream run-to-run",
              "rel diff ours flash-first vs upstream", "rel diff ours cuDNN-first vs upstream"]
    rows = []
    for res, r in native.items():
        up = best_median(r, "upstream")
        cudnn = best_median(r, "ours")
        flash = (r.get("ours_flash") or {}).get("median_s")
        ratio_flash = r.get("ratio_ours_flash_over_upstream", flash / up if _num(flash) else None)
        peaks = f"{fmt(r['upstream'].get('peak_gib'), 2)} / {fmt(r['ours'].get('peak_gib'), 2)}"
        unfused = (r.get("ours_unfused_adaln") or {}).get("median_s")
        rows.append([res, f_int(r.get("tokens")), r["upstream"].get("n", "—"), f_s(up), f_s(flash), f_ratio(ratio_flash),
                     f_s(cudnn), f_s(unfused), f_ratio(cudnn / unfused) if _num(unfused) and unfused else "—", peaks,
                     f_sci(r.get("rel_diff_upstream_run_to_run")), f_sci(r.get("rel_diff_ours_flash_vs_upstream")),
                     f_sci(r.get("rel_diff_ours_cudnn_vs_upstream"))])
    out += table(header, rows, keep=NATIVE_BRIEF if brief else None)
    out += ["", "Times: median of n timed forwards (upstream: the better of two interleaved repeats). Both sides of the ratio "
                "run the base's SDPA order, flash first; ours also runs the fused RMSNorm + adaLN kernel"
                + ("" if brief else "; the cuDNN-first columns compare ours with ours only (no upstream run in that order "
                                    "is in this file)")
                + ". Rel diff: max |a - b| / max |b| over the video and audio outputs (upstream is not run-to-run "
                "deterministic on CUDA)."]
    note = _attention_order_note(results)
    if note:
        out += [""] + note
    return out


def _runs(results, names):
    """[(name, JSON, its overlap_emulation section)] of the files in `names` that have one; Skip if none."""
    found = [(name, d, d["overlap_emulation"]) for name in names for d in [load(results, name)]
             if d and (d.get("overlap_emulation") or {}).get("resolutions")]
    if not found:
        raise Skip(f"none of {', '.join(names)} found")
    return found


def _shared_worlds(r, c):
    """(N, world entry, its first shared-adaLN bandwidth in GB/s) for every N > 1 of a resolution with a
    chunks<c>_bw<b>_shared_adaln timing."""
    for n, w in _worlds(r):
        bw = sorted({int(m.group(1)) for k in (w.get("times") or {})
                     for m in [re.fullmatch(rf"chunks{c}_bw(\d+)_shared_adaln", k)] if m}, reverse=True)
        if n > 1 and bw:
            yield n, w, bw[0]


SCALING_BRIEF = ("resolution (WxHxF)", "tokens", "N", "emulated, no transfers", "emulated, rank 0", "emulated, last rank")


def t_scaling(results, brief=False):
    found = _runs(results, H3_PREP_JSONS)
    c = run_chunks(found)
    header = ["resolution (WxHxF)", "tokens", "N", "blocks per timing", "emulated, no transfers", "emulated, rank 0",
              "emulated, last rank", "emulated, rank 0, q/k normed up front", "emulated, rank 0, normal-priority transfers"]
    rows, bws = [], set()
    for name, d, sec in found:
        for res, r in sec["resolutions"].items():
            for n, w, bw in _shared_worlds(r, c):
                bws.add(bw)
                key = f"chunks{c}_bw{bw}_shared_adaln"
                rows.append([res, f_int(r.get("tokens")), n, sec.get("repeat", "—"),
                             f_speedup(_speedup(w, f"chunks{c}_no_comm_shared_adaln")), f_speedup(_speedup(w, key)),
                             f_speedup(_speedup(w, key + "_last_rank")), f_speedup(_speedup(w, key + "_upfront")),
                             f_speedup(_speedup(w, key + "_normal_priority"))])
    bw_text = ", ".join(str(b) for b in sorted(bws))
    out = [caption(f"Sequence-parallel scaling of the series' Ulysses code as of those runs, EMULATED on one GPU: speed-up of a rank's DiT block "
                   f"over the native block, all-to-alls replaced by stand-ins at {bw_text} GB/s ({c} chunks). No multi-GPU "
                   "measurement exists yet.", ", ".join(n for n, _, _ in found), gpu_machine(found[0][1])), ""]
    out += table(header, rows, keep=SCALING_BRIEF if brief else None)
    if brief:
        return out + ["", "Emulated: one GPU runs one rank's block (S/N rows, ceil(56/N) heads) in the real `UlyssesAttention` "
                          "with only its all-to-alls replaced by a side-stream copy of the same bytes, paced to the bandwidth; "
                          "NCCL's own use of the SMs is not modelled. No transfers: the compute ceiling. Last rank: no text "
                          "rows. An emulated speed-up is not a measurement on N GPUs. Method and the other columns: "
                          "`bench/README.md`."]
    notes = []
    timeline = (found[0][1].get("timeline") or {}).get("runs") or {}
    if timeline:
        notes.append("One block's kernel timeline (`timeline` section of " + found[0][0] + "), when rank 0's first attention "
                     "kernel starts: " + "; ".join(f"{k.replace('_', ' ')} {fmt(v.get('first_attention_start_us'), 0)} us"
                                                   for k, v in timeline.items() if _num(v.get("first_attention_start_us"))) + ".")
    out += ["", "Speed-up: the native block (N = 1, all rows, 56 heads) / rank r's block at N, each timed over the given number "
                "of blocks back to back (50 = one H3 step); all columns of a row come from one interleaved run. The real "
                "`UlyssesAttention` runs with only its all-to-alls emulated, receive buffers filled with random data "
                "(attention's speed depends on the data). No transfers: the same block without the all-to-alls, the compute "
                "ceiling. Rank 0 also holds the 512 text rows, whose modulation is redone per block; the last rank holds "
                "floor(S/N) rows and one modulation segment; every rank waits for the slowest at each all-to-all, so rank "
                "0's number is the step's. A/B columns: every head's q/k normed before the first chunk is packed instead "
                "of per chunk; the emulated transfers on a normal-priority stream, where the next chunk's kernels take the "
                "SMs first. An emulated speed-up is not a measurement on N GPUs. "
                + " ".join(notes) + f" Method (from the JSON): {found[0][2].get('note', '?')}."]
    return out


def t_attention_ab(results):
    d, ab = _section(results, H3_AB_JSON, "attention_ab", "results")
    r = ab["results"]
    out = [caption(f"Attention call, S = {f_int(ab.get('seq'))}, 56 x 128 heads, bf16: `minimax_h3.kernels.attention` vs the bare "
                   f"cuDNN SDPA call on the same strided views, interleaved ({ab.get('rounds', '?')} rounds), ms.",
                   H3_AB_JSON, gpu_machine(d)), ""]
    out += table(["call", "ms"], [["`kernels.attention`", f_ms_from_s(r.get("kernels_attention"))],
                                  ["bare cuDNN SDPA", f_ms_from_s(r.get("sdpa_cudnn_bare"))],
                                  ["bare cuDNN SDPA + output reshape", f_ms_from_s(r.get("sdpa_cudnn_bare_reshaped"))]])
    graphs = ((d.get("graph_profile") or {}).get("per_block_kernel_s")) or {}
    totals = [f"{k.replace('_', ' ')} {f_ms_from_s(sum(v.values()))} ms" for k, v in graphs.items() if v]
    if totals:
        out += ["", "Kernel time of the native block (profiler, per block), eager vs replayed from a CUDA graph: "
                    + "; ".join(totals) + "."]
    layouts = load(results, H3_LAYOUTS_JSON)
    if layouts and layouts.get("results"):
        rows = [[f"`{k}`", fmt(v.get("median_ms"), 3), fmt(v.get("min_ms"), 3)]
                for k, v in layouts["results"].items() if isinstance(v, dict) and "median_ms" in v]
        out += ["", caption(f"Attention on q|k|v buffer views vs v cloned (as upstream's Attention does), S = "
                            f"{f_int(layouts.get('seq'))}, ms.", H3_LAYOUTS_JSON, f"{layouts.get('gpu', '?')}, torch "
                            f"{layouts.get('torch', '?')}"), ""]
        out += table(["variant", "median ms", "min ms"], rows)
    return out


def t_segments(results):
    d, f = _section(results, H3_SEGMENTS_JSON, "fusions", "results")
    r = f["results"]
    counts = sorted({int(m.group(1)) for k in r for m in [re.fullmatch(r"segment_kitchen_rms_adaln_(\d+)_rows_s", k)] if m})
    if not counts:
        raise Skip(f"{H3_SEGMENTS_JSON} has no segment_* results")
    out = [caption(f"One modulation segment's rows normed and modulated again (hidden {f.get('hidden', '?')}, bf16): "
                   "GPU kernel time, microseconds.", H3_SEGMENTS_JSON, gpu_machine(d)), ""]
    rows = [[f_int(n), fmt(r.get(f"segment_kitchen_rms_adaln_{n}_rows_s", math.nan) * 1e6, 1),
             fmt(r.get(f"segment_torch_rms_norm_addcmul_{n}_rows_s", math.nan) * 1e6, 1)] for n in counts]
    out += table(["rows", "comfy_kitchen rms_adaln + copy", "torch rms_norm + addcmul"], rows)
    return out


def t_budget(results):
    d, sec = _section(results, H3_BUDGET_JSON, "budget", "resolutions")
    res, r = next(iter(sec["resolutions"].items()))
    worlds = sorted(int(n) for n in r["worlds"])
    top = worlds[-1]
    one, last = r["worlds"]["1"], r["worlds"][str(top)]
    out = [caption(f"Where a rank's block time goes at {res} ({f_int(r.get('tokens'))} tokens): GPU kernel time per op, native "
                   f"(N = 1) vs rank 0 of an N-way shard, milliseconds per block.", H3_BUDGET_JSON, gpu_machine(d)), ""]
    header = ["op", "calls / block", "N = 1", f"N = {top}", f"N = {top} ideal (N = 1 / {top})"]
    header += [f"excess at N = {n}" for n in reversed(worlds) if n > 1]
    rows = []
    for name, v in last["ops"].items():
        base = one["ops"].get(name)
        rows.append([f"`{name}`", v["count"], f_ms_from_s(base["s"] * base["count"]) if base else "—",
                     f_ms_from_s(v["s"] * v["count"]), f_ms_from_s(v.get("ideal_s"))]
                    + [f"{r['worlds'][str(n)]['ops'][name]['excess_s'] * 1e3:+.3f}" if name in r["worlds"][str(n)]["ops"] else "—"
                       for n in reversed(worlds) if n > 1])
    rows.append(["whole block, kernels", "", f_ms_from_s(one["block_kernel_s"]), f_ms_from_s(last["block_kernel_s"]),
                 f_ms_from_s(last["ideal_block_s"])]
                + [f"{(r['worlds'][str(n)]['block_kernel_s'] - r['worlds'][str(n)]['ideal_block_s']) * 1e3:+.3f}"
                   for n in reversed(worlds) if n > 1])
    out += table(header, rows, ["l"] + ["r"] * (len(header) - 1))
    steady = [f"N = {n}: event {f_ms_from_s(w['steady']['block_s'])} ms, GPU busy {f_ms_from_s(w['steady']['busy_s'])} ms, "
              f"CUDA graph {f_ms_from_s(w['steady']['graph_block_s']) if _num(w['steady'].get('graph_block_s')) else '—'} ms, "
              f"{w['steady']['kernels_per_block']:.0f} kernels"
              for n, w in sorted(((int(n), w) for n, w in r["worlds"].items()), key=lambda x: x[0]) if w.get("steady")]
    gaps = load(results, H3_GAPS_JSON)
    idle = []
    if gaps and (gaps.get("gaps") or {}).get("resolutions", {}).get(res):
        g = gaps["gaps"]
        for n, w in sorted(((int(n), w) for n, w in g["resolutions"][res]["worlds"].items()), key=lambda x: x[0]):
            idle.append(f"N = {n}: {w['kernels_per_block']:.0f} kernels, GPU busy {f_ms_from_s(w['busy_s_per_block'])} ms, idle "
                        f"{f_ms_from_s(w['idle_s_per_block'])} ms per block, host syncs: "
                        f"{'none' if not w['host_syncs'] else len(w['host_syncs'])}"
                        f"{'' if w.get('sync_detector_saw_control') else ' (detector unverified)'}")
    out += ["", "Each op timed alone (profiler kernel time, inputs may sit in L2, so ops run a little faster than inside a "
                "block). Excess: per-block time at N minus the N = 1 time / N; what does not shrink with N. "
                "Eight blocks back to back, per block: " + "; ".join(steady) + f". Method (from the JSON): {sec.get('note', '?')}."]
    if idle:
        out += ["", f"Idle time between kernels over {gaps['gaps']['repeat']} blocks back to back (profiler, shared adaLN, "
                    f"`{H3_GAPS_JSON}`; host syncs checked with torch.cuda's sync debug mode, which flags a known `.item()`): "
                    + "; ".join(idle) + "."]
    return out


ATTN_BACKENDS = (("flash", "flash"), ("efficient", "memory-efficient"), ("cudnn", "cuDNN"))


def t_kernels(results):
    # the newest run with a kernels section (the budget run measured them again with the 8-byte-word pack)
    found = [(name, d) for name in (H3_BUDGET_JSON, H3_JSON) for d in [load(results, name)] if d and (d.get("kernels") or {}).get("results")]
    if not found:
        raise Skip(f"neither {H3_BUDGET_JSON} nor {H3_JSON} has a 'kernels' section")
    kernels_json, d = found[0]
    k = d["kernels"]
    res = k["results"]
    shape = f"S={f_int(k.get('seq'))}, {k.get('heads', '?')} heads x {k.get('head_dim', '?')}, bf16"
    machine = gpu_machine(d)

    def ms(key):
        v = res.get(key)
        if isinstance(v, str):
            return "unavailable"
        return f_ms_from_s(v)

    out = []
    # attention backends
    if any(key.startswith("sdpa_") for key in res):
        out += [caption(f"Kernel choices, attention ({shape}), milliseconds.", kernels_json, machine), ""]
        rows = [[label, ms(f"sdpa_{name}_strided_qkv_views"), ms(f"sdpa_{name}_contiguous")] for name, label in ATTN_BACKENDS]
        if "h3_kernels_attention" in res:
            rows.append(["`minimax_h3.kernels.attention` (cuDNN-first, as used)", ms("h3_kernels_attention"), "—"])
        if "comfy_optimized_attention" in res:
            rows.append(["ComfyUI `optimized_attention`", ms("comfy_optimized_attention"), "—"])
        out += table(["SDPA backend", "strided q/k/v views ms", "contiguous q/k/v ms"], rows)
    else:
        out.append("<!-- attention kernel table skipped: no sdpa_* results -->")
    # fused RMSNorm + rope
    if "rms_rope_fused_kitchen_s" in res or "rms_rope_torch_reference_s" in res:
        fused, ref = res.get("rms_rope_fused_kitchen_s"), res.get("rms_rope_torch_reference_s")
        out += ["", caption(f"Kernel choices, per-head RMSNorm + rope on q and k ({shape}), milliseconds.", kernels_json, machine), ""]
        out += table(["fused (comfy_kitchen) ms", "torch reference ms", "speed-up"],
                     [[ms("rms_rope_fused_kitchen_s"), ms("rms_rope_torch_reference_s"),
                       f_speedup(ref / fused) if _num(ref) and _num(fused) and fused else "—"]], ["r"] * 3)
    else:
        out += ["", "<!-- rms+rope kernel table skipped: no rms_rope_* results -->"]
    # q|k|v pack per N
    packs = sorted({int(m.group(1)) for key in res for m in [re.fullmatch(r"qkv_pack_(?:cat|one_copy)_N(\d+)_s", key)] if m})
    if packs:
        out += ["", caption(f"Kernel choices, packing q|k|v head slices for the all-to-all (S/N rows, {shape}), milliseconds.",
                            kernels_json, machine), ""]
        rows = []
        words = any(key.startswith("qkv_pack_one_copy_bf16_elements_") for key in res)
        for n in packs:
            cat, one = res.get(f"qkv_pack_cat_N{n}_s"), res.get(f"qkv_pack_one_copy_N{n}_s")
            rows.append([n, ms(f"qkv_pack_cat_N{n}_s")] + ([ms(f"qkv_pack_one_copy_bf16_elements_N{n}_s")] if words else [])
                        + [ms(f"qkv_pack_one_copy_N{n}_s"), f_speedup(cat / one) if _num(cat) and _num(one) and one else "—"])
        out += table(["N", "torch.cat of slices ms"] + (["one copy of bf16 elements ms"] if words else [])
                     + ["one copy (pack_heads" + (", 8-byte words" if words else "") + ") ms", "speed-up over cat"], rows)
    else:
        out += ["", "<!-- q|k|v pack table skipped: no qkv_pack_cat_N*/qkv_pack_one_copy_N* results -->"]
    return out


def t_parallel(results):
    d, rows_in = _section(results, PARALLEL_JSON, "results")
    out = [caption("comfy/parallel costs on CPU (gloo): start-up to ready and op round trips.", PARALLEL_JSON, cpu_machine(d)), ""]
    header = ["N", "start-up to ready s (mean)", "min–max s", "spawn + import s", "rendezvous + probe + setup ms",
              "empty op ms mean / p50 / p95", "op with 4 KiB input ms mean / p50 / p95", "close s"]
    rows = []
    for r in rows_in:
        st = r.get("startup_s") or {}
        ph = st.get("phase_means") or {}
        fixed = [ph.get(k) for k in ("rendezvous", "probe", "setup")]
        e = r.get("empty_op_round_trip_ms") or {}
        f4 = r.get("op_with_4KiB_input_round_trip_ms") or {}

        def trip(s):
            return " / ".join(f_ms(s.get(k)) for k in ("mean", "p50", "p95")) + (f" (n={s['n']})" if "n" in s else "")

        n_starts = len(st.get("samples") or [])
        rows.append([r.get("world_size", "?"), f_s(st.get("mean")) + (f" (n={n_starts})" if n_starts else ""),
                     f"{f_s(st.get('min'))}–{f_s(st.get('max'))}", f_s(ph.get("spawn_and_import")),
                     f_ms(sum(fixed) * 1e3) if all(_num(x) for x in fixed) else "—", trip(e), trip(f4),
                     f_s((r.get("close_s") or {}).get("mean"))])
    out += table(header, rows)
    la = d.get("load_average_1_5_15min") or {}
    if la.get("before") and la.get("after"):
        out += ["", "Load average (1/5/15 min) before: " + " / ".join(fmt(x, 2) for x in la["before"])
                + ", after: " + " / ".join(fmt(x, 2) for x in la["after"])
                + (f" ({la['note']})." if la.get("note") else ".")]
    return out


def t_snapshot(results):
    d, snap = _section(results, SNAPSHOT_JSON, "snapshot")
    lora = d.get("lora") or {}
    what = d.get("benchmark") or "patch snapshot"
    med = f", median of {d['median_of']}" if d.get("median_of") else ""
    machine = cpu_machine(d)
    out = [caption(f"Patch snapshot costs: {what}{med}.", SNAPSHOT_JSON, machine), ""]
    rows = [["snapshot capture (hash every tensor)", f_s(snap.get("capture_s")), f"manifest {f_bytes(snap.get('manifest_json_bytes'))}"],
            ["capture again, with the previous snapshot's hashes", f_s(snap.get("capture_again_with_previous_s")), "—"],
            ["worker read (hash every received tensor against its name)", f_s(snap.get("worker_read_s")), "—"]]
    bp = d.get("bytes_path") or {}
    if bp:
        rows += [["to bytes (safetensors), for a worker in another process", f_s(bp.get("encode_s")), f_bytes_exact(bp.get("safetensors_bytes"))],
                 ["from bytes", f_s(bp.get("decode_s")), "—"]]
    delta = d.get("strength_change_one_block") or {}
    if delta:
        ck = f", {delta['changed_keys']} keys" if "changed_keys" in delta else ""
        rows.append([f"strength change in one block: diff{ck}", f_s(delta.get("diff_s")),
                     f"manifest {f_bytes(delta.get('manifest_json_bytes'))}, tensors {f_int(delta.get('tensor_bytes'))} B"])
    if lora:
        rows.append([f"LoRA payload ({lora.get('keys', '?')} keys, rank {lora.get('rank', '?')}, {lora.get('factor_dtype', '?')}, "
                     f"{lora.get('tensors', '?')} tensors)", "—", f_bytes_exact(lora.get("tensor_bytes"))])
    out += table(["step", "time s", "bytes"], rows)
    w = d.get("worker") or {}
    ext_key = next((k for k in w if re.fullmatch(r"extrapolated_\d+", k)), None)
    if w:
        n_ext = ext_key.split("_")[1] if ext_key else "?"
        ext = w.get(ext_key) or {}
        labels = (("worker_to_patcher_s", "worker: to_patcher (digest, keys and shapes checked; base ModelPatcher cloned, add_patches)"),
                  ("worker_patch_model_s", "worker: ComfyUI patch_model() of that clone"),
                  ("rank0_patch_model_s", "rank 0: ComfyUI patch_model() of the same patches, for scale"),
                  ("worker_strength_change_read_apply_s", "worker: strength change, read and apply"))
        out += ["", caption(f"Patch snapshot on the worker side: measured on {w.get('measured_keys', '?')} keys, scaled to {n_ext}.",
                            SNAPSHOT_JSON, machine), ""]
        out += table(["step", f"measured s ({w.get('measured_keys', '?')} keys)", f"scaled s ({n_ext} keys)"],
                     [[label, f_s(w.get(key)), fmt(ext.get(key), 1) if key in ext else "—"] for key, label in labels if key in w])
        if "worker_matches_rank0_patch_model" in w:
            out += ["", f"The worker's merged weights equal rank 0's patch_model() bit for bit: {w['worker_matches_rank0_patch_model']}."]
    notes = d.get("notes") or []
    if notes:
        out += ["", "Notes (from the JSON): " + "; ".join(notes) + "."]
    return out


def _flatten_counts(x, prefix=""):
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _flatten_counts(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(x, int) and not isinstance(x, bool):
        yield prefix, x


def t_patch_check(results):
    d = load(results, PATCH_CHECK_JSON)
    if d is None:
        return []  # optional: produced elsewhere; absent means no table, silently
    if not isinstance(d, dict):
        raise Skip(f"{PATCH_CHECK_JSON} is not an object")
    src = d.get("counts") if isinstance(d.get("counts"), dict) else {k: v for k, v in d.items() if k != "machine"}
    counts = list(_flatten_counts(src))
    if not counts:
        raise Skip(f"{PATCH_CHECK_JSON} holds no counts")
    what = d.get("what") or d.get("description") or "patch check"
    base = d.get("base") or d.get("comfyui_base")
    machine = f"base {base}" if isinstance(base, str) else "counts, no machine dependence"
    out = [caption(f"Patch series check: {what}.", PATCH_CHECK_JSON, machine), ""]
    out += table(["count", "value"], [[f"`{k}`", f"{v:,}"] for k, v in counts])
    return out


def t_fusions(results):
    d, f = _section(results, H3_PROFILE_JSON, "fusions", "results")
    r = f["results"]
    shape = f"{f_int(f.get('seq'))} x {f.get('hidden')} bf16, {len(f.get('segments', []))} mod segments"
    out = [caption(f"RMSNorm + adaLN modulation, fused vs unfused ({shape}), one call; error vs an fp32 reference.",
                   H3_PROFILE_JSON, gpu_machine(d)), ""]
    out += table(["variant", "ms", "rel L2 error vs fp32"],
                 [["unfused: RMSNorm, then per segment mul_ and add_ (upstream's ops)", f_ms_from_s(r.get("norm_modulation_unfused_s")),
                   f_sci(r.get("norm_modulation_unfused_rel_err_vs_fp32"))],
                  ["fused: comfy_kitchen rms_adaln, norm weight folded into the scale (ours on CUDA)",
                   f_ms_from_s(r.get("norm_modulation_fused_s")), f_sci(r.get("norm_modulation_fused_rel_err_vs_fp32"))],
                  ["parts: RMSNorm alone", f_ms_from_s(r.get("rms_norm_only_s")), "—"],
                  ["parts: mul_ + add_ on one segment of all rows", f_ms_from_s(r.get("mul_add_one_segment_s")), "—"],
                  ["parts: one addcmul on one segment of all rows", f_ms_from_s(r.get("addcmul_one_segment_s")), "—"],
                  ["parts: one rms_adaln pass over all rows", f_ms_from_s(r.get("kitchen_rms_adaln_one_pass_s")), "—"],
                  ["not fused: SwiGLU silu(gate) * up", f_ms_from_s(r.get("swiglu_silu_mul_s")), "—"],
                  ["removed: v.clone() before our own SDPA", f_ms_from_s(r.get("v_clone_s")), "—"]], ["l", "r", "r"])
    out += ["", "Times include the host's launch cost of each variant's small kernels (each call timed alone)."]
    return out


def t_accuracy_profile(results):
    name = H3_PROFILE_JSON
    d = load(results, name)
    if d is None or "accuracy" not in d:
        raise Skip(f"{name} not found or has no 'accuracy' section")
    acc = d["accuracy"]["results"]
    out = [caption("Attention backend accuracy (relative L2 error vs fp64, bf16 inputs) and one bf16 DiT block "
                   "(update x_out - x_in) vs the same block in fp32.", name, gpu_machine(d)), ""]
    out += table(["quantity", "flash", "cuDNN", "memory-efficient"],
                 [["attention, S = 15,356, 56 x 128 heads", f_sci(acc.get("attention_flash_bf16_rel_err")),
                   f_sci(acc.get("attention_cudnn_bf16_rel_err")), f_sci(acc.get("attention_efficient_bf16_rel_err"))],
                  ["one DiT block (layer 0 weights)", f_sci(acc.get("block_flash_bf16_rel_err_vs_fp32")),
                   f_sci(acc.get("block_cudnn_bf16_rel_err_vs_fp32")), "—"]])
    prof = (d.get("profile") or {}).get("ours")
    if prof:
        kernels = [r for r in prof["top"] if not r["name"].startswith(("aten::", "Command Buffer"))]
        groups = {"GEMM (nvjet / cuBLAS)": ("nvjet", "gemm"), "attention (cuDNN)": ("cudnn",),
                  "fused RMSNorm + rope (comfy_kitchen)": ("rope_kernel",), "fused RMSNorm + adaLN (comfy_kitchen)": ("adaln",),
                  "RMSNorm": ("layer_norm",)}
        rows, seen = [], set()
        for label, keys in groups.items():
            ms = sum(r["device_ms"] for r in kernels if any(k in r["name"] for k in keys) and r["name"] not in seen)
            seen |= {r["name"] for r in kernels if any(k in r["name"] for k in keys)}
            rows.append([label, f_ms(ms)])
        rows.append(["elementwise (modulation, gates, SwiGLU, copies)", f_ms(sum(r["device_ms"] for r in kernels if r["name"] not in seen))])
        rows.append(["all kernels", f_ms(sum(r["device_ms"] for r in kernels))])
        out += ["", f"Where one step of ours goes ({d['profile'].get('resolution')}, torch profiler, kernel time in ms, "
                    "top kernels only):", ""]
        out += table(["kernels", "ms per step"], rows)
    return out


def t_cpu_native(results):
    name = "h3_cpu_native.json"
    d = load(results, name)
    if d is None or "runs" not in d:
        raise Skip(f"{name} not found")
    m = d.get("machine", {})
    cfg = d.get("config", {})
    out = [caption(f"H3 forward on CPU, small config (hidden {cfg.get('hidden_size')}, {cfg.get('num_layers')} blocks), "
                   "ours vs upstream, each run in its own process, interleaved.", name,
                   f"{m.get('cpus', '?')} CPU cores, Python {m.get('python', '?')}, load average {fmt(m.get('load_avg', [None])[0], 2)}"), ""]
    rows = [[i + 1, r["impl"], f_s(r["median_s"]), f_s(r["min_s"]), r["n"], fmt(r["peak_rss_mib"], 1)] for i, r in enumerate(d["runs"])]
    out += table(["run", "implementation", "median s", "min s", "n", "peak RSS MiB"], rows)
    out += ["", f"Outputs identical: {d.get('same_output')}; ratio of the best medians ours / upstream "
                f"{f_ratio(d.get('ratio_ours_over_upstream'))} (process-to-process spread on this VM is larger than the difference)."]
    return out


LORA_JSON = "lora_sync_h200.json"
LORA_STEPS = (("first_load", "LoRA load"), ("strength_change", "strength 1.0 -> 0.5"), ("swap", "LoRA swap"), ("clear", "clear"))


def _ms(x):
    return fmt(x * 1e3, 0) if _num(x) else "—"


def _two(a, b):
    """A value of the first run and of the second ("a / b"), or the one there is."""
    return " / ".join(_ms(v) for v in (a, b) if _num(v)) or "—"


def t_inprocess(results):
    d, sec = _section(results, INPROCESS_JSON, "resolutions")
    d2 = load(results, INPROCESS_RR_JSON) or {}
    rr = d2.get("resolutions") or {}
    default_interval = (d2.get("machine") or {}).get("gil_switch_interval_s")
    procs = ((d.get("processes") or {}).get("results")) or {}
    header = ["resolution (WxHxF)", "tokens", "N", "bar: native step / N", "one rank, one thread", "N processes, per rank (max)",
              "N threads", "bar / N threads", "one thread, N ranks in turn", "N threads, CUDA graphs", "bar / N threads, graphs",
              "one thread in turn, graphs", "GPU busy with N threads (projected)"]
    rows, checks, idle, cpu, switch = [], [], [], [], []
    for res, r in sec.items():
        step = (r.get("native") or {}).get("step_s")
        for n, w in _worlds(r):
            w2 = ((rr.get(res) or {}).get("worlds") or {}).get(str(n)) or {}
            bar = step / n if _num(step) else None
            solo, solo2 = (w.get("solo") or {}), (w2.get("solo") or {})
            thr, thr2 = (w.get("threads") or {}), (w2.get("threads") or {})
            gr, gr2 = (w.get("graphs") or {}), (w2.get("graphs") or {})
            p = (procs.get(res) or {}).get(str(n)) or {}
            worst = max((v for v in (thr.get("host_group_per_step_s"), thr2.get("host_group_per_step_s")) if _num(v)), default=None)
            worst_g = max((v for v in (gr.get("host_group_per_step_s"), gr2.get("host_group_per_step_s")) if _num(v)), default=None)
            rank_gpu = solo.get("rank_step_s")
            busy = min(1.0, rank_gpu / worst) if _num(rank_gpu) and _num(worst) and worst else None
            rows.append([res, f_int(r.get("tokens")), n, _ms(bar), _two(solo.get("host_per_rank_step_s"), solo2.get("host_per_rank_step_s")),
                         f"{_ms(p.get('per_rank_median_s'))} ({_ms(max(p['per_rank_s']))})" if p.get("per_rank_s") else "—",
                         _two(thr.get("host_group_per_step_s"), thr2.get("host_group_per_step_s")),
                         f_speedup(bar / worst) if _num(bar) and _num(worst) else "—",
                         _ms((w2.get("round_robin") or {}).get("host_group_per_step_s")),
                         _two(gr.get("host_group_per_step_s"), gr2.get("host_group_per_step_s")),
                         f_speedup(bar / worst_g) if _num(bar) and _num(worst_g) else "—",
                         _ms(gr2.get("round_robin_host_group_per_step_s")), f"{busy * 100:.0f}%" if _num(busy) else "—"])
            diffs = [w.get("check_rel_diff_vs_native_2_blocks"), gr.get("check_rel_diff_vs_eager_threads"),
                     (w2.get("round_robin") or {}).get("check_rel_diff_vs_threads"), gr2.get("round_robin_check_rel_diff_vs_eager_threads")]
            checks += [v for v in diffs if _num(v)]
            if _num(thr.get("free_step_wall_s")) and _num(gr.get("free_step_wall_s")):
                idle.append(f"{res} N = {n}: {f_s(thr['free_step_wall_s'])} s vs {f_s(gr['free_step_wall_s'])} s")
            if _num(thr2.get("cpu_per_rank_step_s")) and _num(solo2.get("cpu_per_rank_step_s")):
                cpu.append(f"{res} N = {n}: {_ms(thr2['cpu_per_rank_step_s'])} vs {_ms(solo2['cpu_per_rank_step_s'])}")
            if thr2.get("switch_interval"):
                vals = {float(k): v.get("host_group_per_step_s") for k, v in thr2["switch_interval"].items()}
                if _num(default_interval):
                    vals[default_interval] = thr2.get("host_group_per_step_s")
                switch.append(f"{res} N = {n}: " + ", ".join(f"{k * 1e3:g} ms: {_ms(vals[k])}" for k in sorted(vals)))
    names = INPROCESS_JSON + (f", {INPROCESS_RR_JSON}" if rr else "")
    out = [caption("The in-process alternative (core's MultiGPU design: one Python thread per GPU in one process) for H3 "
                   "Ulysses, measured on ONE GPU: host time to enqueue one step's share on every GPU, ms per step (50 blocks), "
                   "against one GPU's share of the native step. All-to-alls EMULATED; keeping N GPUs fed is a projection: "
                   "no multi-GPU measurement exists yet.", names, gpu_machine(d)), ""]
    out += table(header, rows)
    m = d.get("machine") or {}
    out += ["", "Bar: upstream's native step on one GPU (flash-first, its default order) / N, what one GPU computes per step. "
                "Host times are enqueue times, measured block by block with the GPU idle at each block's start, summed over "
                "the step; the N threads' time runs from the first thread's start to the last one's end of each block (what "
                "feeds all N GPUs), and cells with two values are two runs (the second file). bar / host above 1: the host "
                "keeps N GPUs fed, by that margin (the worse run); below 1 the GPUs wait. Processes skip the host exchange "
                "(NCCL moves the bytes without the host). One thread in turn: one Python thread drives every rank, each "
                "rank's block a generator yielding at its exchanges: no barrier, no GIL hand-off. Graphs: each rank's step "
                "captured as 101 CUDA graphs cut at its 100 exchanges (the peer copies inside, barriers and events between). "
                "GPU busy: one rank's step alone on the GPU over the N threads' host time. "
                f"Python {m.get('python', '?')} with the GIL, switch interval {fmt((m.get('gil_switch_interval_s') or 0) * 1e3, 0)} ms, "
                f"{m.get('cpus', '?')} CPU cores."]
    notes = []
    cudnn = [(res, r["native"]["step_s_cudnn_first"]) for res, r in sec.items() if _num((r.get("native") or {}).get("step_s_cudnn_first"))]
    if cudnn:
        notes.append("with cuDNN-first attention the native step is shorter and the bar lower: " + "; ".join(
            f"{res} {f_s(t)} s, bar " + " / ".join(_ms(t / n) for n, _ in _worlds(sec[res])) + " ms at N = "
            + " / ".join(str(n) for n, _ in _worlds(sec[res])) for res, t in cudnn))
    if checks:
        same = "bitwise equal" if max(checks) == 0 else f"max relative difference {f_sci(max(checks))}"
        notes.append(f"checks: the sharded blocks (threads, round robin, graphs) against the native blocks (2) and against each "
                     f"other (the whole step): {same} in all {len(checks)} comparisons")
    if cpu:
        notes.append("the threads' CPU time per rank-step (ms) vs one rank alone, where wall time is far higher: " + "; ".join(cpu))
    if switch:
        notes.append("N threads at other GIL switch intervals: " + "; ".join(switch))
    if idle:
        notes.append("the one shared GPU's wall time per step with N eager threads vs the same step from CUDA graphs "
                     "(its idle time is the difference): " + "; ".join(idle))
    if notes:
        out += ["", ". ".join(n[0].upper() + n[1:] for n in notes) + "."]
    out += ["", f"Method (from the JSON): {d.get('method', '?')}"]
    return out


def t_lora_sync(results):
    """A LoRA change on a worker (GPU backups, ComfyUI's arithmetic) beside ComfyUI's default path (rank 0)."""
    r = load(results, LORA_JSON)
    if r is None:
        raise Skip(f"{LORA_JSON} not found")
    w, c, m = r["worker"], r["comfyui_rank0"], r["machine"]
    lmg = {row["step"]: row["load_models_gpu_s"] for row in c["load_models_gpu"]}
    out = [caption(f"LoRA sync at H3 scale ({r['model']['parameters'] / 1e9:.1f} B parameters, bf16, "
                   f"{r['model']['weights_gib']} GiB; rank-{r['lora']['rank']} LoRA on 208 linears; worker medians of "
                   f"{len(w['changes']) // 4} rounds, ComfyUI one round; rank 0 and a worker as two processes one after "
                   "the other on one GPU, the transfer between GPUs not included).", LORA_JSON,
                   f"{m['gpu']}, torch {m['torch']}"), ""]
    rows = []
    for key, label in LORA_STEPS:
        st = w["changes_median"][key]
        rows.append([label, f_s(lmg[key]), f_s(st["worker_total_s"]), f"{f_s(st['decode_s'])} / {f_s(st['load_s'])}",
                     f_s(st["rank0_capture_encode_s"]), f_bytes(st["tensor_bytes_sent"]) if st["tensor_bytes_sent"] else "0"])
    out += table(["change", "ComfyUI load_models_gpu s (rank 0; workers before)", "worker now s", "worker: decode / merge s",
                  "rank 0: capture + encode s", "tensor bytes sent"], rows)
    d, step = c["direct"], w["step"]
    backups = max(row["backup_gib"] for row in w["changes"])
    out += [""] + table(["", "ComfyUI (rank 0; workers before)", "worker now"], [
        ["patch_model() / unpatch_model() / strength change, called directly, s",
         f"{f_s(d['patch_model_s'])} / {f_s(d['unpatch_model_s'])} / {f_s(d['strength_change_s'])}", "—"],
        ["backups of the 208 patched weights", f"{d['host_backup_gib']:.1f} GiB in host RAM",
         f"{backups:.1f} GiB on the GPU (the original weights, no copy)"],
        ["peak host RSS of the process (VmHWM)", f"{c['peak']['VmHWM'] / 2**30:.1f} GiB", f"{w['rss_before_mmap']['VmHWM'] / 2**30:.1f} GiB"]])
    out += ["", f"Per step at {step['resolution']} ({step['tokens']:,} tokens), interleaved, median of "
                f"{len(step['times_s']['base'])}: base weights {f_s(step['base_median_s'])} s; merged (worker) "
                f"{f_s(step['merged_median_s'])} s ({step['merged_overhead_pct']:+.1f} %); forward-time patches "
                f"(DynamicVRAM's per-step work) {f_s(step['forward_time_patches_median_s'])} s "
                f"({step['forward_time_patches_overhead_pct']:+.1f} %). Restoring base weights from a page-cached "
                f"safetensors file instead: {w['mmap_restore']['gb_per_s']} GB/s, "
                f"{w['mmap_restore']['restore_s_extrapolated_208']} s for the 208 keys before any merge."]
    return out


SECTIONS = {  # name: (title in a skipped-table comment, function of the results folder)
    "index": ("results index", t_index),
    "native": ("H3 native forward", t_native),
    "native_brief": ("H3 native forward", lambda results: t_native(results, brief=True)),
    "cpu_native": ("H3 native forward on CPU", t_cpu_native),
    "accuracy": ("H3 accuracy and step profile", t_accuracy_profile),
    "scaling": ("sequence-parallel scaling", t_scaling),
    "scaling_brief": ("sequence-parallel scaling", lambda results: t_scaling(results, brief=True)),
    "budget": ("per-rank block budget", t_budget),
    "fusions": ("RMSNorm + adaLN fusion", t_fusions),
    "segments": ("modulation segment redo", t_segments),
    "kernels": ("kernel choices", t_kernels),
    "attention_ab": ("attention call A/B", t_attention_ab),
    "parallel": ("comfy/parallel costs", t_parallel),
    "snapshot": ("patch snapshot costs", t_snapshot),
    "lora_sync": ("LoRA sync at H3 scale", t_lora_sync),
    "patch_check": ("patch check", t_patch_check),
    "inprocess": ("in-process threads vs processes", t_inprocess),
}
README_TABLES = ("native_brief", "scaling_brief")
APPENDIX_TABLES = ("native", "cpu_native", "accuracy", "scaling", "budget", "inprocess", "parallel", "snapshot", "lora_sync",
                   "patch_check")
BENCH_TABLES = ("index", "native", "cpu_native", "accuracy", "scaling", "budget", "inprocess", "fusions", "segments", "kernels",
                "attention_ab", "parallel", "snapshot", "lora_sync", "patch_check")


def tables_for(path):
    """The table names a target file gets."""
    path = Path(path).resolve()
    if path == README.resolve():
        return README_TABLES
    if path == BENCH_README.resolve():
        return BENCH_TABLES
    return APPENDIX_TABLES


def plot_links(results, target_dir):
    """Markdown images for the plots whose data exists, relative to the file they go into."""
    links = []
    for alt, name, have in (("H3 native forward, ours vs upstream, both flash-first", PLOT_NATIVE, lambda: _section(results, H3_JSON, "native")),
                            ("sequence-parallel speed-up vs N, emulated on one GPU", PLOT_SCALING,
                             lambda: _runs(results, H3_PREP_JSONS))):
        try:
            have()
        except Skip:
            continue
        rel = os.path.relpath(Path(results) / name, target_dir).replace(os.sep, "/")
        links.append(f"![{alt}]({rel})")
    return links


def generate(results=RESULTS, target_dir=ROOT, names=APPENDIX_TABLES):
    """The text that goes between the markers of a file in target_dir (starts and ends with a newline)."""
    lines = ["<!-- generated by bench/tables.py from bench/results/*.json: edit those, then run the script -->"]
    for name in names:
        title, fn = SECTIONS[name]
        try:
            part = fn(results)
        except Skip as e:
            part = [f"<!-- {title}: table skipped ({e}) -->"]
        except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError) as e:
            part = [f"<!-- {title}: table skipped (unexpected JSON structure: {type(e).__name__} {e}) -->"]
        if part:
            lines += [""] + part
    if names == BENCH_TABLES:
        links = plot_links(results, target_dir)
        if links:
            lines += ["", "Plots (`python bench/tables.py --plots`): " + " ".join(links)]
    return "\n" + "\n".join(lines) + "\n"


# ---------------------------------------------------------------- markers

def splice(text, block):
    """text with everything between the markers replaced by block; None when the markers are missing."""
    i = text.find(BEGIN)
    if i < 0:
        return None
    j = text.find(END, i + len(BEGIN))
    if j < 0:
        return None
    return text[:i + len(BEGIN)] + block + text[j:]


def current_block(text):
    i = text.find(BEGIN)
    j = text.find(END, i + len(BEGIN)) if i >= 0 else -1
    return None if i < 0 or j < 0 else text[i + len(BEGIN):j]


def read_text(path):
    with open(path, encoding="utf-8", newline="") as f:
        return f.read()


def write_into(path, results, check=False):
    """Write (or with check, compare) the generated section of path. Returns 'ok', 'changed', 'stale' or 'skipped'."""
    path = Path(path)
    if not path.is_file():
        print(f"{path}: no such file, skipped")
        return "skipped"
    text = read_text(path)
    block = generate(results, path.resolve().parent, tables_for(path))
    new = splice(text, block)
    if new is None:
        print(f"{path}: no {BEGIN} ... {END} markers, skipped")
        return "skipped"
    if new == text:
        print(f"{path}: tables up to date")
        return "ok"
    if check:
        old = current_block(text) or ""
        diff = difflib.unified_diff(old.splitlines(), block.splitlines(), "in file", "generated now", lineterm="", n=1)
        rerun = "" if path.resolve() in (README.resolve(), BENCH_README.resolve()) else f" --into {path}"
        print(f"{path}: generated tables are out of date (run python bench/tables.py{rerun}):")
        print("\n".join(list(diff)[:40]))
        return "stale"
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write(new)
    print(f"{path}: tables written")
    return "changed"


# ---------------------------------------------------------------- plots

def make_plots(results=RESULTS):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: plots skipped (pip install matplotlib; it is not a project dependency)")
        return []
    results, written, meta = Path(results), [], {"Software": None}
    try:
        d, native = _section(results, H3_JSON, "native")
    except Skip as e:
        print(f"native plot skipped: {e}")
    else:
        machine = gpu_machine(d).split(" (run started")[0]
        res_names = list(native)
        # like for like only: both in the base's attention order (flash first)
        series = [("upstream, flash-first", [best_median(native[r], "upstream") for r in res_names], "#7f7f7f"),
                  ("ours, flash-first", [native[r]["ours_flash"]["median_s"] for r in res_names], "#1f77b4")]
        fig, ax = plt.subplots(figsize=(9, 5.2))
        width = 0.8 / len(series)
        for i, (label, vals, color) in enumerate(series):
            xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(res_names))]
            bars = ax.bar(xs, vals, width, label=label, color=color, edgecolor="#404040", linewidth=0.6)
            ax.bar_label(bars, labels=[f"{v:.3f}" for v in vals], fontsize=8, padding=2)
        ax.set_xticks(range(len(res_names)))
        ax.set_xticklabels([f"{r}\n{native[r]['tokens']:,} tokens" for r in res_names])
        ax.set_ylabel("forward time per step (s, median)")
        ax.set_xlabel("resolution (W x H x frames)")
        layers = (d.get("model") or {}).get("layers")
        ax.set_title(f"MiniMax H3 native forward{f' ({layers} blocks, bf16)' if layers else ''}, one GPU, same attention order"
                     f"\n{machine}", fontsize=11)
        ax.legend(fontsize=9, loc="upper left")
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
        ax.margins(y=0.12)
        fig.tight_layout()
        written.append(results / PLOT_NATIVE)
        fig.savefig(written[-1], dpi=120, metadata=meta)
        plt.close(fig)
    try:
        found = _runs(results, H3_PREP_JSONS)
    except Skip as e:
        print(f"scaling plot skipped: {e}")
        found = []
    panels = [(res, r, sec.get("repeat")) for _, _, sec in found for res, r in sec["resolutions"].items()]
    if panels:
        # top row: speed-up (log-log, so the ideal is a straight line); bottom row: speed-up / N, where the gaps show
        fig, axes = plt.subplots(2, len(panels), figsize=(5.4 * len(panels), 8.4), sharex=True, sharey="row", squeeze=False,
                                 gridspec_kw={"height_ratios": [3, 2]})
        c = run_chunks(found)
        for col, (res, r, repeat) in enumerate(panels):
            worlds = [(n, w, bw) for n, w, bw in _shared_worlds(r, c)]
            ns = [1] + [n for n, _, _ in worlds]
            bw = worlds[0][2] if worlds else "?"
            curves = [("no transfers (compute ceiling)", f"chunks{c}_no_comm_shared_adaln", "#2ca02c", "o", ":"),
                      (f"rank 0, {bw} GB/s", f"chunks{c}_bw{bw}_shared_adaln", "#000000", "D", "-"),
                      (f"last rank, {bw} GB/s", f"chunks{c}_bw{bw}_shared_adaln_last_rank", "#1f77b4", "s", "--")]
            for ax, scale in ((axes[0][col], lambda n, v: v), (axes[1][col], lambda n, v: 100 * v / n)):
                ax.plot(ns, [scale(n, n) for n in ns], color="#999999", linestyle="--", label="ideal (N)")
                for label, key, color, marker, ls in curves:
                    pts = [(1, 1.0)] + [(n, _speedup(w, key)) for n, w, _ in worlds if _num(_speedup(w, key))]
                    ax.plot([n for n, _ in pts], [scale(n, v) for n, v in pts], marker=marker, linestyle=ls, color=color, label=label)
                ax.grid(alpha=0.3)
            top, bottom = axes[0][col], axes[1][col]
            top.set_xscale("log", base=2)
            top.set_yscale("log", base=2)
            top.set_yticks(ns)
            top.set_yticklabels([str(n) for n in ns])
            top.set_title(f"{res} ({r.get('tokens', 0):,} tokens), {repeat} blocks per timing", fontsize=10)
            bottom.set_xticks(ns)
            bottom.set_xticklabels([str(n) for n in ns])
            bottom.set_xlabel("N (sequence-parallel world size, emulated)")
            bottom.set_ylim(85, 101)
        axes[0][0].set_ylabel("emulated speed-up over one GPU (one DiT block)")
        axes[1][0].set_ylabel("speed-up / N (%)")
        axes[0][-1].legend(fontsize=8, loc="upper left")
        fig.suptitle("H3 sequence parallel, the series' Ulysses code as of these runs, EMULATED on one GPU (all-to-alls replaced by side-stream stand-ins);\n"
                     f"no multi-GPU measurement exists yet. {gpu_machine(found[0][1]).split(' (run started')[0]}", fontsize=11)
        fig.tight_layout()
        written.append(results / PLOT_SCALING)
        fig.savefig(written[-1], dpi=120, metadata=meta)
        plt.close(fig)
    for p in written:
        print(f"{p}: plot written")
    return written


# ---------------------------------------------------------------- command line

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=str(RESULTS), help="folder with the JSON results (default bench/results)")
    ap.add_argument("--into", action="append", default=[], metavar="PATH",
                    help="another Markdown file with the markers, e.g. the RFC (repeatable); skipped when it or its markers are absent")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when a generated section is out of date "
                                                         "or INDEX does not match bench/results/")
    ap.add_argument("--plots", action="store_true", help="also draw the PNG plots into the results folder (matplotlib)")
    ap.add_argument("--print", dest="print_only", action="store_true", help="print bench/README.md's generated section and exit")
    args = ap.parse_args(argv)

    if args.print_only:
        print(generate(args.results, BENCH_README.parent, BENCH_TABLES), end="")
        return 0
    if args.check:
        ok = True
        for path in [README, BENCH_README] + [Path(p) for p in args.into]:
            status = write_into(path, args.results, check=True)
            ok = ok and (status == "ok" or (status == "skipped" and path not in (README, BENCH_README)))
        for problem in index_problems(args.results):
            print(problem)
            ok = False
        for name in (PLOT_NATIVE, PLOT_SCALING):
            p = Path(args.results) / name
            if not p.is_file() and any(name in line for line in plot_links(args.results, BENCH_README.parent)):
                print(f"warning: {p} is linked but missing (python bench/tables.py --plots)")
        return 0 if ok else 1
    if args.plots:
        make_plots(args.results)
    for path in [README, BENCH_README] + [Path(p) for p in args.into]:
        write_into(path, args.results)
    for problem in index_problems(args.results):
        print(f"warning: {problem}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
