"""Ulysses sequence-parallel MiniMax H3 on a real comfy.parallel group (CPU worker processes, the shared
memory transport): every case's sharded output equals the native forward's, through the all-to-all of
q|k|v and through the gather of hidden rows (the op is in h3_ulysses_ops.py, which the workers import).

Tolerance: fp32 max |diff| <= 1e-5 * max |native| (the all-to-alls reorder no arithmetic within a row;
differences come only from GEMM blocking on other row counts); bf16 to 2e-2. The fp8 exchange is lossy
by design: 2e-2, and it must differ from the exact exchange.
"""

import os
import sys

import pytest

import minimax_h3_cases as cases
from h3_ulysses_ops import OP
import comfy.ops
from comfy.ldm.minimax.ulysses import UlyssesParallel
from comfy.parallel import ParallelGroup

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="comfy.parallel groups run on Linux")
SLOW = pytest.mark.skipif(not os.environ.get("COMFY_TEST_SLOW"), reason="4-8 ranks: set COMFY_TEST_SLOW=1")

# 8 heads with a rope that fits 8-dim heads: up to 8 ranks, uneven head splits at 3, 5, 6, 7
WIDE = {"num_attention_heads": 8, "attention_head_dim": 8, "rope_inv_freq_len": 1}


def run(world, config=None, chunks=2, fp8=False, gather=None):
    # small transport slots: every exchange of these tiny models takes several rounds
    with ParallelGroup("h3-ulysses-test", slot_bytes=4096 * world) as group:
        group.start(["cpu"] * world, ["h3_ulysses_ops"])
        return group.run(OP, {"config": config or {}, "chunks": chunks, "fp8": fp8, "gather": gather}).values[0]


def check(report, bf16_tol=2e-2, tol=1e-5):
    report = dict(report)
    sent = report.pop("bytes sent by rank 0")
    assert len(report) >= 17 and sent > 0
    for name, err in report.items():
        assert err <= (bf16_tol if name == "bf16" else tol), (name, err)
    return sent


@pytest.mark.parametrize("world,chunks", [(2, 2), (3, 1)])
def test_sharded_matches_native_both_exchanges_and_the_choice_is_by_bytes(world, chunks):
    # the tiny model (hidden 64, 4 heads of 16) gathers where N * 64 < 3 * 64: at N = 2, not at N = 3
    auto, gathered, exchanged = (check(run(world, chunks=chunks, gather=g)) for g in (None, True, False))
    assert auto == (gathered if world == 2 else exchanged)
    # per block rank 0 sends its s_0 hidden rows to N - 1 ranks and the q|k|v of every other rank's heads:
    # s_0 * 64 * (N - 1) against s_0 * 3 * 64 * (N - 1) / N floats; the returns and the rest are the same
    assert (gathered < exchanged) == (world == 2)


def test_fp8_exchange_is_close_but_not_exact():
    for gather in (True, False):
        report = dict(run(2, fp8=True, gather=gather))
        report.pop("bytes sent by rank 0")
        assert max(report.values()) <= 2e-2 and min(report.values()) > 1e-4, (gather, report)


@SLOW
@pytest.mark.parametrize("world", [4, 5, 6, 7, 8])
def test_sharded_matches_native_uneven_heads(world):
    check(run(world, WIDE, chunks=3))


def test_the_gather_is_chosen_only_for_comfyui_s_plain_linear():
    # a projection whose forward is not ComfyUI's plain Linear (mixed precision: quantized weights, whose
    # rows this code cannot cut) keeps the all-to-all, as does a width where the gather moves more
    def gathers(world, operations):
        attn = cases.build_model({}, operations=operations).blocks[0].attn
        return UlyssesParallel(0, world, attn.heads, None).gathers(attn)

    assert gathers(2, comfy.ops.disable_weight_init) and gathers(2, comfy.ops.manual_cast)
    assert not gathers(3, comfy.ops.disable_weight_init)
    assert not gathers(2, comfy.ops.mixed_precision_ops({}))
    attn = cases.build_model({}).blocks[0].attn
    attn.__class__ = type("Patched", (type(attn),), {"project_qkv": lambda self, x, rope_freqs=None: None})
    assert not UlyssesParallel(0, 2, attn.heads, None).gathers(attn)  # its own projection: the all-to-all calls it
