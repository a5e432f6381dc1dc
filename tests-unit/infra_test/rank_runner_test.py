"""The multi-process test helper itself: results, a raising rank, a hanging rank, no leftovers,
a fresh process per rank and call forked from one rank server."""

import os
import sys
import time

import pytest
import torch
import torch.distributed as dist

import rank_runner
from rank_runner import RankFailure, RankTimeout

MARK = []


def _allreduce(rank, world, scale):
    t = torch.full((3,), float(rank + 1)) * scale
    dist.all_reduce(t)
    return {"sum": t, "rank": rank, "pid": os.getpid(), "server": os.getppid()}


def _mark_and_report(rank, world):
    seen = list(MARK)
    MARK.append(rank)  # module state changed by this call only
    return {"seen": seen, "pid": os.getpid(), "server": os.getppid()}


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


def test_every_call_gets_fresh_rank_processes_from_one_server(run_ranks):
    first = run_ranks(_mark_and_report, 2, process_group=False)
    second = run_ranks(_mark_and_report, 2, process_group=False)
    # no call sees what an earlier call changed, and no rank process is reused
    assert [o["seen"] for o in first + second] == [[], [], [], []]
    assert len({o["pid"] for o in first + second}) == 4
    # ... while the interpreter start and the imports are paid once, by the server
    assert len({o["server"] for o in first + second}) == 1 and first[0]["server"] != os.getpid()


def test_raising_rank_reported_with_traceback(run_ranks):
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as ei:
        run_ranks(_rank1_raises, 3, timeout=60)
    assert ei.value.rank == 1
    assert "ValueError: rank one says no" in ei.value.child_traceback
    # the barrier-blocked ranks were killed after the grace period, not after the hard timeout
    assert time.monotonic() - t0 < 30
    assert torch.equal(run_ranks(_allreduce, 3, kwargs={"scale": 1.0})[0]["sum"], torch.full((3,), 6.0))


def test_hanging_rank_killed_at_timeout(run_ranks):
    before = run_ranks(_allreduce, 2, kwargs={"scale": 1.0})[0]["server"]
    t0 = time.monotonic()
    with pytest.raises(RankTimeout, match=r"ranks \[0\] of 2 still running"):
        run_ranks(_rank0_hangs, 2, timeout=8, process_group=False)
    assert time.monotonic() - t0 < 20
    # killed with the server that forked it; the next call starts a new server and works
    assert not _alive(before)
    after = run_ranks(_allreduce, 2, kwargs={"scale": 1.0})
    assert after[0]["server"] != before and torch.equal(after[0]["sum"], torch.full((3,), 3.0))


def test_closing_the_servers_leaves_no_process_or_folder(run_ranks):
    out = run_ranks(_allreduce, 2, kwargs={"scale": 1.0})
    folders = [s.folder for s in rank_runner._servers.values()]
    rank_runner.close_servers()
    assert not _alive(out[0]["server"]) and not any(os.path.exists(f) for f in folders)


def _report_then_hang(rank, world, folder):
    with open(os.path.join(folder, f"rank{rank}.pids.tmp"), "w") as f:
        f.write(f"{os.getpid()} {os.getppid()}")
    os.replace(os.path.join(folder, f"rank{rank}.pids.tmp"), os.path.join(folder, f"rank{rank}.pids"))
    time.sleep(600)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; the server learns of its parent's death by PR_SET_PDEATHSIG (Linux)")
def test_a_killed_test_run_takes_its_rank_server_ranks_and_folder_along(tmp_path):
    # a test run killed with SIGKILL (no cleanup of its own) while its ranks run
    import subprocess
    here = os.path.dirname(os.path.abspath(__file__))
    driver = ("import rank_runner, rank_runner_test as t\n"
              f"rank_runner.run_ranks(t._report_then_hang, 2, kwargs={{'folder': {str(tmp_path)!r}}}, timeout=300)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.path.dirname(here)] + [p for p in sys.path if p]))
    proc = subprocess.Popen([sys.executable, "-c", driver], env=env)
    try:
        deadline = time.monotonic() + 120
        while not all(os.path.exists(tmp_path / f"rank{r}.pids") for r in range(2)):
            assert proc.poll() is None and time.monotonic() < deadline, "the ranks never started"
            time.sleep(0.05)
        pids = [tuple(map(int, (tmp_path / f"rank{r}.pids").read_text().split())) for r in range(2)]
        server = pids[0][1]
        with open(f"/proc/{server}/cmdline", "rb") as f:
            folder = f.read().split(b"\0")[3].decode()  # python rank_runner.py --serve FOLDER
        assert os.path.isdir(folder)
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 60
    while any(_alive(p) for p in [server, *(p for p, _ in pids)]) or os.path.exists(folder):
        assert time.monotonic() < deadline, "the rank server, its ranks or its folder outlived the killed run"
        time.sleep(0.05)
