"""Sequence-parallel H3 on real gloo process groups: sharded output == native output.

Tolerance: fp32 max |diff| <= 1e-5 * max |native| (the all-to-all reorders no arithmetic within a
row; differences come only from GEMM blocking on different row counts). bf16 is checked at 2e-2.
"""

import pytest
import torch

from comfy.ldm.minimax_h3 import SequenceParallelRunner
from comfy.ldm.minimax_h3.ulysses import UlyssesAttention, sharded_forward
from h3_cases import plan_for, tiny_model
from h3_files import INPUT_KINDS

CASES = [(kind, None) for kind in INPUT_KINDS] + [("t2va", 9), ("refs_all", 9)]


def _parity(rank, world, dtype="float32", cases=None, shapes=((5, 7), (6, 8)), overrides=None, chunks=2, training=False):
    dt = getattr(torch, dtype)
    if training:  # ComfyUI's training mode: the out-of-place q/k norm + rope kernel, normed up front
        import comfy.model_management
        comfy.model_management.in_training = True
    report = []
    for kind, curve in cases or CASES:
        model, cfg = tiny_model(dtype=dt, curve=curve, **(overrides or {}))
        for height, text_len in shapes:  # odd latent height (padded) and odd/even sequence lengths
            case = plan_for(model, cfg, kind, height=height, text_len=text_len)
            v, a = sharded_forward(model, case.plan, case.inputs, rank, world, chunks=chunks)
            if rank == 0:
                native = case.forward(model)
                sharded = model.unpack(case.plan, v, a, case.x[0].dtype, case.x[1].dtype)
                err = max(float((s - n).abs().max() / n.abs().max()) for s, n in zip(sharded, native))
                report.append({"kind": kind, "curve": curve, "height": height, "seq": case.plan.seq_len, "err": err})
            else:
                assert v is None and a is None
    return report


