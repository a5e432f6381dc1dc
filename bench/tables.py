"""Markdown tables generated from bench/results/*.json and bench/peers.json.

    python bench/tables.py            # rewrite the generated blocks of README.md and bench/README.md
    python bench/tables.py --into rfc/0000-minimax-h3-sequence-parallel.md   # ... and another file's
    python bench/tables.py --check    # exit 1 when a block is stale or a JSON in bench/results/ is not in INDEX

Only the text between ``<!-- tables:begin -->`` and ``<!-- tables:end -->`` is replaced; everything else
in a target file stays byte-identical. README.md gets README_TABLES, bench/README.md BENCH_TABLES (with
the results index), any other file APPENDIX_TABLES. A target without the file or the markers is skipped
with a message (README.md or bench/README.md under --check: a failure). A table whose JSON or section is
missing becomes a comment line, never a crash. The output depends only on the JSON files, so --check is
reproducible. Superseded runs live in bench/results/archive/ and are in no table.
"""

import argparse
import collections
import difflib
import fnmatch
import json
import math
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
PEERS = ROOT / "bench" / "peers.json"
README = ROOT / "README.md"
BENCH_README = ROOT / "bench" / "README.md"
BEGIN = "<!-- tables:begin -->"
END = "<!-- tables:end -->"

EMULATION_JSON = "h3_gpu_emulation.json"
SHARED_JSON = "h3_gpu_shared.json"
USERS_JSON = "h3_gpu_users.json"
CONTROL_JSON = "h3_gpu_controlnet.json"
GPU_TEST_LOG = "h3_gpu_test.log"
SEAM_CUDA_JSON = "h3_h100_seam_cuda.json"
INPROCESS_JSON = "h3_h200_inprocess.json"
INPROCESS_RR_JSON = "h3_h200_inprocess_round_robin.json"
VAE_JSON = "h3_gpu_vae.json"
# the video sizes of bench/h3_vae_shared_gpu.py as the emulation's cases (the same latents)
VAE_CASES = {"832x480x121": "15k", "1344x768x243": "75k"}
E2E_STEPS = 30

# The speed-ups the project set itself as its bar: 38k tokens, NVLink, bf16 exchange.
BAR = {2: 1.9, 4: 3.7, 8: 7.0}
LINK_NAMES = {"nvlink": "device path, NVLink", "pcie5x16": "host path, PCIe 5 x16", "pcie4x16": "host path, PCIe 4 x16",
              "pcie3x8": "host path, PCIe 3 x8",
              "matched_3gpu": "matched to MultiStream's 3 GPUs", "matched_2gpu": "matched to MultiStream's 2 GPUs"}

# bench/README.md's index: results file (a glob) -> the command that writes it -> the question it answers.
# --check fails on a JSON in bench/results/ that no entry matches and on a named file that is missing; a
# glob that matches nothing (a run that may come back) is left out of the table.
DEVICE = "on the borrowed GPU through `bench/device/run.sh`"
INDEX = (
    (EMULATION_JSON, "`SECTIONS=\"shared emulation\" bash bench/device/run.sh` on the borrowed GPU; its emulation section runs "
                     "`h3_sp_emulation.py --latency-from h3_gpu_shared.json` in the patched tree",
     "How would the shipped code scale with N at NVLink and PCIe bandwidths, bf16 and fp8 exchange (EMULATED on one "
     "GPU), and how much communication is left exposed?"),
    (SHARED_JSON, f"`h3_shared_gpu.py --ranks 2,4,8 --layers 2` in the patched tree ({DEVICE}, section `shared`)",
     "With N real ranks on one GPU, does sharded H3 give the native output with bf16 and with fp8 exchange, and what "
     "do the transport's collectives cost?"),
    (CONTROL_JSON, f"`h3_shared_gpu.py --ranks 2 --layers 2 --control --skip-link` in the patched tree ({DEVICE}, "
                   "section `control`)",
     "What does a Fun ControlNet tower cost per forward sharded vs native, and is the sharded output the native one?"),
    (USERS_JSON, f"`h3_users_gpus.py --configs fp8_card22` and the uncapped run `--configs fp8_uncapped_dynamic_vram` "
                 f"({DEVICE}, section `users`; the JSON's `notes` say which code each ran)",
     "Does real-size H3 run on two ranks whose cards are smaller than its weights, at what GPU and host memory per rank?"),
    (GPU_TEST_LOG, "`pytest -m gpu tests-unit/comfy_extras_test/nodes_minimax_h3_parallel_gpu_test.py` in the patched "
                   f"tree ({DEVICE}, section `gpu_test`)",
     "Does the node's CUDA path (two ranks sharing one GPU, ComfyUI's loader, a LoRA, KSampler) match the workflow "
     "without the node?"),
    (SEAM_CUDA_JSON, "`h3_seam_cuda.py --out` in the base and in the base + 0001 tree (0001 at d901f09), then `--compare` "
                     f"({DEVICE.split(' through')[0]})",
     "Does patch 0001 change a number or a kernel on CUDA (every case of minimax_h3_cases.py)?"),
    (INPROCESS_JSON, "`h3_inprocess.py --check --cudnn-bar` (`COMFYUI_DIR`: the h3-newest base, upstream's own DiTBlock; run "
                     "by the script's first revision, which took the same measurements without the second file's additions)",
     "Can N Python threads in one process (core's MultiGPU design) keep N GPUs fed with H3 Ulysses, against one "
     "thread and N processes (host side, on one GPU; all-to-alls emulated)?"),
    (INPROCESS_RR_JSON, "`h3_inprocess.py --sections native,threads,graphs --native-reps 0 --no-free --round-robin --check "
                        "--switch-intervals 0.0005,0.05`",
     "The same again (a second run), plus one thread driving all N ranks in turn, the threads' CPU time and other GIL "
     "switch intervals: is it the GIL?"),
    ("h3_gpu_vae*.json", f"`h3_vae_shared_gpu.py` in the patched tree ({DEVICE}, section `vae`)",
     "Does H3's VAE decode shared out over N ranks give ComfyUI's decode at real size, at what GPU memory per rank, "
     "and what would the whole workflow (steps + decode) gain on N GPUs (EMULATED)?"),
    ("logs/*.log", "the command, commit and machine on each log's first line (`scripts/test.sh`, `bench/device/run.sh`)",
     "The runs that write no JSON: the one-process test run, the slow test tier, the data path's GPU tests, failures found on the GPU"),
    ("patch_check*.json", "`patches/check`", "Does the series apply to the base, pass our tests there, and regress none of ComfyUI's?"),
)


class Skip(Exception):
    """A table cannot be built from what the JSON holds."""


# ---------------------------------------------------------------- loading and formatting

def load(results, name):
    """The parsed JSON file (name relative to results, or a path), or None when absent; unreadable JSON raises Skip."""
    path = Path(results) / name
    if not path.is_file():
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise Skip(f"{path.name} unreadable: {e}")


