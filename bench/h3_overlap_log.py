"""bench/results/h3_h200_overlap.json from the log of the H200 run that measured it.

That run (`python3 bench/h3_gpu.py --layers 2 --sections overlap --out .../h3_h200_overlap_steady.json`,
2026-12-01) printed every measurement but wrote no overlap section to its JSON: the section was
only attached to the output after the last resolution, by a line lost in an edit (fixed since:
section_overlap now attaches and saves per resolution). This script turns the printed lines back
into the section's schema, recording the provenance. Speed-ups are printed with 3 decimals, so
block_s = native block_s / speed-up carries up to 0.03% rounding; byte counts are recomputed from
the same geometry the run used (bench/h3_gpu.py: chunk_bytes).

  python bench/h3_overlap_log.py bench/results/h3_h200_overlap.log --json <the run's JSON> --out bench/results/h3_h200_overlap.json

A second run (chunks 1, 2, 3, 4, 7; 5 rounds; 15k tokens only) printed its lines, then hit the 500 s
command limit during the 38k resolution, before its JSON got the section:

  python bench/h3_overlap_log.py bench/results/h3_h200_overlap_depths.log --json <that run's JSON> --rounds 5 \
      --why "hit the 500 s command limit during the 38k resolution, before its JSON got this section" \
      --out bench/results/h3_h200_overlap_depths.json
"""

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import h3_gpu  # noqa: E402

WORLD = re.compile(r"^overlap (\S+) N=(\d+): (.*)$")
ITEM = re.compile(r"(\w+) x([\d.]+) \(host ([\d.]+) ms\)")
NATIVE = re.compile(r"^overlap (\S+) native block ([\d.]+) ms \(host ([\d.]+) ms\)$")


def parse(lines, rounds=3, repeat=8, latency_s=20e-6, heads=56, dim=128):
    worlds, rows = {}, {}
    for line in lines:
        line = line.rstrip("\n")
        m = WORLD.match(line)
        if m:
            items = ITEM.findall(m.group(3))
            if not items:
                raise ValueError(f"no measurements in: {line}")
            worlds.setdefault(m.group(1), {})[int(m.group(2))] = {k: (float(x), float(h) / 1e3) for k, x, h in items}
            continue
        m = NATIVE.match(line)
        if m:
            res, base, host = m.group(1), float(m.group(2)) / 1e3, float(m.group(3)) / 1e3
            seq = h3_gpu.tokens(res)
            res_rows = {"1": {"block_s": base, "host_s": host}}
            for world, items in sorted(worlds.pop(res, {}).items()):
                ul = h3_gpu._ulysses(world, seq, heads, dim)
                res_rows[str(world)] = {
                    "rows_per_rank": -(-seq // world), "a2a_bytes_per_block": h3_gpu.bytes_per_block(ul),
                    "times": {k: {"block_s": base / x, "speedup": x, "host_s": h} for k, (x, h) in items.items()}}
            rows[res] = {"tokens": seq, "native_block_s": base, "native_host_s": host, "worlds": res_rows}
    if worlds:
        raise ValueError(f"measurements without a native line: {sorted(worlds)}")
    return {"note": h3_gpu.OVERLAP_NOTE.format(rounds=rounds, repeat=repeat), "latency_s_per_collective": latency_s,
            "resolutions": rows}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("log")
    ap.add_argument("--json", required=True, help="the JSON the same run wrote (machine, model)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds the run used (for the method note)")
    ap.add_argument("--why", default="its JSON lacked this section (a bench bug, since fixed)",
                    help="why the JSON had no section, for the provenance note")
    args = ap.parse_args()
    with open(args.json) as f:
        out = json.load(f)
    with open(args.log) as f:
        out["overlap_emulation"] = parse(f, rounds=args.rounds)
    out["overlap_emulation"]["source"] = (f"parsed from {os.path.basename(args.log)} by bench/h3_overlap_log.py: the run printed "
                                          f"every measurement but {args.why}")
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
