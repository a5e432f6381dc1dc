"""comfy.parallel.ParallelGroup on CPU worker processes: lifecycle, ops, errors that leave the group ready,
and what the group does not do to the process it runs in."""

import os
import sys
import threading

import pytest
import torch
import torch.distributed as dist
from parallel_helpers import IMPORTS, child_pids, listening, sockets

from comfy.parallel import (ParallelCancelled, ParallelError, ParallelGroup, ParallelOpError, ParallelStateError, PreflightMismatch,
                            register_op, unregister_op)


@pytest.fixture(scope="module")
def group():
    """One 3-rank group for the tests that leave it ready (each asserts that it does)."""
    g = ParallelGroup("shared-test", slot_bytes=4096 * 3)
    g.start(["cpu"] * 3, IMPORTS)
    yield g
    g.close()


def test_every_rank_runs_the_op_and_rank0_gets_every_value(group):
    out = group.run("test.echo", {"x": [1, "two"]})
    assert out.values[0]["rank"] == 0 and [v["rank"] for v in out.values] == [0, 1, 2]
    assert all(v["world"] == 3 and v["meta"] == {"x": [1, "two"]} for v in out.values)
    assert sorted(v["pid"] for v in out.values[1:]) == sorted(group.worker_pids().values())
    assert out.values[0]["pid"] == os.getpid() and group.state == "ready"


def test_collectives_move_exact_bytes_in_several_rounds(group):
    # a 12 KiB transport: lanes of 4 KiB, so most of these take several rounds; zero-size pieces too
    sizes = [[4, 40000, 0], [12000, 8, 4096], [0, 8192, 20000]]
    assert group.run("test.exchange", {"sizes": sizes, "broadcast": 9000}).values == [True, True, True]


def test_workers_run_ops_in_inference_mode_as_comfyui_runs_nodes(group):
    # a VAE's weights require grad: a worker outside inference mode kept every activation of its decode (OOM on a GPU)
    assert group.run("test.grad_modes").values == [{"inference": False, "graph": True}] + [{"inference": True, "graph": False}] * 2
    with torch.inference_mode():  # rank 0 runs its share in its caller's mode
        assert group.run("test.grad_modes").values[0] == {"inference": True, "graph": False}


def test_an_error_on_a_worker_is_named_and_the_group_stays_ready(group):
    pids = group.worker_pids()
    with pytest.raises(ParallelOpError, match="raised ValueError on worker rank 2: bad input on rank 2") as e:
        group.run("test.fail", {"rank": 2})
    assert e.value.rank == 2 and e.value.type_name == "ValueError" and "raise ValueError" in e.value.remote_traceback
    assert group.state == "ready" and group.worker_pids() == pids
    assert group.run("test.echo").values[2]["rank"] == 2


def test_an_error_on_rank0_is_raised_as_it_is_and_the_group_stays_ready(group):
    with pytest.raises(ValueError, match="^bad input on rank 0$"):
        group.run("test.fail", {"rank": 0})
    assert group.state == "ready" and len(group.run("test.echo").values) == 3


def test_a_preflight_mismatch_stops_every_rank_and_the_group_stays_ready(group):
    with pytest.raises(PreflightMismatch, match="ranks \\[1\\] computed another preflight digest"):
        group.run("test.preflight", {"odd": 1})
    group.run("test.preflight", {})
    assert group.state == "ready"


def test_a_value_a_worker_cannot_send_is_its_error(group):
    assert group.run("test.value", {"bad": False}).values[1:] == [[1, 2], [1, 2]]
    assert torch.equal(group.run("test.value", {"bad": False}).values[0], torch.arange(3))
    with pytest.raises(ParallelOpError, match="raised TypeError on worker rank 1: the result message must be JSON"):  # the lowest failing rank
        group.run("test.value", {"bad": True})
    assert group.state == "ready"