def need(results, name, key):
    """(the JSON, its non-empty field `key`), else Skip."""
    d = load(results, name)
    if d is None:
        raise Skip(f"{name} not found")
    if not d.get(key):
        raise Skip(f"{name} has no '{key}'")
    return d, d[key]


def _num(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def fmt(x, digits):
    return f"{x:.{digits}f}" if _num(x) else "—"


def f_s(x):  # seconds; a sub-millisecond value keeps one significant digit instead of reading 0.000
    return f"{x:.1g}" if _num(x) and 0 < abs(x) < 0.0005 else fmt(x, 3)


def f_speedup(x):
    return fmt(x, 2)


def f_ms(x, digits=2):  # from seconds
    return fmt(x * 1e3, digits) if _num(x) else "—"


def _ms(x):  # from seconds, whole milliseconds
    return f_ms(x, 0)


def f_sci(x):
    return f"{x:.2e}" if _num(x) else "—"


def f_int(n):
    return f"{int(n):,}" if _num(n) else "—"


def yes(b):
    return {True: "yes", False: "no"}.get(b, "—")


def table(header, rows, align=None):
    """A Markdown table; align: 'l'/'r' per column (default: first left, the rest right)."""
    align = align or ["l"] + ["r"] * (len(header) - 1)
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" if a == "l" else "--:" for a in align) + " |"]
    return lines + ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]


def machine(d):
    """GPU, torch, CUDA and start of a run, from either JSON shape (top-level fields or a `machine` dict)."""
    m = d.get("machine") if isinstance(d.get("machine"), dict) else {}
    parts = [d.get("gpu") or m.get("gpu") or "GPU not recorded"]
    if d.get("torch") or m.get("torch"):
        parts.append(f"torch {d.get('torch') or m.get('torch')}")
    if m.get("cuda"):
        parts.append(f"CUDA {m['cuda']}")
    s = ", ".join(parts)
    return s + (f" (run started {d['started']})" if d.get("started") else "")


def card(d):
    """The GPU a run's JSON names, short ("H100", "H200"), or "GPU"."""
    m = d.get("machine") if isinstance(d.get("machine"), dict) else {}
    name = d.get("gpu") or m.get("gpu") or ""
    return next((w for w in name.split() if re.fullmatch(r"[A-Z]+\d+", w)), "GPU")


def caption(title, names, where, method=""):
    """The bold title, the method (optional), the source files and the machine."""
    names = [names] if isinstance(names, str) else names
    src = ", ".join(f"`{n}`" if n.startswith("bench/") else f"`bench/results/{n}`" for n in names)
    return f"**{title}**{' ' + method if method else ''} Source: {src}; {where}."


def _indexed(name):
    return any(fnmatch.fnmatch(name, pattern) for pattern, _, _ in INDEX)


def index_problems(results=RESULTS):
    """What --check reports about INDEX: JSON files it lacks, files it names that are missing."""
    results = Path(results)
    found = sorted(p.name for p in results.iterdir() if p.is_file()) if results.is_dir() else []
    problems = [f"bench/results/{n} is not in bench/tables.py's INDEX: add the command that writes it and its question"
                for n in found if n.endswith(".json") and not _indexed(n)]
    problems += [f"bench/tables.py's INDEX names {p}, which is not in bench/results/"
                 for p, _, _ in INDEX if not any(ch in p for ch in "*?[") and p not in found]
    return problems


# ---------------------------------------------------------------- the emulation (tables 1-3)

def emulation(results):
    d, cases = need(results, EMULATION_JSON, "cases")
    runs = [r for c in cases.values() for r in c.get("runs") or []]
    if not runs:
        raise Skip(f"{EMULATION_JSON} has no runs")
    chunks = min(r["chunks"] for r in runs)
    for c in cases.values():  # a run stopped mid-case has not written its last case's exposed seconds: the same difference
        for r in c.get("runs") or []:
            free = next((f for f in c["runs"] if (f["ranks"], f["chunks"], f["gbps"], shipped(f)) == (r["ranks"], r["chunks"], None, shipped(r))), None)
            if "exposed_comm_s" not in r and free is not None:
                r["exposed_comm_s"] = r["step_s"] - free["step_s"]
    return d, cases, chunks


def shipped(run):
    """Whether a run used the shipped q|k|v choice (runs from before the choice existed did)."""
    return run.get("qkv_choice", "auto") == "auto"


def run_of(case, n, link, exchange, chunks):
    return next((r for r in case.get("runs") or [] if r["ranks"] == n and r["link"] == link and r["exchange"] == exchange
                 and r["chunks"] == chunks and shipped(r)), None)


def qkv_text(d, cases):
    """How the run moved q|k|v, by N."""
    runs = [r for c in cases.values() for r in c.get("runs") or [] if shipped(r)]
    if not any("qkv" in r for r in runs):
        return (f"At {('commit ' + d['commit']) if d.get('commit') else 'the run'}, q|k|v went by all-to-all at every N: "
                "the hidden-row gather the shipped code uses at N = 2 and 3 is later and not in this run.")
    by = {mode: sorted({r["ranks"] for r in runs if r.get("qkv") == mode}) for mode in ("gather", "all_to_all")}
    return "; ".join(f"{label} at N = {' / '.join(map(str, by[mode]))}" for mode, label in
                     (("gather", "Hidden rows gathered"), ("all_to_all", "q|k|v by all-to-all")) if by[mode]) + "."


def ranks_of(case):
    return sorted({r["ranks"] for r in case.get("runs") or []})


def speedup(case, n, link, exchange, chunks):
    return (run_of(case, n, link, exchange, chunks) or {}).get("speedup")


def gbps_of(d, link):
    return (d.get("links_gbps") or {}).get(link) or ((d.get("peers") or {}).get(link) or {}).get("emulated_gbps")


def by_path(d):
    """Whether the emulation paced each column with the cost of the path it names (runs of the stream path on)."""
    lat = (d.get("collective_latency_s") or {}).values()
    return bool(lat) and all(isinstance(v, dict) for v in lat)


def link_label(d, link):
    gbps = gbps_of(d, link)
    name = LINK_NAMES.get(link, link)
    if not by_path(d):  # one transport paced every column: the column names a link, not a path
        name = name.split(", ", 1)[-1]
    return f"{name} {gbps:.3g} GB/s" if _num(gbps) else name


def latencies(d):
    lat = {int(n): s for n, s in (d.get("collective_latency_s") or {}).items()}
    ns = " / ".join(str(n) for n in sorted(lat))
    if all(isinstance(v, dict) for v in lat.values()):  # by data path
        text = "; ".join(f"{p} path " + " / ".join(f_ms(lat[n][p]) for n in sorted(lat)) + f" ms at N = {ns}"
                         for p in ("device", "host"))
        mid = all(n in lat for n in (2, 3, 4)) and all(abs(lat[3][p] - (lat[2][p] + lat[4][p]) / 2) < 1e-12 for p in ("device", "host"))
    else:
        text = " / ".join(f_ms(lat[n]) for n in sorted(lat)) + f" ms at N = {ns}"
        mid = all(n in lat for n in (2, 3, 4)) and abs(lat[3] - (lat[2] + lat[4]) / 2) < 1e-12
    return lat, text + ("; N = 3: the mean of 2 and 4" if mid else "")


