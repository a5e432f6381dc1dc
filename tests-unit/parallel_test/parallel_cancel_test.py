"""Cooperative cancellation: prompt return, consistent abandonment, and the kill deadline."""

import threading
import time

import pytest
import torch
from parallel_helpers import IMPORTS

from comfy.parallel import ParallelCancelled, ParallelGroup, Timeouts

PROMPT = 1.0


def cancel_when_started(g, started, record):
    def go():
        if started.wait(20):
            t0 = time.monotonic()
            record["returned"] = g.cancel()
            record["at"] = t0
            record["took"] = time.monotonic() - t0
    t = threading.Thread(target=go)
    t.start()
    return t


def test_cancel_during_long_op_returns_promptly_and_next_op_works(tmp_path):
    started = threading.Event()
    with ParallelGroup("cancel", log_dir=str(tmp_path)) as g:
        g.start(["cpu", "cpu", "cpu"], IMPORTS, local_state={"started": started})
        assert g.cancel() is False, "nothing is in flight"
        record = {}
        t = cancel_when_started(g, started, record)
        with pytest.raises(ParallelCancelled, match="op 'test.wait_for_cancel' \\(id 1\\) was cancelled") as info:
            g.run("test.wait_for_cancel", meta={"seconds": 30, "poll": 0.02})
        raised = time.monotonic()
        t.join()
        assert record["returned"] is True
        assert record["took"] < 0.5, "cancel() must not wait for the op"
        assert raised - record["at"] < PROMPT
        assert info.value.group_broken is False
        assert g.state == "ready"
        res = g.run("test.echo", {"x": torch.arange(4)}, {"after": "cancel"})
        assert res.tensors["x"].tolist() == [0, 1, 2, 3]
        assert [m["meta"] for m in res.metas] == [{"after": "cancel"}] * 3
        assert res.op_id == 2
        for r in (1, 2):
            assert "op 'test.wait_for_cancel' (id 1) cancelled" in (tmp_path / f"rank{r}-gen1.log").read_text()


def test_op_that_ignores_cancel_past_the_deadline_is_killed(tmp_path):
    started = threading.Event()
    with ParallelGroup("stubborn", log_dir=str(tmp_path), timeouts=Timeouts(cancel=1.0)) as g:
        g.start(["cpu", "cpu"], IMPORTS, local_state={"started": started})
        record = {}
        t = cancel_when_started(g, started, record)
        with pytest.raises(ParallelCancelled) as info:
            g.run("test.workers_sleep", meta={"seconds": 30})
        raised = time.monotonic()
        t.join()
        assert 1.0 <= raised - record["at"] < 1.0 + 3.0
        assert info.value.group_broken is True
        assert "did not acknowledge cancel of op 'test.workers_sleep' (id 1) within 1s" in str(info.value)
        assert g.state == "broken"
        assert info.value.__cause__.rank == 1
        g.ensure_started()
        assert g.run("test.echo", {"x": torch.ones(1)}).tensors["x"].tolist() == [1.0]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["rank1-gen1.log", "rank1-gen2.log"]


def test_op_that_finishes_despite_cancel_still_reports_cancelled(tmp_path):
    """The op never checks ctx.cancelled(), so every rank finishes it normally; run() still raises
    ParallelCancelled (a caller that asked to cancel must not take a result as if it had not)."""
    started = threading.Event()
    with ParallelGroup("late", log_dir=str(tmp_path)) as g:
        g.start(["cpu", "cpu"], IMPORTS, local_state={"started": started})
        record = {}
        t = cancel_when_started(g, started, record)
        with pytest.raises(ParallelCancelled, match=r"op 'test.finish_ignoring_cancel' \(id 1\) was cancelled; the group is ready") as info:
            g.run("test.finish_ignoring_cancel", meta={"seconds": 2.0})
        t.join()
        assert record["returned"] is True, "cancel() must have reached the op while it ran"
        assert info.value.group_broken is False
        assert g.state == "ready"
        assert "cancelled" not in (tmp_path / "rank1-gen1.log").read_text(), "the worker finished the op"
        assert g.run("parallel.noop").metas == [{}, {}]
