"""ParallelGroup lifecycle with real worker processes on CPU (gloo)."""

import os
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import parallel_ops_for_tests as test_ops
import pytest
import torch
from parallel_helpers import IMPORTS, OPS_MODULE, child_pids, listening_sockets, wait_until

from comfy.parallel import ParallelError, ParallelGroup, ParallelGroupError, ParallelStateError, PreflightMismatch, ops, register_op, unregister_op


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
    g.start(["cpu"] * world, IMPORTS, local_state={"built": "rank0", "lock": lock})
    wall = time.monotonic() - t0
    try:
        assert g.state == "ready"
        assert g.world_size == world
        pids = g.worker_pids()
        assert sorted(pids) == list(range(1, world))
        assert set(pids.values()) == set(child_pids()) - before
        setup = g.run("test.setup_build", meta={"value": "w"})
        assert [m["built"] for m in setup.metas] == ["rank0"] + [f"w-rank{r}" for r in range(1, world)]
        phases = dict(g.startup_seconds)
        total = phases.pop("total")
        assert sorted(phases) == ["probe", "rendezvous", "spawn_and_import"]
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
        assert res.op_id == 4
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
    g.start(["cpu", "cpu"], IMPORTS)
    try:
        with pytest.raises(ParallelStateError, match="start\\(\\) needs state idle or closed; group 'states' is ready; call close"):
            g.start(["cpu", "cpu"], IMPORTS)
        other = ParallelGroup("other", log_dir=str(tmp_path / "other"))
        # nothing of the other group may start (it would share torch.distributed's default group)
        with pytest.raises(ParallelStateError, match="group 'states' \\(state ready, 2 ranks\\) is active in this process"):
            other.start(["cpu", "cpu"], IMPORTS)
        assert other.state == "idle"
        assert g.run("parallel.noop").metas == [{}, {}]
    finally:
        g.close()
    with pytest.raises(ParallelStateError, match="is closed; call start"):
        g.run("parallel.noop")


def test_restart_in_same_process_keeps_every_log(tmp_path):
    with ParallelGroup("restart", log_dir=str(tmp_path)) as g:
        g.start(["cpu", "cpu"], IMPORTS)
        first = g.worker_pids()[1]
        g.close()
        g.start(["cpu", "cpu", "cpu"], IMPORTS)
        assert g.worker_pids()[1] != first
        assert g.run("test.collectives", {"x": torch.ones(1)}).tensors["sum"].tolist() == [6.0] * 3
    assert g.state == "closed"
    logs = sorted(os.listdir(tmp_path))
    assert logs == ["rank1-gen1.log", "rank1-gen2.log", "rank2-gen2.log"]
    first_log = (tmp_path / "rank1-gen1.log").read_text()
    assert "ready: rank 1 of 2" in first_log and "shutdown requested by rank 0" in first_log
    assert "ready: rank 1 of 3" in (tmp_path / "rank1-gen2.log").read_text()


def test_own_folder_is_private_outside_comfyui_temp_and_removed_on_close(tmp_path, monkeypatch):
    folder_paths = pytest.importorskip("folder_paths")
    monkeypatch.setattr(folder_paths, "temp_directory", str(tmp_path / "comfy-temp"))
    with ParallelGroup("tidy") as g:
        for world in (2, 3):
            g.start(["cpu"] * world, IMPORTS)
            folder = g.log_dir
            assert os.path.dirname(folder) == tempfile.gettempdir()
            assert (stat.S_IMODE(os.stat(folder).st_mode), os.stat(folder).st_uid) == (0o700, os.getuid())
            assert not folder.startswith(folder_paths.get_temp_directory())
            assert not folder.startswith(folder_paths.get_output_directory())
            assert sorted(os.listdir(folder)) == [f"rank{r}-gen{world - 1}.log" for r in range(1, world)] + ["store"]
            g.close()
            assert not os.path.exists(folder), "a clean close() leaves nothing behind"


def test_another_comfyui_cleaning_its_temp_dir_does_not_break_a_running_group(tmp_path, monkeypatch):
    """What main.py's cleanup_temp() does when a second ComfyUI starts on the same install."""
    folder_paths = pytest.importorskip("folder_paths")
    temp = tmp_path / "comfy-temp"
    monkeypatch.setattr(folder_paths, "temp_directory", str(temp))
    with ParallelGroup("second-instance") as g:
        g.start(["cpu", "cpu", "cpu"], IMPORTS)
        temp.mkdir()
        pids = set(g.worker_pids().values())
        for pid in [os.getpid(), *pids]:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}") if os.path.exists(f"/proc/{pid}/fd/{fd}") else ""
                assert not target.startswith(str(temp)), f"{target} of the group is under ComfyUI's temp dir"
        import shutil
        shutil.rmtree(folder_paths.get_temp_directory(), ignore_errors=True)  # cleanup_temp()
        for _ in range(3):
            assert g.run("test.collectives", {"x": torch.ones(1)}).tensors["sum"].tolist() == [6.0] * 3
        assert set(g.worker_pids().values()) == pids