def t_scaling(results):
    d, cases, chunks = emulation(results)
    links = list(d.get("links_gbps") or {})
    _, lat_text = latencies(d)
    method = (f"Rank 0's share of each denoising step runs for real: the patched tree's forward at H3's real width "
              f"(random bf16 weights; {d.get('layers_built', '?')} blocks built, the median block projected to "
              f"{d.get('blocks_projected', '?')}) through `ulysses.py`, {chunks} head chunks. Only its "
              "all-to-alls are replaced, by device copies of the same bytes paced to the link's bandwidth plus the "
              + ("measured cost per collective of the data path the column names (`collective_latency_s`: "
                 f"{lat_text}). The device path's link is NVLink between GPUs; its cost was measured with the ranks "
                 "sharing one GPU." if by_path(d) else
                 f"measured cost per collective of the threaded host transport in every column (`collective_latency_s`: "
                 f"{lat_text}): this run predates the stream path, so no column is the device path over NVLink; the "
                 "NVLink column is that transport paced at NVLink's bandwidth, which it cannot reach between GPUs.")
              + " " + qkv_text(d, cases))
    out = [caption(f"Sequence-parallel scaling, EMULATED on one {card(d)}: speed-up of a step over the "
                   "native step (N = 1).", EMULATION_JSON, machine(d), method), ""]
    header = ["case", "tokens", "N", "compute only (free link)"] + [f"{link_label(d, k)}, bf16" for k in links]
    fp8_link = "pcie3x8" if "pcie3x8" in links else links[-1]
    header.append(f"{link_label(d, fp8_link)}, fp8 exchange")
    rows = []
    for name, case in cases.items():
        for n in ranks_of(case):
            rows.append([name, f_int(case.get("tokens")), n, f_speedup(speedup(case, n, "compute only", "bf16", chunks))]
                        + [f_speedup(speedup(case, n, k, "bf16", chunks)) for k in links]
                        + [f_speedup(speedup(case, n, fp8_link, "fp8", chunks))])
    out += table(header, rows)
    native = "; ".join(f"{name} {f_s((c.get('native') or {}).get('step_s'))} s" for name, c in cases.items())
    out += ["", f"Native step (N = 1, the same model and attention, projected the same way): {native}. No multi-GPU "
                "measurement exists: every figure here is EMULATED. Not modelled: the peers (symmetric, not run)"
                + ("; the cost per collective is the one measured with the N ranks sharing one GPU, whose processes "
                   "time-share it, not the cost between N GPUs" if by_path(d) else " and the real transport's host-side waits")
                + ". Exposed seconds per step: the table \"Exposed communication\"."
                + ("" if d.get("finished") else " The run was stopped by its time limit before it finished (the JSON has no "
                   "`finished`): — marks a case it did not reach.")]
    return out


def t_exposed(results):
    d, cases, chunks = emulation(results)
    links = sorted(list(d.get("links_gbps") or {}) + list(d.get("peers") or {}), key=lambda k: -(gbps_of(d, k) or 0))
    out = [caption(f"Exposed communication, EMULATED on one {card(d)}: seconds per step that the "
                   "all-to-alls add to rank 0's step, bf16 / fp8 exchange.", EMULATION_JSON, machine(d),
                   "Exposed = the emulated step at a link minus the same step with a free link (compute only)."), ""]
    rows = []
    for name, case in cases.items():
        for n in ranks_of(case):
            cells = []
            for k in links:
                b, f = run_of(case, n, k, "bf16", chunks), run_of(case, n, k, "fp8", chunks)
                cells.append("—" if not (b or f) else f"{f_s((b or {}).get('exposed_comm_s'))} / {f_s((f or {}).get('exposed_comm_s'))}")
            b, f = run_of(case, n, "compute only", "bf16", chunks), next(
                (r for r in case["runs"] if r["ranks"] == n and r["exchange"] == "fp8" and shipped(r)), None)
            gb = f"{fmt((b or {}).get('step_gb_out'), 1)} / {fmt((f or {}).get('step_gb_out'), 1)}"
            rows.append([name, f_int(case.get("tokens")), n, gb] + cells)
    out += table(["case", "tokens", "N", "GB sent by rank 0 per step"] + [link_label(d, k) for k in links], rows)
    out += ["", "The fp8 cells are measured against the bf16 step with a free link, so they include the cost of "
                "quantizing and dequantizing: on a fast link fp8 can expose more than bf16. The matched links exist for "
                "the peers' token count only (75k). Per-collective cost: the caption of the scaling table."]
    return out


def t_qkv(results):
    d, cases, chunks = emulation(results)
    pairs = [(name, case, r, next((f for f in case["runs"] if shipped(f) and all(f[k] == r[k] for k in ("ranks", "chunks", "exchange", "link"))), None))
             for name, case in cases.items() for r in case["runs"] if r.get("qkv_choice") == "all_to_all" and r["chunks"] == chunks]
    rows = [[name, f_int(case.get("tokens")), r["ranks"], r["link"] if r["gbps"] is None else link_label(d, r["link"]), r["exchange"],
             f"{fmt(g['step_gb_out'], 1)} / {fmt(r['step_gb_out'], 1)}", f"{f_s(g['step_s'])} / {f_s(r['step_s'])}",
             f_speedup(g["speedup"]), f_speedup(r["speedup"])]
            for name, case, r, g in pairs if g is not None and g.get("qkv") == "gather"]
    if not rows:
        return []  # not run yet (h3_sp_emulation.py --qkv auto,all_to_all); the CPU test counts the bytes
    out = [caption(f"The hidden-row gather against the q|k|v all-to-all, EMULATED on one {card(d)}, interleaved in one run.",
                   EMULATION_JSON, machine(d), "The same step, model and link; only the exchange before attention differs."), ""]
    return out + table(["case", "tokens", "N", "link", "exchange", "GB sent by rank 0 per step, gather / all-to-all",
                        "step s, gather / all-to-all", "speed-up, gather", "speed-up, all-to-all"], rows)


# ---------------------------------------------------------------- the peers (table 2)

def peer_rows(peers, prefix):
    return [r for p in peers.get("peers") or [] if p.get("name", "").startswith(prefix) for r in p.get("rows") or []]


def pick(rows, what, **match):
    """The rows whose fields equal `match`, sorted by GPU count; Skip when there is none."""
    got = sorted((r for r in rows if all(r.get(k) == v for k, v in match.items())), key=lambda r: r.get("gpus") or 0)
    if not got:
        raise Skip(f"peers.json has no row for {what}")
    return got


def source(r):
    s = r.get("source") or {}
    if s.get("repo"):
        return f"{s['repo']} `{s.get('path', '')}` @ {str(s.get('commit', ''))[:7]}"
    return s.get("url", "—")


def computed(r):
    return r["one_gpu_s"] / r["n_gpu_s"] if _num(r.get("one_gpu_s")) and _num(r.get("n_gpu_s")) and r["n_gpu_s"] else None


