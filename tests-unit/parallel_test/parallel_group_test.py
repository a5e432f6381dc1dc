"""ParallelGroup lifecycle with real worker processes on CPU (gloo)."""

import os
import signal
import stat
import sys
import tempfile
import threading
import time

import parallel_ops_for_tests as test_ops
import pytest
import torch
from parallel_helpers import child_pids, listening_sockets, spec, wait_until

from comfy.parallel import ParallelGroup, ParallelGroupError, ParallelStateError, PreflightMismatch, process_groups, register_op, unregister_op

pytestmark = pytest.mark.usefixtures("linux_workers")


def make_inputs():
    return {
        "f32": torch.randn(3, 5, generator=torch.Generator().manual_seed(0)),
        "bf16": torch.linspace(-2, 2, 7).to(torch.bfloat16),
        "i64": torch.arange(6, dtype=torch.int64).reshape(2, 3) - 3,
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "strided": torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),
    }


@pytest.mark.parametrize("world", [2, 4])
def test_start_echo_collectives_close(tmp_path, world):
    lock = threading.Lock()
    g = ParallelGroup(f"n{world}", log_dir=str(tmp_path))
    assert g.state == "idle"
    before = set(child_pids())  # e.g. the suite's rank servers
    t0 = time.monotonic()
    g.start(["cpu"] * world, spec("parallel_ops_for_tests:setup_build", value="w"), local_state={"built": "rank0", "lock": lock})
    wall = time.monotonic() - t0
    try:
        assert g.state == "ready"
        assert g.world_size == world
        pids = g.worker_pids()
        assert sorted(pids) == list(range(1, world))
        assert set(pids.values()) == set(child_pids()) - before
        assert [m and m["built"] for m in g.setup_metas] == [None] + [f"w-rank{r}" for r in range(1, world)]
        phases = dict(g.startup_seconds)
        total = phases.pop("total")
        assert sorted(phases) == ["probe", "rendezvous", "setup", "spawn_and_import"]
        assert all(v >= 0 for v in phases.values()) and sum(phases.values()) == pytest.approx(total)
        assert 0 < total <= wall, "the phases are measured inside start()"

        inputs = make_inputs()
        res = g.run("test.echo", inputs, {"step": 3, "tag": "é"})
        assert g.state == "ready"
        assert sorted(res.tensors) == sorted(inputs)
        for k, t in inputs.items():
            assert res.tensors[k].dtype == t.dtype and torch.equal(res.tensors[k], t), k
        want = {k: [test_ops.digest(t), str(t.dtype), list(t.shape), "cpu"] for k, t in inputs.items()}
        assert [m["rank"] for m in res.metas] == list(range(world))
        for m in res.metas:
            assert m["seen"] == want
            assert m["meta"] == {"step": 3, "tag": "é"}
            assert m["world"] == world

        x = torch.tensor([1.0, -2.0])
        res = g.run("test.collectives", {"x": x})
        total = world * (world + 1) / 2
        assert res.tensors["sum"].tolist() == [total] * 3
        assert res.tensors["scaled"].tolist() == [total, -2 * total]
        assert [m["a2a"] for m in res.metas] == [[100.0 * j + r for j in range(world)] for r in range(world)]

        res = g.run("test.state")
        assert [m["built"] for m in res.metas] == ["rank0"] + [f"w-rank{r}" for r in range(1, world)]
        assert res.op_id == 3
    finally:
        g.close()
    assert g.state == "closed"
    assert set(child_pids()) == before
    assert sorted(os.listdir(tmp_path)) == [f"rank{r}-gen1.log" for r in range(1, world)]
    g.close()
    assert g.state == "closed"


def test_wrong_state_calls_are_refused(tmp_path):
    g = ParallelGroup("states", log_dir=str(tmp_path))
    with pytest.raises(ParallelStateError, match="run\\(\\) needs a ready group; group 'states' is idle; call start"):
        g.run("parallel.noop")
    assert g.cancel() is False
    g.start(["cpu", "cpu"], spec())
    try:
        with pytest.raises(ParallelStateError, match="start\\(\\) needs state idle or closed; group 'states' is ready; call close"):
            g.start(["cpu", "cpu"], spec())
        other = ParallelGroup("other", log_dir=str(tmp_path / "other"))
        with pytest.raises(ParallelStateError, match="group 'states' \\(state ready, 2 ranks\\) is active in this process"):
            other.start(["cpu", "cpu"], spec())
        assert other.state == "idle"
        assert g.run("parallel.noop").metas == [{}, {}]
    finally:
        g.close()
    with pytest.raises(ParallelStateError, match="is closed; call start"):
        g.run("parallel.noop")