@pytest.mark.parametrize("world", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_sharded_matches_native_fp32(run_ranks, world):
    report = run_ranks(_parity, world, timeout=240)[0]
    assert len(report) == 2 * len(CASES)
    assert {r["seq"] % 2 for r in report} == {0, 1}
    for r in report:
        assert r["err"] <= 1e-5, r


def test_sharded_matches_native_bf16(run_ranks):
    report = run_ranks(_parity, 3, kwargs={"dtype": "bfloat16", "cases": [["keyframes", None]], "shapes": [[5, 7]]},
                       timeout=120)[0]
    assert report[0]["err"] <= 2e-2, report


@pytest.mark.parametrize("world,chunks", [(2, 1), (3, 2), pytest.param(2, 4, marks=pytest.mark.slow)])
def test_pipelined_chunks_match_native(run_ranks, world, chunks):
    # 8 heads: N=3 gives ranks 3/3/2 heads, so chunks=2 cuts them unevenly (2+1, 2+1, 1+1); N=2, chunks=4 is 1 head each
    overrides = {"num_attention_heads": 8, "attention_head_dim": 8, "rope_inv_freq_len": 1}
    report = run_ranks(_parity, world, kwargs={"cases": [["refs_all", 9]], "overrides": overrides, "chunks": chunks},
                       timeout=120)[0]
    for r in report:
        assert r["err"] <= 1e-5, r


def test_out_of_place_qk_norm_matches_native(run_ranks):
    # in training the fused norm + rope kernel returns new tensors: q|k|v is normed whole before the exchange
    report = run_ranks(_parity, 2, kwargs={"cases": [["refs_all", 9]], "training": True}, timeout=120)[0]
    for r in report:
        assert r["err"] <= 1e-5, r


@pytest.mark.parametrize("heads,world,chunks,expect", [(56, 8, 2, 2), (56, 8, 16, 7), (8, 3, 2, 2), (4, 3, 2, 1)])
def test_chunk_heads_cover_every_head_in_order(heads, world, chunks, expect):
    model, cfg = tiny_model()
    plan = plan_for(model, cfg).plan
    for rank in range(world):
        sp = UlyssesAttention(plan.shard(world, rank, heads), heads, 8, chunks=chunks)
        assert sp.chunks == expect
        # concatenation order of attention() (chunk-major, then rank) must be the global head order
        order = [sp.chunk_heads[c][j] for c in range(sp.chunks) for j in range(world)]
        assert [h for a, b in order for h in range(a, b)] == list(range(heads))
        assert all(b > a for ranges in sp.chunk_heads for a, b in ranges)
        # each chunk is one contiguous span of the global heads, exactly those its ranks' pieces hold
        # (prepare() gets one slice per chunk)
        for (a, b), ranges in zip(sp.chunk_span, sp.chunk_heads):
            assert list(range(a, b)) == [h for lo, hi in ranges for h in range(lo, hi)]
        # rank j holds heads // world heads, one more for the first heads % world ranks
        counts = [heads // world + (j < heads % world) for j in range(world)]
        assert [sum(sp.chunk_sizes[c][j] for c in range(sp.chunks)) for j in range(world)] == counts
        if sp.chunks == 1:
            assert [tuple(r) for r in sp.chunk_heads[0]] == list(plan.shard(world, rank, heads).head_ranges)


def _pack_all(sp, qkv):
    """[s_r, 3, H, D] -> the send buffers of every chunk, as attention() packs them one chunk at a time."""
    send = torch.empty(qkv.numel(), dtype=qkv.dtype)
    offsets = sp._send_offsets(qkv.shape[0])
    for c in range(sp.chunks):
        sp._pack_chunk(send[offsets[c]:offsets[c + 1]], qkv, c)
    return send


def test_chunk_layout_of_eight_heads_over_three_ranks():
    # by hand: ranks hold 3 / 3 / 2 heads; two chunks cut them 2 + 1, 2 + 1, 1 + 1; chunk 0 is global
    # heads 0..4 (rank 0: 0-1, rank 1: 2-3, rank 2: 4), chunk 1 heads 5..7 (one each)

    model, cfg = tiny_model()
    sp = UlyssesAttention(plan_for(model, cfg).plan.shard(3, 1, 8), 8, 4, chunks=2)
    assert sp.heads == [3, 3, 2]
    assert sp.chunk_sizes == [[2, 2, 1], [1, 1, 1]]
    assert sp.chunk_heads == [[(0, 2), (2, 4), (4, 5)], [(5, 6), (6, 7), (7, 8)]]
    assert sp.chunk_span == [(0, 5), (5, 8)]


@pytest.mark.parametrize("heads,world,chunks", [(8, 2, 1), (8, 2, 3), (56, 8, 2), (8, 3, 2), (12, 4, 2)])
@pytest.mark.parametrize("dtype,dim", [(torch.float32, 4), (torch.bfloat16, 8), (torch.bfloat16, 6)])
def test_pack_heads_lays_out_every_piece(heads, world, chunks, dtype, dim):
    # the send buffer is chunk-major, then rank-major, each piece [s_r, 3, h_jc, D] of this rank's rows;
    # copied as 8-byte words when a head is a whole number of them (bf16 x 6 is not)

    model, cfg = tiny_model()
    plan = plan_for(model, cfg).plan
    sp = UlyssesAttention(plan.shard(world, 1, heads), heads, dim, chunks=chunks)
    qkv = torch.randn(sp.rows[1], 3, heads, dim).to(dtype)
    expect = torch.cat([qkv[:, :, a:b].reshape(-1) for ranges in sp.chunk_heads for a, b in ranges])
    send = _pack_all(sp, qkv)
    assert send.dtype == dtype and torch.equal(send, expect)


@pytest.mark.parametrize("heads,world,chunks", [(8, 2, 2), (8, 3, 2), (56, 8, 2), (12, 4, 3)])
def test_each_chunk_is_prepared_just_before_it_is_sent(heads, world, chunks):
    # prepare(a, b) runs once per chunk on its global head span, after the previous chunk's q|k|v
    # all-to-all was issued (so its transfer overlaps the work) and before this chunk is packed (so
    # what leaves is the prepared data); exchanges recorded without a process group

    model, cfg = tiny_model()
    plan = plan_for(model, cfg).plan
    events, dim = [], 4

    class Recording(UlyssesAttention):
        def _a2a(self, recv, send, out_splits, in_splits):
            events.append(("a2a", send.clone()))
            recv.zero_()
            return type("Done", (), {"wait": lambda self: None})()

    sp = Recording(plan.shard(world, 0, heads), heads, dim, chunks=chunks)
    qkv = torch.randn(sp.rows[0], 3, heads, dim)
    expected = qkv.clone()
    expected[:, :2] *= 2

    def prepare(a, b):
        events.append(("prepare", (a, b)))
        qkv[:, :2, a:b] *= 2

    out = sp.attention(qkv, {}, prepare=prepare)
    assert out.shape == (sp.rows[0], heads * dim)
    n = sp.chunks
    # prepare 0, send 0; then per chunk c: prepare and send c + 1 (if any), chunk c's output exchange
    expect = ["prepare", "a2a"] + sum(((["prepare", "a2a"] if c + 1 < n else []) + ["a2a"] for c in range(n)), [])
    assert [e[0] for e in events] == expect
    assert [e[1] for e in events if e[0] == "prepare"] == sp.chunk_span
    sent = [b[1] for a, b in zip(events, events[1:]) if a[0] == "prepare"]  # the q|k|v exchanges
    assert torch.equal(torch.cat(sent), _pack_all(sp, expected))


def test_chunks_must_be_positive():

    model, cfg = tiny_model()
    plan = plan_for(model, cfg).plan
    with pytest.raises(ValueError, match="chunks must be >= 1"):
        UlyssesAttention(plan.shard(2, 0, 4), 4, 16, chunks=0)


def _adaln_shared(rank, world, layers):

    model, cfg = tiny_model(num_layers=layers)
    plan = plan_for(model, cfg, "keyframes").plan
    sp = UlyssesAttention(plan.shard(world, rank, model.num_heads), model.num_heads, cfg["attention_head_dim"])
    t_emb = model.time_embedding(plan, "cpu", torch.float32)
    projections = [block.adaln_proj for block in model.blocks]
    calls = []
    for i, p in enumerate(projections):
        p.project = (lambda t, p=p, i=i: calls.append(i) or type(p).project(p, t))
    shared = sp.adaln_projections(projections, t_emb)
    for p in projections:
        del p.project
    exact = all(torch.equal(s, p.project(t_emb)) for s, p in zip(shared, projections))
    return {"calls": calls, "exact": exact, "count": len(shared), "rows": int(t_emb.shape[0])}


@pytest.mark.parametrize("world,layers", [(3, 4), pytest.param(2, 5, marks=pytest.mark.slow), pytest.param(4, 2, marks=pytest.mark.slow)])
def test_adaln_projections_are_split_over_ranks_and_shared(run_ranks, world, layers):
    # each rank projects only blocks r, r + N, ... (an idle rank, N > blocks, projects one for the shape)
    # and every rank ends with every block's projection, bit-identical to projecting it itself
    results = run_ranks(_adaln_shared, world, kwargs={"layers": layers}, timeout=120)
    for rank, r in enumerate(results):
        assert r["calls"] == (list(range(rank, layers, world)) or [0]), f"rank {rank} projected blocks {r['calls']}"
        assert r["count"] == layers and r["exact"], f"rank {rank}: shared projections differ from its own"
    assert results[0]["rows"] >= 2  # keyframes: more than one timestep, so rows are not interchangeable


def _run_projects(rank, world):
    from comfy.ldm.minimax_h3.ulysses import UlyssesAttention, gather_targets
    from comfy.ldm.minimax_h3.modules import AdalnProj
    model, cfg = tiny_model(num_layers=5)
    case = plan_for(model, cfg, "keyframes")
    plan = case.plan
    shard = plan.shard(world, rank, model.num_heads)
    sp = UlyssesAttention(shard, model.num_heads, cfg["attention_head_dim"], chunks=2)
    index = {id(b.adaln_proj): i for i, b in enumerate(model.blocks)}
    calls, project = [], AdalnProj.project

    def counting(self, t_emb):
        calls.append(index.get(id(self), "final"))
        return project(self, t_emb)

    class Minimal:  # a runner offering only what run() requires: no adaln_projections
        world_size = sp.world_size
        attention = sp.attention

    AdalnProj.project = counting
    try:
        shared = gather_targets(shard, *model.run(plan, shard, case.inputs, seq_parallel=sp))
        shared_calls, calls[:] = list(calls), []
        minimal = gather_targets(shard, *model.run(plan, shard, case.inputs, seq_parallel=Minimal()))
        minimal_calls = list(calls)
    finally:
        AdalnProj.project = project
    if rank != 0:
        return {"shared_calls": shared_calls, "minimal_calls": minimal_calls}
    native = case.forward(model)
    errs = []
    for rows in (shared, minimal):
        out = model.unpack(plan, *rows, torch.float32, torch.float32)
        errs.append(max(float((o - n).abs().max() / n.abs().max()) for o, n in zip(out, native)))
    return {"shared_calls": shared_calls, "minimal_calls": minimal_calls, "errs": errs}


def test_run_projects_only_its_share_of_the_blocks(run_ranks):
    # model.run under sequence parallelism projects blocks r, r + N, ... on rank r; a runner without
    # adaln_projections (an older or external one) still works, every block projecting its own
    results = run_ranks(_run_projects, 2, timeout=120)
    for rank, r in enumerate(results):
        assert r["shared_calls"] == list(range(rank, 5, 2)) + ["final"], r["shared_calls"]
        assert r["minimal_calls"] == list(range(5)) + ["final"], r["minimal_calls"]
    assert max(results[0]["errs"]) <= 1e-5, results[0]["errs"]


@pytest.mark.slow
@pytest.mark.parametrize("world", [5, 6, 7, 8])
def test_sharded_matches_native_large_worlds(run_ranks, world):
    # 8 heads of 8 (rope on 6 of them), so every world up to 8 has at least one head per rank
    overrides = {"num_attention_heads": 8, "attention_head_dim": 8, "rope_inv_freq_len": 1}
    report = run_ranks(_parity, world, kwargs={"cases": [["t2va", None], ["refs_all", 9]], "overrides": overrides},
                       timeout=600)[0]
    for r in report:
        assert r["err"] <= 1e-5, r


def test_the_ulysses_runner_satisfies_the_protocol_and_incomplete_runners_do_not():
    model, cfg = tiny_model()
    plan = plan_for(model, cfg).plan
    assert isinstance(UlyssesAttention(plan.shard(2, 0, 4), 4, 16), SequenceParallelRunner)

    class NoAttention:
        world_size = 2
    assert not isinstance(NoAttention(), SequenceParallelRunner)
