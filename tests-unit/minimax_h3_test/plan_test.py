"""ForwardPlan digests and ShardPlan geometry (pure, no collectives)."""

import pytest

from comfy.ldm.minimax_h3.plan import ShardPlan, balanced_ranges
from h3_cases import plan_for, tiny_model
from h3_files import INPUT_KINDS


def _digests(rank, world):
    model, cfg = tiny_model()
    return [plan_for(model, cfg, kind).plan.digest() for kind in INPUT_KINDS]


def test_digest_is_stable_across_processes(run_ranks):
    here = _digests(0, 1)
    there = run_ranks(_digests, 2, process_group=False, timeout=120)
    assert there[0] == here and there[1] == here
    assert len(set(here)) == len(INPUT_KINDS)


def test_digest_changes_with_every_input_that_matters():
    model, cfg = tiny_model()
    base = plan_for(model, cfg, "keyframes").plan.digest()
    assert plan_for(model, cfg, "keyframes", sigma=0.5).plan.digest() != base
    assert plan_for(model, cfg, "keyframes", audio_t=6).plan.digest() != base
    assert plan_for(model, cfg, "keyframes", seed=1).plan.digest() != base
    other, _ = tiny_model(curve=9)
    assert plan_for(other, cfg, "keyframes").plan.digest() != base


def _merged(segments):
    out = []
    for a, b, r in segments:
        if out and out[-1][1] == a and out[-1][2] == r:
            out[-1] = (out[-1][0], b, r)
        else:
            out.append((a, b, r))
    return out


def test_balanced_ranges():
    assert balanced_ranges(10, 3) == ((0, 4), (4, 7), (7, 10))
    assert balanced_ranges(56, 8) == tuple((7 * i, 7 * i + 7) for i in range(8))


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("kind", ["t2va", "tags", "keyframes", "refs_all"])
def test_shards_partition_rows_segments_and_targets(world, kind):
    model, cfg = tiny_model()
    plan = plan_for(model, cfg, kind, height=5).plan
    shards = [ShardPlan.build(plan, world, r, heads=4 if world <= 4 else None) for r in range(world)]
    covered, mods, video, audio = [], [], [], []
    for s in shards:
        assert s.rows in (plan.seq_len // world, plan.seq_len // world + 1)
        covered.extend(range(s.row_start, s.row_stop))
        assert [p[:2] for p in s.pieces] == sorted(p[:2] for p in s.pieces)
        assert sum(b - a for a, b, _, _ in s.pieces) == s.rows
        mods.extend((a + s.row_start, b + s.row_start, r) for a, b, r in s.mod_segments)
        video.extend(range(*s.video_rows))
        audio.extend(range(*s.audio_rows))
    assert covered == list(range(plan.seq_len))
    # local segments, rebased back, cover the global ones exactly (split at shard edges)
    assert _merged(mods) == _merged(plan.mod_segments)
    assert video == list(range(plan.video_seg[1] - plan.video_seg[0]))
    assert audio == list(range(plan.audio_seg[1] - plan.audio_seg[0]))
    assert sum(nv for nv, _ in shards[0].target_counts) == len(video)
    assert "rank 0/" in str(shards[0])


def test_shard_refuses_more_ranks_than_heads():
    model, cfg = tiny_model()
    plan = plan_for(model, cfg).plan
    with pytest.raises(ValueError, match="needs at least 5 attention heads; the model has 4"):
        ShardPlan.build(plan, 5, 0, heads=4)