def test_a_fault_keeps_the_logs_and_the_error_is_short_and_names_the_log():
    with ParallelGroup("kept") as g:
        g.start(["cpu", "cpu"], IMPORTS)
        folder = g.log_dir
        os.kill(g.worker_pids()[1], signal.SIGKILL)
        assert wait_until(lambda: g.state == "broken", 10.0) is not None
        with pytest.raises(ParallelGroupError) as info:
            g.run("test.echo")
        text = str(info.value)
        log = os.path.join(folder, "rank1-gen1.log")
        assert len(text) <= 300 and text.endswith(f"Log: {log}"), text
        assert "worker rank 1" in text and "SIGKILL" in text and "close() and start()" in text
        assert "\n" not in text, "no log tail in the text users see"
        g.close()
        assert os.listdir(folder) == ["rank1-gen1.log"], "the store goes, the log stays for the person reading the error"
        g.start(["cpu", "cpu"], IMPORTS)
        assert g.log_dir != folder
    os.remove(log)
    os.rmdir(folder)


def test_op_error_text_is_short_and_the_traceback_goes_to_the_log(tmp_path, caplog):
    with ParallelGroup("short", log_dir=str(tmp_path)) as g:
        g.start(["cpu", "cpu"], IMPORTS)
        with pytest.raises(ParallelGroupError) as info:
            g.run("test.raise_on", meta={"rank": 1})
        text = str(info.value)
        assert len(text) <= 300 and text.endswith(f"Log: {tmp_path / 'rank1-gen1.log'}"), text
        assert "boom on rank 1" in text and "Traceback" not in text
        assert 'raise ValueError(f"boom on rank {ctx.rank}")' in caplog.text


def test_sockets_on_loopback_only(tmp_path):
    g = ParallelGroup("loopback", log_dir=str(tmp_path))
    g.start(["cpu", "cpu", "cpu"], IMPORTS)
    try:
        for addr, p in listening_sockets([os.getpid(), *g.worker_pids().values()]):
            assert addr in ("127.0.0.1", "::ffff:127.0.0.1", "::1"), f"{addr}:{p} is reachable from outside the host"
    finally:
        g.close()


def test_rendezvous_opens_no_port_and_its_private_folder_goes_on_close(tmp_path, monkeypatch):
    """The store is a file in a 0700 folder: while the ranks rendezvous, rank 0 listens on nothing
    (no port another local user could list, write junk into or flood with connections)."""
    seen = {}
    init_groups = ops.init_groups

    def spy(store_path, rank, world_size, device, *timeouts):
        # every worker has replied "connected"; gloo has opened nothing yet
        seen["listening"] = set(listening_sockets([os.getpid()])) - before
        folder = seen["folder"] = os.path.dirname(store_path)
        seen.update(mode=stat.S_IMODE(os.stat(folder).st_mode), owner=os.stat(folder).st_uid, files=os.listdir(folder))
        return init_groups(store_path, rank, world_size, device, *timeouts)

    monkeypatch.setattr(ops, "init_groups", spy)
    before = set(listening_sockets([os.getpid()]))
    g = ParallelGroup("rendezvous", log_dir=str(tmp_path))
    g.start(["cpu", "cpu", "cpu"], IMPORTS)
    try:
        assert seen["listening"] == set(), f"the rendezvous listens on {seen['listening']}"
        assert (seen["mode"], seen["owner"]) == (0o700, os.getuid())
        assert set(seen["files"]) <= {"store"}, "logs go to log_dir; the store file appears with the rendezvous"
        assert os.path.isdir(seen["folder"]) and os.path.dirname(seen["folder"]) == tempfile.gettempdir()
        assert g.run("test.collectives", {"x": torch.ones(1)}).tensors["sum"].tolist() == [6.0] * 3
    finally:
        g.close()
    assert not os.path.exists(seen["folder"])


def test_preflight_mismatch_stops_every_rank_and_keeps_the_group(tmp_path):
    with ParallelGroup("preflight", log_dir=str(tmp_path)) as g:
        g.start(["cpu", "cpu", "cpu"], IMPORTS)
        with pytest.raises(PreflightMismatch, match=r"ranks \[2\] computed a different preflight digest") as info:
            g.run("test.preflight", meta={"odd": 2})
        assert info.value.values == ["plan-same", "plan-same", "plan-odd"]
        assert g.state == "ready"
        assert [m["passed"] for m in g.run("test.preflight", meta={"odd": -1}).metas] == [True] * 3


def test_op_missing_on_workers_stops_before_any_data_collective(tmp_path):
    register_op("test.rank0_only", test_ops.echo)
    try:
        with ParallelGroup("missing", log_dir=str(tmp_path)) as g:
            g.start(["cpu", "cpu", "cpu"], IMPORTS)
            with pytest.raises(PreflightMismatch, match=r"ranks \[1, 2\] do not have it registered"):
                g.run("test.rank0_only", {"x": torch.ones(3)})
            assert g.state == "ready"
            assert g.run("test.echo", {"x": torch.ones(3)}).tensors["x"].tolist() == [1.0] * 3
    finally:
        unregister_op("test.rank0_only")