def t_peers(results):
    d, cases, chunks = emulation(results)
    peers = load(PEERS.parent, PEERS.name)
    if peers is None:
        raise Skip("bench/peers.json not found")
    big = next((c for c in cases.values() if any(r["link"] in (d.get("peers") or {}) for r in c.get("runs") or [])), None)
    small = cases.get("38k") or next((c for c in cases.values() if c is not big), None)  # the bar is set at 38k
    if big is None or small is None or len(d.get("peers") or {}) < 2:
        raise Skip(f"{EMULATION_JSON} has no matched-link runs")
    ms = peer_rows(peers, "martonsagi/Comfy-H3-MultiStream")
    dense = [r for r in ms if r.get("metric") == "per-step" and r.get("tokens") == big["tokens"] and _num(r.get("speedup"))
             and "sparse" not in (r.get("quote") or "")]
    ms2 = pick(dense, "MultiStream, 2 GPUs per step", gpus=2)[0]
    ms3 = pick(dense, "MultiStream, 3 GPUs per step", gpus=3)[0]
    ray = [r for r in ms if "NCCL" in (r.get("interconnect") or "")]
    if not ray:
        raise Skip("peers.json has no Raylight row")
    ray = ray[0]
    buqi = [r for r in peer_rows(peers, "buqi-code/") if str((r.get("source") or {}).get("commit", "")).startswith("bce08392")
            and r.get("resolution") == "832x480"]
    xdit = pick(peer_rows(peers, "xDiT"), "xDiT on H100", gpu_model="H100")
    if not buqi:
        raise Skip("peers.json has no buqi-code rows of README bce08392")
    buqi = sorted(buqi, key=lambda r: r["gpus"])
    tok = f"per step, {f_int(big['tokens'])} tokens"
    rows = []
    for key, n, peer in (("matched_2gpu", 2, ms2), ("matched_3gpu", 3, ms3)):
        p = d["peers"][key]
        link = (f"EMULATED link {p['emulated_gbps']:.1f} GB/s = {p['peer_gbps']:g} GB/s x {p['peer_one_gpu_step_s']:g} s / "
                f"{p['our_native_step_s']:.2f} s")
        rows.append([f"ours, EMULATED on one {card(d)}, bf16 exchange", n, link, tok, f_speedup(speedup(big, n, key, "bf16", chunks)),
                     f"`bench/results/{EMULATION_JSON}`"])
        rows.append(["ours, EMULATED, fp8 exchange", n, "the same", tok, f_speedup(speedup(big, n, key, "fp8", chunks)), "the same"])
        rows.append(["martonsagi/Comfy-H3-MultiStream", n, f"{n}x {peer['gpu_model']}, {peer['interconnect'].split(' (')[0].split(';')[0]}",
                     f"per step, {f_int(peer['tokens'])} tokens, {peer['weights'].split(' (')[0]} weights",
                     f_speedup(peer["speedup"]), source(peer)])
        if n == 2:
            rows.append(["Raylight (xDiT Ulysses over NCCL), as measured by MultiStream", ray["gpus"], "the same box as the row above",
                         "end to end, excluding text encoding", f"{f_speedup(computed(ray))} (computed: "
                         f"{ray['one_gpu_s']:g} / {ray['n_gpu_s']:g} s)", source(ray)])
    rows.append(["buqi-code/buqi-minimax-h3-multigpu", " / ".join(str(r["gpus"]) for r in buqi),
                 f"{buqi[0]['gpu_model']}, {buqi[0]['interconnect']}", f"end to end, {buqi[0]['resolution']}, fp8 weights",
                 " / ".join(f_speedup(r["speedup"]) for r in buqi) + " (a README version the current one withdrew)", source(buqi[0])])
    rows.append(["xDiT, HunyuanVideo (not H3)", " / ".join(str(r["gpus"]) for r in xdit), "H100", "end to end, 1280x720, 129 frames",
                 " / ".join(f_speedup(computed(r)) for r in xdit) + " (computed from its latency table)", source(xdit[0])])
    bar_n = [n for n in sorted(BAR) if n in ranks_of(small)]
    ours = {n: speedup(small, n, "nvlink", "bf16", chunks) for n in bar_n}
    ns = " / ".join(str(n) for n in bar_n)
    rows.append([f"ours, EMULATED, bf16 exchange, {f_int(small['tokens'])} tokens", ns, link_label(d, "nvlink"), "per step",
                 " / ".join(f_speedup(ours[n]) for n in bar_n), f"`bench/results/{EMULATION_JSON}`"])
    rows.append(["the bar the project set itself", ns, "NVLink", "per step", " / ".join(f"{BAR[n]:.1f}" for n in bar_n), "this project"])
    out = [caption(f"Side by side with the peers: ours EMULATED on one {card(d)} at links matched to the peers' boxes, theirs "
                   "as published on real GPUs (not re-run here).", [EMULATION_JSON, "bench/peers.json"], machine(d)), ""]
    out += table(["who", "N", "GPUs and link", "what is timed", "speed-up", "source"], rows, ["l", "r", "l", "l", "r", "l"])
    out += ["", f"Matched link: the peer's link bandwidth x (the peer's 1-GPU s/step / our native s/step at {f_int(big['tokens'])} "
                "tokens), so that moving a step's bytes takes the same share of a step as on the peer's box. MultiStream's "
                f"2-GPU box streams the weights on one 16 GiB card and its {ms2['one_gpu_s']:g} s/step is a mean over all steps "
                "(peers.json notes): that inflates its 1-GPU time and makes our matched 2-GPU link generous. The peers ran "
                "int8 (MultiStream) and fp8 (buqi-code) weights; rows measure different things (per step, end to end) and are "
                "side by side, not a ranking. Raylight's and xDiT's speed-ups are divisions done here; buqi-code's figures "
                "are from its README at that commit, whose later versions withdraw every GPU performance claim."]
    short = [n for n in bar_n if _num(ours[n]) and ours[n] < BAR[n]]
    lat, _ = latencies(d)
    if short:
        parts = []
        for n in short:
            r, free = run_of(small, n, "nvlink", "bf16", chunks), run_of(small, n, "compute only", "bf16", chunks)
            wire = max(r["step_gb_in"], r["step_gb_out"]) / r["gbps"]
            cost = {k: v["device"] if isinstance(v, dict) else v for k, v in lat.items()}
            parts.append(f"N = {n}: {f_speedup(ours[n])} against {BAR[n]:.1f}, with {f_speedup((free or {}).get('speedup'))} "
                         f"for the compute alone; {f_s(r['exposed_comm_s'])} s per step left exposed, where moving the bytes at "
                         f"{r['gbps']:g} GB/s takes {f_s(wire)} s in all and the {r['step_rounds']:g} rounds of a step cost "
                         f"{f_ms(cost.get(n))} ms each ({f_s(r['step_rounds'] * cost[n]) if _num(cost.get(n)) else '—'} s, "
                         f"against {f_ms(cost.get(2))} ms a round at 2 ranks)")
        out += ["", "Where ours falls short of the bar (EMULATED, NVLink): " + "; ".join(parts) + "."]
    return out