def test_an_op_only_rank0_has_fails_on_the_workers_and_leaves_the_group_ready(group):
    register_op("test.rank0_only", lambda ctx, meta: ctx.transport.all_gather_bytes(b"x"))
    try:
        with pytest.raises(ParallelOpError, match="raised KeyError on worker rank 1: .*op 'test.rank0_only' is not registered"):
            group.run("test.rank0_only")
    finally:
        unregister_op("test.rank0_only")
    assert group.state == "ready"


def test_bad_calls_are_refused_before_anything_is_sent(group):
    with pytest.raises(KeyError, match="op 'nope' is not registered"):
        group.run("nope")
    with pytest.raises(TypeError, match="must be JSON"):
        group.run("test.echo", {"t": torch.zeros(1)})
    with pytest.raises(ParallelStateError, match="start\\(\\) needs state idle or closed"):
        group.start(["cpu"] * 2, IMPORTS)
    with pytest.raises(ValueError, match="needs 2 or more devices"):
        ParallelGroup().start(["cpu"])
    with pytest.raises(ValueError, match="this machine has 0 CUDA device"):
        ParallelGroup().start(["cuda:0", "cuda:7"]) if not torch.cuda.is_available() else pytest.skip("a CUDA machine")
    assert group.state == "ready"


def test_cancel_stops_the_op_on_every_rank_and_the_group_stays_ready(group):
    """cancel() from another thread while a worker works and the others wait for it."""
    started = threading.Timer(0.5, group.cancel)
    started.start()
    with pytest.raises(ParallelCancelled, match="was cancelled; the group is ready"):
        group.run("test.busy", {"ranks": [0], "seconds": 2})
    assert group.state == "ready" and group.cancel() is False
    assert len(group.run("test.echo").values) == 3


def test_the_process_keeps_no_distributed_state_and_two_groups_coexist(group):
    other = ParallelGroup("second")
    try:
        other.start(["cpu"] * 2, IMPORTS)
        assert not dist.is_initialized()
        assert [v["rank"] for v in other.run("test.echo").values] == [0, 1]
        assert [v["rank"] for v in group.run("test.echo").values] == [0, 1, 2]
        assert set(other.worker_pids().values()).isdisjoint(group.worker_pids().values())
    finally:
        other.close()
    assert group.state == "ready"


def test_nothing_listens_on_a_socket(group):
    """No rank of a ready group holds a listening or bound socket: another local user has nothing to connect to."""
    pids = [os.getpid(), *group.worker_pids().values()]
    held = sockets(pids)
    found = listening({inode for inodes in held.values() for inode in inodes})
    assert found == [], found


def test_a_closed_group_leaves_no_process_fd_or_file(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    fds = set(os.listdir("/proc/self/fd"))
    g = ParallelGroup("clean")
    g.start(["cpu"] * 2, IMPORTS)
    pids = g.worker_pids()
    g.close()
    g.close()  # idempotent
    assert g.state == "closed" and g.worker_pids() == {}
    assert not set(pids.values()) & set(child_pids())
    assert set(os.listdir("/proc/self/fd")) <= fds | {str(max(map(int, fds)) + 1)}  # the listing's own fd
    assert os.listdir(tmp_path) == []
    with pytest.raises(ParallelStateError, match="needs state ready; group 'clean' is closed"):
        g.run("test.echo")


def test_a_module_changed_on_disk_after_import_is_refused_by_name(tmp_path, monkeypatch):
    """Workers import from disk: one whose source changed since rank 0 imported it would run other code."""
    module = tmp_path / "parallel_skew_for_tests.py"
    module.write_text("from comfy.parallel import register_op\n\n\n@register_op('test.skew')\ndef skew(ctx, meta):\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import parallel_skew_for_tests  # noqa: F401
    module.write_text(module.read_text().replace("return 1", "return 2"))
    g = ParallelGroup("skew")
    try:
        with pytest.raises(ParallelError, match="parallel_skew_for_tests.py changed on disk after ComfyUI imported it.*restart ComfyUI"):
            g.start(["cpu"] * 2, IMPORTS + ["parallel_skew_for_tests"])
        assert g.state == "closed" and g.worker_pids() == {}
    finally:
        unregister_op("test.skew")
        sys.modules.pop("parallel_skew_for_tests")