def test_bad_run_arguments_are_refused_before_sending(tmp_path):
    with ParallelGroup("args", log_dir=str(tmp_path)) as g:
        g.start(["cpu", "cpu"], IMPORTS)
        with pytest.raises(KeyError, match="'nope' is not registered"):
            g.run("nope")
        with pytest.raises(TypeError, match="meta must be JSON-able"):
            g.run("test.echo", meta={"x": object()})
        with pytest.raises(TypeError, match="tensors must be a dict of str -> torch.Tensor"):
            g.run("test.echo", {"x": [1, 2]})
        with pytest.raises(TypeError, match="cannot be sent to workers"):
            g.run("test.echo", {"x": torch.zeros(2, dtype=torch.uint16)})
        with pytest.raises(TypeError, match="meta must be JSON-able"):
            g.run("test.echo", meta={"x": float("nan")})
        assert g.state == "ready"
        assert g.run("test.echo", {"x": torch.ones(1)}).op_id == 1


def test_cuda_devices_this_machine_lacks_are_refused_before_any_process_starts(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    before = set(child_pids())
    g = ParallelGroup("gpus", log_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"devices cuda:0, cuda:1 were asked for, but this machine has 1 CUDA device\(s\) \(cuda:0\)"):
        g.start(["cuda:0", "cuda:1"], IMPORTS)
    assert g.state == "idle" and set(child_pids()) == before and not os.listdir(tmp_path)


@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cuda:0"], ["cuda", "cuda"], ["cuda:1", "cuda:1"]])
def test_bad_device_lists(devices, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    with pytest.raises(ValueError, match="2 or more devices|each CUDA device once"):
        ParallelGroup("bad").start(devices, IMPORTS)


def test_a_child_started_during_a_run_holds_none_of_the_groups_fds(tmp_path):
    with ParallelGroup("cloexec", log_dir=str(tmp_path)) as g:
        before = set(int(f) for f in os.listdir("/proc/self/fd"))
        g.start(["cpu", "cpu", "cpu"], IMPORTS)
        mine = set(int(f) for f in os.listdir("/proc/self/fd")) - before
        assert any(os.readlink(f"/proc/self/fd/{fd}").startswith("socket:") for fd in mine if os.path.exists(f"/proc/self/fd/{fd}"))
        inherited = set(g.run("test.spawn_child").metas[0]["child_fds"]) & mine
        assert not inherited, {fd: os.readlink(f"/proc/self/fd/{fd}") for fd in inherited}
        for pid in g.worker_pids().values():
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                    flags = int(f.read().split("flags:")[1].split()[0], 8)
                if int(fd) > 2:
                    assert flags & os.O_CLOEXEC, f"worker fd {fd} ({os.readlink(f'/proc/{pid}/fd/{fd}')}) is inherited by its children"


_FLOODED = textwrap.dedent("""
    import os, resource, sys, torch
    from comfy.parallel import ParallelGroup
    # a soft limit of 1024 is what the issue crashed with; start() raises it to the hard limit
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    g = ParallelGroup("flood", log_dir=sys.argv[1])
    g.start(["cpu", "cpu", "cpu"], [%r])
    print(" ".join(str(p) for p in g.worker_pids().values()), flush=True)
    sys.stdin.readline()
    with open(os.path.join(sys.argv[1], "after-flood"), "w") as f:
        f.write("rank 0 can still open files")
    print(g.run("test.collectives", {"x": torch.ones(1)}).tensors["sum"].tolist(), flush=True)
    g.close()
    print("closed", flush=True)
""" % OPS_MODULE)


def test_a_local_user_flooding_the_groups_listeners_does_not_kill_rank0(tmp_path):
    import resource
    import socket
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p or os.getcwd() for p in sys.path))
    proc = subprocess.Popen([sys.executable, "-c", _FLOODED, str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, text=True)
    conns = []
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2, proc.stderr.read()
        listeners = listening_sockets([proc.pid, *pids])
        assert listeners
        for addr, port in listeners:
            for _ in range(1100):
                conns.append(socket.create_connection((addr, port), timeout=5))
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "[6.0, 6.0, 6.0]", proc.stderr.read()
        assert proc.stdout.readline().strip() == "closed"
        assert proc.wait(timeout=30) == 0
        assert (tmp_path / "after-flood").read_text() == "rank 0 can still open files"
    finally:
        for c in conns:
            c.close()
        proc.kill()
        proc.wait()


def test_a_package_file_changed_after_rank0_imported_it_refuses_the_start(tmp_path, monkeypatch):
    pkg = tmp_path / "changed_pkg_for_parallel_tests"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import changed_pkg_for_parallel_tests  # noqa: F401
    try:
        g = ParallelGroup("changed", log_dir=str(tmp_path / "logs"))
        g.start(["cpu", "cpu"], IMPORTS)
        g.close()
        (pkg / "__init__.py").write_text("VALUE = 22\n")
        with pytest.raises(ParallelError, match=f"{pkg / '__init__.py'} changed after rank 0 imported it"):
            g.start(["cpu", "cpu"], IMPORTS)
        assert g.state == "closed"
    finally:
        sys.modules.pop("changed_pkg_for_parallel_tests", None)