# ---------------------------------------------------------------- real ranks on one GPU (tables 4, 5)

def t_shared(results):
    d, runs = need(results, SHARED_JSON, "runs")

    def call(r, mb, key):
        return next((x.get(key) for x in r.get("link") or [] if x.get("mb_per_pair") == mb), None)

    paths = {"device": "device (CUDA IPC, stream flags)", "host": "host (pinned memory, stream flags)",
             "host, a thread per rank": "host, a thread per rank (no longer shipped)",
             "host, on the calling thread": "staged (through CPU memory, on the calling thread)"}
    rows = [[r["ranks"], paths.get(r.get("data_path") or "host, a thread per rank", r.get("data_path")),
             f_sci(((r.get("parity") or {}).get("bf16") or {}).get("rel_diff")),
             f_sci(((r.get("parity") or {}).get("fp8") or {}).get("rel_diff")),
             f_ms(call(r, 0.001, "s_per_call")), f_ms(call(r, 1, "s_per_call")),
             fmt(call(r, 64, "gb_per_s_per_rank_each_way"), 1), fmt(call(r, 256, "gb_per_s_per_rank_each_way"), 1),
             fmt((r.get("startup_s") or {}).get("total"), 1)] for r in runs]
    tokens = next((r["parity"]["tokens"] for r in runs if (r.get("parity") or {}).get("tokens")), None)
    identical = [r["ranks"] for r in runs for e in ("bf16", "fp8") if ((r.get("parity") or {}).get(e) or {}).get("bit_identical")]
    out = [caption(f"The data paths for real on one {card(d)}: N ranks of a comfy.parallel group, every one on cuda:0.",
                   SHARED_JSON, machine(d) + (f"; code: commit {d['commit']}" if d.get("commit") else ""),
                   f"Rel diff (where run): sharded vs native output of real-width H3 (2 blocks, {f_int(tokens)} tokens, random "
                   "bf16 weights), max |a - b| / max |b|. The data path: seconds per all-to-all (the slowest rank, back to back, "
                   "the GPU synchronized at the end) at 1 KB and 1 MB per peer pair, and bandwidth per rank each way at 64 and "
                   "256 MB per pair. device: copies into the peer's buffer on the copy engine (here same-device IPC); host: "
                   "device -> pinned host -> device; both ordered by flags the GPUs write and wait on. Staged: the fallback for GPUs "
                   "without stream memory operations (CUDA tensors copied to CPU memory and through the CPU path, blocking); "
                   "a thread per rank: the transport before the stream path, no longer shipped."), ""]
    out += table(["N", "data path", "rel diff, bf16 exchange", "rel diff, fp8 exchange", "1 KB all-to-all ms", "1 MB all-to-all ms",
                  "64 MB per pair: GB/s per rank each way", "256 MB per pair: GB/s per rank each way", "group start-up s"], rows)
    out += ["", "The N ranks share one GPU (its copy engines, its memory, its PCIe link to host memory), so the bandwidth per "
                "rank falls as N grows: it is not what N GPUs would each get, and the device path here copies within one GPU, "
                "not over NVLink. The 1 KB time is the per-collective cost the emulation adds for that path. "
                + ("No sharded output is bit-identical to the native one." if not identical else
                   f"Bit-identical at N = {', '.join(map(str, sorted(set(identical))))}.")
                + same_output_across_paths(runs)]
    return out


def same_output_across_paths(runs):
    """' ...' where every data path gave the same sharded output (sha256 in the JSON) at each N and exchange."""
    hashes = collections.defaultdict(set)
    for r in runs:
        for e in ("bf16", "fp8"):
            h = ((r.get("parity") or {}).get(e) or {}).get("sha256")
            if h:
                hashes[r["ranks"], e].add(h)
    paths = {r.get("data_path") for r in runs}
    if len(paths) < 2 or not hashes:
        return ""
    same = sorted({n for (n, _), hs in hashes.items() if len(hs) == 1 and all(len(hashes[n, e]) == 1 for e in ("bf16", "fp8"))})
    return (f" At N = {', '.join(map(str, same))} the {len(paths)} data paths gave bit-identical sharded outputs, bf16 and fp8 "
            "exchange alike (the rel diffs differ where the native reference was re-run)." if same else "")


def t_control(results):
    d, runs = need(results, CONTROL_JSON, "runs")
    out = []
    for r in runs:
        c = r.get("control") or {}
        med, added, rel = c.get("median_s") or {}, c.get("tower_added_s") or {}, c.get("rel_diff_vs_native_tower") or {}
        k = c.get("tower_blocks") or 0
        rows = []
        # (label, run without the tower, run with it, key of tower_added_s)
        for label, plain, tower, key in (("native (rank 0 alone)", "native", "native_tower", "native"),
                                         (f"sharded, N = {r['ranks']}: the shipped `patched_blocks` (block sharded, patch on "
                                          "rank 0)", "sharded", "sharded_tower", "sharded"),
                                         (f"sharded, N = {r['ranks']}: the replaced design (block and patch on rank 0)",
                                          "sharded", "sharded_tower_whole_block_on_rank0", "sharded_whole_block_on_rank0")):
            a = added.get(key)
            rows.append([label, f_s(med.get(plain)), f_s(med.get(tower)), f_s(a), f_s(a / k) if _num(a) and k else "—",
                         f_sci(rel[tower]) if tower in rel else "—"])
        out += [caption(f"A Fun ControlNet-Union tower under sharding, for real on one {card(d)}: the ranks of a comfy.parallel "
                        "group share cuda:0.", CONTROL_JSON, machine(d),
                        f"Real-width H3 ({c.get('model_blocks')} blocks, {f_int(c.get('tokens'))} tokens, random bf16 "
                        f"weights) with a real-width tower of {k} blocks, one injected at every model block; seconds per "
                        f"forward, median of {len(next(iter((c.get('seconds') or {'': []}).values())))}, interleaved. "
                        "Rel diff: max |a - b| / max |b| against the native forward with the tower."), ""]
        out += table(["run", "forward s, no tower", "forward s, tower", "patching adds s", "per patched block s", "rel diff"], rows,
                     ["l", "r", "r", "r", "r", "r"])
        out += ["", "While rank 0 runs the patch the other ranks wait, so the tower's added time is rank 0's own even on "
                    "a shared GPU; the forwards without the tower are not a speed-up (the ranks share the GPU). In the "
                    "replaced design the model's block also ran whole on rank 0 instead of sharded: on a shared GPU that "
                    "costs about what the sharded block does, on separate GPUs it takes N shards' time (not run). The "
                    f"tower changes the native output by {f_sci(c.get('rel_diff_tower_vs_no_tower_native'))} (rel): near 1, "
                    "its hint (random weights) swamps the model's rows and the rel diff says little about the sharded "
                    "block; the node's CPU test checks that workflow against the one without the node at 1e-5."]
    return out


