"""Ulysses sequence-parallel MiniMax H3 on real gloo process groups: every rank's output equals the
native forward's. Each rank is a fresh process running this file; results come back as JSON.

Tolerance: fp32 max |diff| <= 1e-5 * max |native| (the all-to-alls reorder no arithmetic within a row;
differences come only from GEMM blocking on other row counts); bf16 to 2e-2.
"""

import json
import os
import subprocess
import sys

import pytest

import comfy.cli_args

# 8 heads with a rope that fits 8-dim heads: up to 8 ranks, uneven head splits at 3, 5, 6, 7
WIDE = {"num_attention_heads": 8, "attention_head_dim": 8, "rope_inv_freq_len": 1}


def run_ranks(world, tmp_path, config, timeout=300):
    # the ranks import the ComfyUI this process runs
    root = os.path.dirname(os.path.dirname(os.path.abspath(comfy.cli_args.__file__)))
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
               PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    args = [json.dumps(config), str(world), str(tmp_path)]
    ranks = [subprocess.Popen([sys.executable, os.path.abspath(__file__), str(r)] + args, env=env,
                              stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"rank{r}.log", "w")) for r in range(world)]
    try:
        codes = [p.wait(timeout=timeout) for p in ranks]
    finally:
        for p in ranks:
            p.kill()
            p.wait()
    logs = {r: (tmp_path / f"rank{r}.log").read_text()[-3000:] for r in range(world) if codes[r]}
    assert not logs, f"ranks failed: {logs}"
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


def _check(results, world, bf16_tol=2e-2):
    assert len(results) == world
    for rank, report in enumerate(results):
        assert len(report) >= 17
        for name, err in report.items():
            assert err <= (bf16_tol if name == "bf16" else 1e-5), (rank, name, err)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="multi-process gloo tests run on Linux")
@pytest.mark.parametrize("world", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_sharded_matches_native(world, tmp_path):
    _check(run_ranks(world, tmp_path, {}), world)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="multi-process gloo tests run on Linux")
@pytest.mark.parametrize("world", [pytest.param(n, marks=pytest.mark.slow) for n in (5, 6, 7, 8)])
def test_sharded_matches_native_uneven_heads(world, tmp_path):
    _check(run_ranks(world, tmp_path, WIDE), world)


def _rank_main(rank, config, world, out):
    import torch.distributed as dist

    import minimax_h3_cases as cases
    from comfy.ldm.minimax_h3.ulysses import UlyssesParallel

    dist.init_process_group("gloo", init_method="file://" + os.path.join(out, "store"), rank=rank, world_size=world)
    report = {}
    for name, (model_opts, opts) in cases.CASES.items():
        if opts.get("block_patch") or opts.get("controlnet"):  # block patches index global rows: native only
            continue
        model = cases.build_model(model_opts, **config)
        native = cases.run_case(name, model=model)
        sp = UlyssesParallel(rank, world, model.blocks[0].attn.heads)
        sharded = cases.run_case(name, model=model, transformer_options={"minimax_h3_sequence_parallel": sp})
        report[name] = max(float((s.float() - n.float()).abs().max() / n.float().abs().max()) for s, n in zip(sharded, native))
    dist.destroy_process_group()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    _rank_main(int(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
