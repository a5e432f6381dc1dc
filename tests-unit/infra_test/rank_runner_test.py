"""The multi-process test helper itself: results, a raising rank, a hanging rank, no leftovers."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from rank_runner import RankFailure, RankTimeout


def _allreduce(rank, world, scale):
    t = torch.full((3,), float(rank + 1)) * scale
    dist.all_reduce(t)
    return {"sum": t, "rank": rank, "pid": os.getpid()}


def _rank1_raises(rank, world):
    if rank == 1:
        raise ValueError("rank one says no")
    # the others block in a collective the failed rank never joins
    dist.barrier()
    return rank


def _rank0_hangs(rank, world):
    if rank == 0:
        time.sleep(600)
    return rank


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_allreduce_results_per_rank(run_ranks):
    out = run_ranks(_allreduce, 3, kwargs={"scale": 2.0}, timeout=60)
    assert [o["rank"] for o in out] == [0, 1, 2]
    for o in out:
        # (1 + 2 + 3) * 2
        assert torch.equal(o["sum"], torch.full((3,), 12.0))
    assert len({o["pid"] for o in out}) == 3
    assert not any(_alive(o["pid"]) for o in out)


def test_raising_rank_reported_with_traceback(run_ranks):
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as ei:
        run_ranks(_rank1_raises, 3, timeout=60)
    assert ei.value.rank == 1
    assert "ValueError: rank one says no" in ei.value.child_traceback
    # the barrier-blocked ranks were killed after the grace period, not after the hard timeout
    assert time.monotonic() - t0 < 30


def test_hanging_rank_killed_at_timeout(run_ranks):
    t0 = time.monotonic()
    with pytest.raises(RankTimeout, match=r"ranks \[0\] of 2 still running"):
        run_ranks(_rank0_hangs, 2, timeout=8, process_group=False)
    assert time.monotonic() - t0 < 20