def test_restart_in_same_process_keeps_every_log(tmp_path):
    with ParallelGroup("restart", log_dir=str(tmp_path)) as g:
        g.start(["cpu", "cpu"], spec())
        first = g.worker_pids()[1]
        g.close()
        g.start(["cpu", "cpu", "cpu"], spec())
        assert g.worker_pids()[1] != first
        assert g.run("test.collectives", {"x": torch.ones(1)}).tensors["sum"].tolist() == [6.0] * 3
    assert g.state == "closed"
    logs = sorted(os.listdir(tmp_path))
    assert logs == ["rank1-gen1.log", "rank1-gen2.log", "rank2-gen2.log"]
    first_log = (tmp_path / "rank1-gen1.log").read_text()
    assert "ready: rank 1 of 2" in first_log and "shutdown requested by rank 0" in first_log
    assert "ready: rank 1 of 3" in (tmp_path / "rank1-gen2.log").read_text()


def temp_root(tmp_path, monkeypatch, where):
    """Point the temp directory the group uses (ComfyUI's, which may not exist yet, else the system's)
    into ``tmp_path``."""
    root = tmp_path / "temp"
    if where == "comfyui":
        folder_paths = pytest.importorskip("folder_paths", reason="ComfyUI is not importable (set COMFYUI_DIR)")
        monkeypatch.setattr(folder_paths, "temp_directory", str(root))
    else:
        root.mkdir()
        monkeypatch.setitem(sys.modules, "folder_paths", None)
        monkeypatch.setattr(tempfile, "tempdir", str(root))
    return root


@pytest.mark.parametrize("where", ["comfyui", "system"])
def test_own_log_folder_is_removed_on_close(tmp_path, monkeypatch, where):
    root = temp_root(tmp_path, monkeypatch, where)
    with ParallelGroup("tidy") as g:
        for world in (2, 3):
            g.start(["cpu"] * world, spec())
            assert os.path.dirname(g.log_dir) == str(root)
            assert os.path.basename(g.log_dir).startswith("comfy-parallel-tidy-")
            # one log per worker, named after the start it belongs to (the second start is generation 2)
            assert sorted(os.listdir(g.log_dir)) == [f"rank{r}-gen{world - 1}.log" for r in range(1, world)]
            g.close()
            assert os.listdir(root) == [], "a clean close() leaves no logs behind"


def test_a_fault_keeps_the_log_folder_and_names_it(tmp_path, monkeypatch):
    root = temp_root(tmp_path, monkeypatch, "system")
    with ParallelGroup("kept") as g:
        g.start(["cpu", "cpu"], spec())
        kept = g.log_dir
        os.kill(g.worker_pids()[1], signal.SIGKILL)
        assert wait_until(lambda: g.state == "broken", 10.0) is not None
        with pytest.raises(ParallelGroupError) as info:
            g.run("test.echo")
        assert f"Worker logs (kept after close()): {kept}" in str(info.value)
        g.close()
        assert os.listdir(kept) == ["rank1-gen1.log"]
        g.start(["cpu", "cpu"], spec())
        assert g.log_dir != kept, "a restart logs into a folder of its own"
        g.close()
        assert os.listdir(root) == [os.path.basename(kept)]


def test_token_not_in_argv_or_env_and_sockets_on_loopback_only(tmp_path):
    g = ParallelGroup("loopback", log_dir=str(tmp_path))
    g.start(["cpu", "cpu", "cpu"], spec())
    try:
        token = g._core.workers[0]._token
        assert len(token) == 32
        for pid in g.worker_pids().values():
            for what in ("cmdline", "environ"):
                with open(f"/proc/{pid}/{what}", "rb") as f:
                    raw = f.read()
                assert token not in raw and token.hex().encode() not in raw, f"the group token leaks into {what}"
        for addr, p in listening_sockets([os.getpid(), *g.worker_pids().values()]):
            assert addr in ("127.0.0.1", "::ffff:127.0.0.1", "::1"), f"{addr}:{p} is reachable from outside the host"
    finally:
        g.close()


