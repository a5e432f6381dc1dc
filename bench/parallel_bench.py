"""Start-up time and per-op control overhead of comfy.parallel on CPU (gloo), as JSON.

    python bench/parallel_bench.py [--worlds 2 4] [--starts 3] [--ops 200] [--out bench/results/parallel_cpu.json]

* start-up: ``ParallelGroup.start`` until ready (spawn + imports, rendezvous, probe, setup), with
  the group's own phase breakdown; ``--starts`` fresh groups per world size.
* empty op: ``run("parallel.noop")`` round trip (frame out, preflight gather, result back), after
  a warm-up; also with 4 KiB of inputs, which travel in the control frame on each worker's pipe.
* close: ``close()`` of a ready group (graceful shutdown, reap, destroy, store close).
"""

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from comfy.parallel import ParallelGroup


def stats_ms(samples):
    s = sorted(samples)
    pick = lambda q: s[min(len(s) - 1, round(q * (len(s) - 1)))] * 1e3
    return {"n": len(s), "mean": statistics.fmean(s) * 1e3, "p50": pick(0.5), "p95": pick(0.95),
            "min": s[0] * 1e3, "max": s[-1] * 1e3}


def time_ops(g, n, tensors):
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        g.run("parallel.noop", tensors)
        out.append(time.perf_counter() - t0)
    return out


def machine():
    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    except OSError:
        pass
    return {"platform": platform.platform(), "machine": platform.machine(), "processor": platform.processor(),
            "cpu_count": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "memory_bytes": mem, "python": platform.python_version(), "torch": torch.__version__,
            "omp_num_threads_workers": os.environ.get("OMP_NUM_THREADS", "1")}


def bench_size(world, starts, ops, log_root):
    start_totals, phases, close_times = [], [], []
    op_empty = op_small = None
    small = {"x": torch.zeros(1024, dtype=torch.float32)}
    for i in range(starts):
        g = ParallelGroup(f"bench{world}", log_dir=os.path.join(log_root, f"n{world}"))
        t0 = time.perf_counter()
        g.start(["cpu"] * world)
        start_totals.append(time.perf_counter() - t0)
        phases.append(g.startup_seconds)
        try:
            if i == starts - 1:
                time_ops(g, 20, {})
                op_empty = time_ops(g, ops, {})
                time_ops(g, 20, small)
                op_small = time_ops(g, ops, small)
        finally:
            t1 = time.perf_counter()
            g.close()
            close_times.append(time.perf_counter() - t1)
    phase_means = {k: statistics.fmean(p[k] for p in phases) for k in phases[0]}
    return {
        "world_size": world,
        "startup_s": {"samples": start_totals, "mean": statistics.fmean(start_totals), "min": min(start_totals),
                      "max": max(start_totals), "phase_means": phase_means},
        "empty_op_round_trip_ms": stats_ms(op_empty),
        "op_with_4KiB_input_round_trip_ms": stats_ms(op_small),
        "close_s": {"samples": close_times, "mean": statistics.fmean(close_times)},
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--starts", type=int, default=3)
    ap.add_argument("--ops", type=int, default=200)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "parallel_cpu.json"))
    a = ap.parse_args()
    load_before = os.getloadavg()
    log_root = tempfile.mkdtemp(prefix="parallel-bench-")
    try:
        results = [bench_size(w, a.starts, a.ops, log_root) for w in a.worlds]
    finally:
        shutil.rmtree(log_root, ignore_errors=True)
    doc = {
        "what": "comfy.parallel on CPU with gloo: ParallelGroup.start() to ready, and run() round trips of an empty op",
        "command": "python bench/parallel_bench.py " + " ".join(sys.argv[1:]),
        "machine": machine(),
        "load_average_1_5_15min": {"before": load_before, "after": os.getloadavg(),
                                   "note": "2 shared cores: a load above 2 means other work competed with the benchmark"},
        "results": results,
    }
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    print(f"{'N':>2} {'start s (mean/min)':>20} {'empty op ms mean/p50/p95':>28} {'4KiB op ms mean/p50/p95':>26} {'close s':>8}")
    for r in results:
        e, s = r["empty_op_round_trip_ms"], r["op_with_4KiB_input_round_trip_ms"]
        print(f"{r['world_size']:>2} {r['startup_s']['mean']:>11.2f} / {r['startup_s']['min']:<6.2f}"
              f" {e['mean']:>10.2f} / {e['p50']:.2f} / {e['p95']:<6.2f} {s['mean']:>8.2f} / {s['p50']:.2f} / {s['p95']:<6.2f}"
              f" {r['close_s']['mean']:>8.3f}")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