def t_users(results):
    d, runs = need(results, USERS_JSON, "runs")
    rows, notes = [], []
    for name, r in runs.items():
        job = r.get("job") or {}
        first = (job.get("runs") or [{}])[0]
        cap = f"{r['emulated_card_gib']:g} GiB" if _num(r.get("emulated_card_gib")) else "uncapped"
        by_rank = [(r.get(k) or {}) for k in ("peak_gpu_mib_by_rank", "peak_rss_mib_by_rank")]
        gpu, rss = (" / ".join(f_int(v.get(k)) for k in sorted(v, key=int)) or "—" for v in by_rank)
        rel = max((x.get("rel_diff") for x in job.get("runs") or [] if _num(x.get("rel_diff"))), default=None)
        parity = "PASS" if job.get("parity") is True else "FAIL" if job.get("parity") is False else "—"
        rows.append([f"`{name}`" + (f" (`{' '.join(r['args'])}`)" if r.get("args") else ""),
                     f"{r.get('weights')}, {fmt(r.get('checkpoint_gib'), 1)} GiB, {r.get('layers')} blocks", cap, gpu, rss,
                     f_s(first.get("native_s")), f_s(first.get("sharded_s")), fmt((job.get("startup_s") or {}).get("total"), 1),
                     f_sci(rel), f_sci(job.get("native_run_to_run")), f"{parity} (exit {r.get('exit')})"])
        if job.get("parity") is False and not _num(job.get("native_run_to_run")):
            notes.append(f"`{name}` failed parity because that run measured no native run-to-run difference, so its "
                         f"{f_sci(rel)} was held to the {f_sci(job.get('tolerance'))} tolerance alone")
    job0 = next((r["job"] for r in runs.values() if r.get("job")), {})
    out = [caption(f"The users' GPUs: real-size H3 on two ranks sharing one {card(d)}, each process capped to an EMULATED "
                   "smaller card, through ComfyUI's own workflow (UNETLoader, the node, KSampler).", USERS_JSON,
                   f"{d.get('gpu') or 'GPU not recorded'}, {job0.get('machine', {}).get('cpus', '?')} CPU cores, "
                   f"torch {job0.get('machine', {}).get('torch', '?')}"
                   + (f" (run started {d['started']})" if d.get("started") else ""),
                   f"{f_int(job0.get('tokens'))} tokens, {job0.get('steps')} steps, {job0.get('compute_dtype')} compute, "
                   f"transport: {job0.get('transport')}. Both ranks share one GPU: sharded s is a correctness and memory "
                   "figure, not a speed-up."), ""]
    out += table(["configuration", "weights", "EMULATED card", "peak GPU MiB (rank 0 / 1)", "peak host RSS MiB (rank 0 / 1)",
                  "native s", "sharded s", "worker start-up s", "rel diff", "native run-to-run", "parity"], rows,
                 ["l", "l", "r", "r", "r", "r", "r", "r", "r", "r", "l"])
    rule = job0.get("parity_rule")
    out += ["", (f"Parity: {rule}. " if rule else "") + "Peaks sampled every 0.25 s: GPU memory per process from nvidia-smi, host memory as VmRSS, which counts in "
            "every process the file pages it maps (the checkpoint is a file in /dev/shm): the ranks' sum overstates host use. "
            "The first sharded run includes the workers' start-up. "
            + ("; ".join(n[0].upper() + n[1:] for n in notes) + ". " if notes else "")
            + f"Code: {d.get('code', '?')}; " + " ".join(d.get("notes") or [])]
    failed = d.get("failed_before_fix") or {}
    if failed:
        parts = []
        for name, f in failed.items():
            m = re.search(r"raised (\w+) on worker rank (\d+).*?Tried to allocate ([\d.]+ \w+)", f.get("log_tail", ""), re.S)
            what = f"{m.group(1)} on worker rank {m.group(2)} (tried to allocate {m.group(3)})" if m else f"exit {f.get('exit')}"
            parts.append(f"`{name}` ({f.get('emulated_card_gib')} GiB card): {what}")
        out += ["", "Failed before the fix (`failed_before_fix`, the earlier code, not rows of the table): " + "; ".join(parts) + "."]
    return out


# ---------------------------------------------------------------- the VAE decode over the group

def t_vae(results):
    if load(results, VAE_JSON) is None:
        return []  # not run yet on a GPU (the CPU test stands for it)
    d, runs = need(results, VAE_JSON, "runs")
    rows, e2e = [], []
    try:
        _, cases, chunks = emulation(results)
        em = load(results, EMULATION_JSON)
    except Skip:
        cases, chunks, em = {}, None, {}
    links = sorted({k for r in runs for s in r["sharded"] for k in s["emulated_decode_s"]})
    for r in runs:
        one = r["one_process"]
        for s in r["sharded"]:
            rows.append([r["case"], f_int(r["tiles"]), s["ranks"], s.get("data_path", "—"), f_s(one["decode_s"]),
                         f_s(s["decode_s_shared_gpu"]), yes(s["bit_identical"]), f_sci(s["max_abs_diff"]),
                         f_int(one["peak_mib"]), " / ".join(f_int(m) for m in s["peak_mib_per_rank"]),
                         *[f_speedup(s["emulated_speedup"][k]) for k in links]])
            case = cases.get(VAE_CASES.get(r["case"]), {})
            native = (case.get("native") or {}).get("step_s")
            for k in links:
                link = next((lk for lk, name in LINK_NAMES.items() if name.endswith(k)), None)
                step = run_of(case, s["ranks"], link, "bf16", chunks) if link else None
                if native and step:
                    t1 = E2E_STEPS * native + one["decode_s"]
                    tn = E2E_STEPS * step["step_s"] + s["emulated_decode_s"][k]
                    e2e.append([r["case"], s["ranks"], k, f_speedup(step["speedup"]), f_speedup(t1 / tn),
                                f_speedup(t1 / (E2E_STEPS * step["step_s"] + one["decode_s"]))])
    out = [caption(f"H3's VAE decode over N ranks sharing one {card(d)}, through the node and ComfyUI's VAELoader, against "
                   "ComfyUI's decode in one process.", VAE_JSON, machine(d) + (f"; code: commit {d['commit']}" if d.get("commit") else ""),
                   "Real-size H3 video VAE (upstream's MiniMaxH3VideoVAE, seeded random fp16 weights); the tiles are the "
                   "VAE's own (temporal chunks x 256-pixel tiles). Decode s: wall time on the shared GPU (no speed-up: the "
                   "ranks share its compute). Peak GPU MiB per process from nvidia-smi. EMULATED speed-up on N separate GPUs: "
                   "the one-process decoder-call time x ceil(tiles / N) / tiles, plus the rest of the one-process decode "
                   "(blending, the copy to host: rank 0's alone), plus the tiles the workers send to rank 0 at the link named."), ""]
    out += table(["video", "tiles", "N", "data path", "one process s", "sharded s (shared GPU)", "bit-identical", "max abs diff",
                  "peak MiB, one process", "peak MiB per rank (0 / 1 / ...)", *[f"EMULATED decode speed-up, {k}" for k in links]], rows)
    if e2e:
        out += ["", caption(f"The whole workflow, EMULATED: {E2E_STEPS} steps + the decode, the steps from the emulation "
                            f"({card(em)}) and the decode from the row above ({card(d)}), bf16 exchange, {chunks} head chunks.",
                            [EMULATION_JSON, VAE_JSON], "the machines of the two files",
                            "Speed-up of steps + decode against one GPU doing both; the last column keeps the decode on one "
                            "GPU (the sequence-parallel node without the VAE node)."), ""]
        out += table(["video", "N", "link", "per step", "steps + decode", "steps + decode on rank 0 alone"], e2e)
    return out