def test_rendezvous_opens_no_port_and_its_private_folder_goes_on_close(tmp_path, monkeypatch):
    """The store is a file in a 0700 folder: while the ranks rendezvous, rank 0 listens on nothing
    (no port another local user could list, write junk into or flood with connections)."""
    seen = {}
    init_groups = process_groups.init_groups

    def spy(backend, store, rank, world_size, device, timeouts):
        # every worker has opened the store and replied "connected"; gloo has opened nothing yet
        seen["listening"] = set(listening_sockets([os.getpid()])) - before
        folder = seen["folder"] = os.path.dirname(getattr(store, "path", ""))
        if folder:
            seen.update(mode=stat.S_IMODE(os.stat(folder).st_mode), owner=os.stat(folder).st_uid, files=os.listdir(folder))
        return init_groups(backend, store, rank, world_size, device, timeouts)

    monkeypatch.setattr(process_groups, "init_groups", spy)
    before = set(listening_sockets([os.getpid()]))
    g = ParallelGroup("rendezvous", log_dir=str(tmp_path))
    g.start(["cpu", "cpu", "cpu"], spec())
    try:
        assert seen["listening"] == set(), f"the rendezvous listens on {seen['listening']}"
        assert (seen["mode"], seen["owner"]) == (0o700, os.getuid())
        assert seen["files"] == ["store"]
        assert os.path.isdir(seen["folder"]) and not seen["folder"].startswith(str(tmp_path))
        assert g.run("test.collectives", {"x": torch.ones(1)}).tensors["sum"].tolist() == [6.0] * 3
    finally:
        g.close()
    assert not os.path.exists(seen["folder"])


def test_preflight_mismatch_stops_every_rank_and_keeps_the_group(tmp_path):
    with ParallelGroup("preflight", log_dir=str(tmp_path)) as g:
        g.start(["cpu", "cpu", "cpu"], spec())
        with pytest.raises(PreflightMismatch, match=r"ranks \[2\] computed a different preflight digest") as info:
            g.run("test.preflight", meta={"odd": 2})
        assert info.value.values == ["plan-same", "plan-same", "plan-odd"]
        assert g.state == "ready"
        assert [m["passed"] for m in g.run("test.preflight", meta={"odd": -1}).metas] == [True] * 3


def test_op_missing_on_workers_stops_before_any_data_collective(tmp_path):
    register_op("test.rank0_only", test_ops.echo)
    try:
        with ParallelGroup("missing", log_dir=str(tmp_path)) as g:
            g.start(["cpu", "cpu", "cpu"], spec())
            with pytest.raises(PreflightMismatch, match=r"rank 1 does not have the op registered .*; rank 2 does not"):
                g.run("test.rank0_only", {"x": torch.ones(3)})
            assert g.state == "ready"
            assert g.run("test.echo", {"x": torch.ones(3)}).tensors["x"].tolist() == [1.0] * 3
    finally:
        unregister_op("test.rank0_only")


def test_bad_run_arguments_are_refused_before_sending(tmp_path):
    with ParallelGroup("args", log_dir=str(tmp_path)) as g:
        g.start(["cpu", "cpu"], spec())
        with pytest.raises(KeyError, match="'nope' is not registered"):
            g.run("nope")
        with pytest.raises(TypeError, match="meta must be JSON-able"):
            g.run("test.echo", meta={"x": object()})
        with pytest.raises(TypeError, match="tensors must be a dict of str -> torch.Tensor"):
            g.run("test.echo", {"x": [1, 2]})
        with pytest.raises(TypeError, match="cannot be sent to workers"):
            g.run("test.echo", {"x": torch.zeros(2, dtype=torch.uint16)})
        assert g.state == "ready"
        assert g.run("test.echo", {"x": torch.ones(1)}).op_id == 1