# ---------------------------------------------------------------- patch 0001 on CUDA (table 6)

def t_seam(results):
    d, cases = need(results, SEAM_CUDA_JSON, "cases")
    groups = {}
    for name, c in cases.items():
        key = (c.get("bit_identical"), c.get("same_kernels"), c.get("same_kernel_sequence"))
        groups.setdefault(key, []).append(f"{name} ({c.get('kernels')})")
    rows = [["bit-identical" if b else "differ", "the same" if k else "differ", "the same" if s else "another",
             len(names), ", ".join(names)] for (b, k, s), names in sorted(groups.items(), key=lambda kv: (not kv[0][2], kv[0]))]
    out = [caption("Patch 0001 (the row-shard seam) on CUDA: every case of `tests-unit/comfy_test/minimax_h3_cases.py` in "
                   "the unpatched and in the patched tree, outputs and launched CUDA kernels compared.", SEAM_CUDA_JSON, machine(d)), ""]
    out += table(["outputs", "kernels (as a multiset)", "kernel order", "cases", "which (kernels launched)"], rows,
                 ["l", "l", "l", "r", "l"])
    out += ["", f"All bit-identical: {yes(d.get('all_bit_identical'))}; the same kernels in every case: "
                f"{yes(d.get('all_same_kernels'))}; the same order in every case: {yes(d.get('all_same_kernel_sequence'))}. "
                "Tiny-model cases, not timed."]
    return out


# ---------------------------------------------------------------- in-process threads vs processes (table 7)

def _worlds(res):
    return sorted(((int(n), r) for n, r in (res.get("worlds") or {}).items()), key=lambda t: t[0])


def _two(a, b):
    """A value of the first run and of the second ("a / b"), or the one there is."""
    return " / ".join(_ms(v) for v in (a, b) if _num(v)) or "—"


def t_inprocess(results):
    d, sec = need(results, INPROCESS_JSON, "resolutions")
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
    names = [INPROCESS_JSON] + ([INPROCESS_RR_JSON] if rr else [])
    out = [caption("The in-process alternative (core's MultiGPU design: one Python thread per GPU in one process) for H3 "
                   "Ulysses, measured on ONE GPU: host time to enqueue one step's share on every GPU, ms per step (50 blocks), "
                   "against one GPU's share of the native step. All-to-alls EMULATED; keeping N GPUs fed is a projection: "
                   "no multi-GPU measurement exists.", names, machine(d)), ""]
    out += table(header, rows)
    m = d.get("machine") or {}
    out += ["", "Upstream's own DiTBlock (the h3-newest base), not the series' code. Bar: upstream's native step on one GPU "
                "(flash-first, its default order) / N, what one GPU computes per step. Host times are enqueue times, measured "
                "block by block with the GPU idle at each block's start, summed over the step; the N threads' time runs from "
                "the first thread's start to the last one's end of each block (what feeds all N GPUs), and cells with two "
                "values are two runs (the second file). bar / host above 1: the host keeps N GPUs fed, by that margin (the "
                "worse run); below 1 the GPUs wait. Processes skip the host exchange. One thread in turn: one Python thread "
                "drives every rank, each rank's block a generator yielding at its exchanges: no barrier, no GIL hand-off. "
                "Graphs: each rank's step captured as 101 CUDA graphs cut at its 100 exchanges (the peer copies inside, "
                "barriers and events between). GPU busy: one rank's step alone on the GPU over the N threads' host time. "
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


# ---------------------------------------------------------------- the series' size (from patches/)

PATCHES = ROOT / "patches"
# the review's line budgets (non-blank added lines, tests not counted): path prefixes -> goal
BUDGETS = (("comfy/parallel/", ("comfy/parallel/",), 700), ("comfy/model_patcher_snapshot.py", ("comfy/model_patcher_snapshot.py",), 300),
           ("the node + ulysses.py + sequence_parallel.py", ("comfy/ldm/minimax/ulysses.py", "comfy/ldm/minimax/sequence_parallel.py",
                                                            "comfy_extras/nodes_minimax_h3_parallel.py"), 500),
           ("vae_parallel.py (the VAE decode, after the review; its node is in the row above)",
            ("comfy/ldm/minimax/vae_parallel.py",), "none set"))

CODE_FILES = {
    "sequence_parallel.py": "rank 0's runner: loader call and its trust check (custom loaders refused unless allowed), "
                            "patch sync by snapshot, step inputs sent once per run, the step wrapper (EasyCache and other "
                            "wrappers around it), attention by registered name, Fun ControlNet block patches around sharded "
                            "blocks, unload and close; the worker ops",
    "ulysses.py": "the sharded attention: head-chunk pipelined all-to-alls with exact uneven splits, fp8 exchange, row gathers",
    "nodes_minimax_h3_parallel.py": "the two nodes (model, VAE) and their ModelPatcher hooks",
    "vae_parallel.py": "the VAE decode over the group",
    "model_patcher_snapshot.py": "the versioned patch snapshot (capture, diff, apply, to a patcher)",
    "group.py": "rank 0's owner: start (spawn, fingerprints, probe), run, cancel, close; the monitor that tells busy from "
                "hung (heartbeat, CPU time, process state) and names a dead, stopped or misbehaving worker",
    "stream_path.py": "the GPU data path: device to device over CUDA IPC after a write-and-verify test, or pinned host "
                      "slots (within ComfyUI's pinned budget), ordered by flags the GPUs write and wait on; release after an abort",
    "transport.py": "the shared segment and bells, aborts and deadlines, the CPU path (copies on the calling thread), "
                    "the staged fallback",
    "worker.py": "the worker process: ComfyUI's start-up as main.py does it, the op loop, exit when rank 0 is gone",
    "ops.py": "the op registry, the context an op sees, code fingerprints (code skew), the start-up probe",
    "channel.py": "JSON control frames on the private pipes (nothing unpickled)",
    "errors.py": "the errors, each saying what happened and what to do",
    "__init__.py": "the public names",
}


def patch_lines(path):
    """One patch file -> {file path: non-blank added lines}."""
    counts, current = {}, None
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("diff --git "):
            current = line.split(" b/", 1)[1]
            counts[current] = 0
        elif current and line.startswith("+") and not line.startswith("+++") and line[1:].strip():
            counts[current] += 1
    return counts


def t_series(results):
    names = [n.strip() for n in (PATCHES / "series").read_text(encoding="utf-8").splitlines() if n.strip()] \
        if (PATCHES / "series").is_file() else []
    if not names:
        raise Skip("patches/series not found")
    rows, every = [], {}
    for name in names:
        counts = patch_lines(PATCHES / name)
        every.update(counts)
        tests = sum(v for k, v in counts.items() if k.startswith("tests-unit/"))
        rows.append([f"`{name}`", str(len(counts)), str(sum(counts.values()) - tests), str(tests)])
    out = ["**The series' size**, counted from `patches/*.patch`: non-blank added lines per patch, code and tests "
           "apart (a modified upstream file counts its added lines).", ""]
    out += table(["patch", "files", "added lines, not tests", "added lines, tests"], rows, ["l", "r", "r", "r"])
    budget_rows = [[what, str(sum(v for k, v in every.items() if k.startswith(prefixes))), str(goal)]
                   for what, prefixes, goal in BUDGETS]
    out += ["", "Against the line budgets the maintainer review set (non-blank lines, tests not counted):", ""]
    out += table(["code", "lines now", "budget"], budget_rows, ["l", "r", "r"])
    files = [[f"`{k}`", str(every[k]), CODE_FILES[k.rsplit("/", 1)[1]]]
             for k in sorted(every, key=lambda k: -every[k]) if k.rsplit("/", 1)[-1] in CODE_FILES and not k.startswith("tests-unit/")]
    out += ["", "The budgeted code by file, and what each holds:", ""]
    return out + table(["file", "lines", "what"], files, ["l", "r", "l"])


# ---------------------------------------------------------------- the results index (bench/README.md only)

def t_index(results):
    results, rows = Path(results), []
    for pattern, command, question in INDEX:
        names = sorted(p.name for p in results.glob(pattern))
        if not names and any(ch in pattern for ch in "*?["):
            continue  # a run that may come back: no row until it does
        cell = ", ".join(f"`{n}`" + (" + `.log`" if n.endswith(".json") and (results / (n[:-5] + ".log")).is_file() else "")
                         for n in names) or f"`{pattern}` (missing)"
        rows.append([cell, command, question])
    if PEERS.is_file():
        rows.append(["`bench/peers.json`", "collected by hand from the sources it names (repository, commit, path and the "
                     "quoted line of every row)", "What have the peer projects published for multi-GPU H3 (and nearby models)?"])
    out = ["**Results index.** Every current file in `bench/results/`, the command that wrote it (scripts in "
           "`bench/`) and the question it answers.", ""]
    return out + table(["results file", "command", "question"], rows, ["l", "l", "l"])


SECTIONS = {  # name: (title in a skipped-table comment, function of the results folder)
    "scaling": ("sequence-parallel scaling", t_scaling),
    "peers": ("side by side with the peers", t_peers),
    "exposed": ("exposed communication", t_exposed),
    "qkv": ("the hidden-row gather against the all-to-all", t_qkv),
    "shared": ("fp8 vs bf16 exchange and the transport", t_shared),
    "control": ("a Fun ControlNet tower under sharding", t_control),
    "users": ("the users' GPUs", t_users),
    "seam": ("patch 0001 on CUDA", t_seam),
    "inprocess": ("in-process threads vs processes", t_inprocess),
    "vae": ("the VAE decode over the group", t_vae),
    "index": ("results index", t_index),
    "series": ("the series' size", t_series),
}
README_TABLES = ("scaling", "peers", "series")
APPENDIX_TABLES = ("scaling", "peers", "exposed", "qkv", "shared", "control", "users", "vae", "seam", "inprocess", "series")
BENCH_TABLES = APPENDIX_TABLES + ("index",)


def tables_for(path):
    """The table names a target file gets."""
    path = Path(path).resolve()
    if path == README.resolve():
        return README_TABLES
    if path == BENCH_README.resolve():
        return BENCH_TABLES
    return APPENDIX_TABLES


def generate(results=RESULTS, names=APPENDIX_TABLES):
    """The text that goes between the markers (starts and ends with a newline)."""
    lines = ["<!-- generated by bench/tables.py from bench/results/*.json: edit those, then run the script -->"]
    for name in names:
        title, fn = SECTIONS[name]
        try:
            part = fn(results)
        except Skip as e:
            part = [f"<!-- {title}: table skipped ({e}) -->"]
        except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError, IndexError, StopIteration) as e:
            part = [f"<!-- {title}: table skipped (unexpected JSON structure: {type(e).__name__} {e}) -->"]
        lines += [""] + part
    return "\n" + "\n".join(lines) + "\n"


# ---------------------------------------------------------------- markers

def splice(text, block):
    """text with everything between the markers replaced by block; None when the markers are missing."""
    i = text.find(BEGIN)
    j = text.find(END, i + len(BEGIN)) if i >= 0 else -1
    return None if j < 0 else text[:i + len(BEGIN)] + block + text[j:]


def current_block(text):
    i = text.find(BEGIN)
    j = text.find(END, i + len(BEGIN)) if i >= 0 else -1
    return None if j < 0 else text[i + len(BEGIN):j]


def write_into(path, results, check=False):
    """Write (or with check, compare) the generated block of path: 'ok', 'changed', 'stale' or 'skipped'."""
    path = Path(path)
    if not path.is_file():
        print(f"{path}: no such file, skipped")
        return "skipped"
    with open(path, encoding="utf-8", newline="") as f:
        text = f.read()
    block = generate(results, tables_for(path))
    new = splice(text, block)
    if new is None:
        print(f"{path}: no {BEGIN} ... {END} markers, skipped")
        return "skipped"
    if new == text:
        print(f"{path}: tables up to date")
        return "ok"
    if check:
        diff = difflib.unified_diff((current_block(text) or "").splitlines(), block.splitlines(), "in file", "generated now",
                                    lineterm="", n=1)
        rerun = "" if path.resolve() in (README.resolve(), BENCH_README.resolve()) else f" --into {path}"
        print(f"{path}: generated tables are out of date (run python bench/tables.py{rerun}):")
        print("\n".join(list(diff)[:40]))
        return "stale"
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write(new)
    print(f"{path}: tables written")
    return "changed"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=str(RESULTS), help="folder with the JSON results (default bench/results)")
    ap.add_argument("--into", action="append", default=[], metavar="PATH",
                    help="another Markdown file with the markers, e.g. the RFC (repeatable); skipped when it or its markers are absent")
    ap.add_argument("--check", action="store_true",
                    help="write nothing; exit 1 when a generated block is out of date or INDEX does not match bench/results/")
    ap.add_argument("--print", dest="print_only", action="store_true", help="print bench/README.md's generated block and exit")
    args = ap.parse_args(argv)
    if args.print_only:
        print(generate(args.results, BENCH_TABLES), end="")
        return 0
    targets = [README, BENCH_README] + [Path(p) for p in args.into]
    ok = True
    for path in targets:
        status = write_into(path, args.results, check=args.check)
        ok = ok and (status in ("ok", "changed") or (status == "skipped" and path not in (README, BENCH_README)))
    for problem in index_problems(args.results):
        print(problem if args.check else f"warning: {problem}")
        ok = False
    return 0 if ok or not args.check else 1


if __name__ == "__main__":
    sys.exit(main())
