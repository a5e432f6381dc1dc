"""Op registry, worker-spec / device / timeout validation (no processes)."""

import pytest

from comfy.parallel import ParallelGroup, Timeouts, UnknownOpError, WorkerSpecError, register_op, registered_ops, unregister_op
from comfy.parallel.config import parse_devices, validate_worker_spec, worker_env
from comfy.parallel.registry import get_op


def _op_a(ctx, tensors, meta):
    return {}, {}


def _op_b(ctx, tensors, meta):
    return {}, {}


def test_register_decorator_and_lookup():
    try:
        @register_op("test.cfg.decorated")
        def decorated(ctx, tensors, meta):
            return {}, {"x": 1}
        assert get_op("test.cfg.decorated") is decorated
        assert "test.cfg.decorated" in registered_ops()
        register_op("test.cfg.decorated", decorated)
    finally:
        unregister_op("test.cfg.decorated")
    assert "test.cfg.decorated" not in registered_ops()


def test_register_refuses_a_different_function_under_a_taken_name():
    register_op("test.cfg.taken", _op_a)
    try:
        with pytest.raises(ValueError, match="already registered by .*_op_a"):
            register_op("test.cfg.taken", _op_b)
        register_op("test.cfg.taken", _op_b, replace=True)
        assert get_op("test.cfg.taken") is _op_b
    finally:
        unregister_op("test.cfg.taken")


@pytest.mark.parametrize("name", ["", "has space", "x" * 129, 3])
def test_register_rejects_bad_names(name):
    with pytest.raises(ValueError, match="op name must match"):
        register_op(name, _op_a)


def test_unknown_op_names_the_fix():
    with pytest.raises(UnknownOpError, match=r"'nope' is not registered .*worker_spec\['imports'\]"):
        get_op("nope")
    assert "parallel.noop" in registered_ops()


def test_worker_spec_must_be_json():
    with pytest.raises(WorkerSpecError, match="must be JSON-able .* never as pickle"):
        validate_worker_spec({"imports": [], "setup_args": {"model": object()}})
    with pytest.raises(WorkerSpecError, match="JSON-able"):
        validate_worker_spec({"setup_args": {"x": float("inf")}})


@pytest.mark.parametrize("spec, message", [
    ([], "must be a dict"),
    ({"imports": [], "pickle": True}, r"unknown keys \['pickle'\]"),
    ({"imports": "os"}, "must be a list of module names"),
    ({"imports": ["os; rm"]}, "must be a list of module names"),
    ({"setup": "module.function"}, "'module:function' or None"),
    ({"setup": ":f"}, "'module:function' or None"),
    ({"setup_args": [1]}, "JSON object"),
])
def test_worker_spec_shape(spec, message):
    with pytest.raises(WorkerSpecError, match=message):
        validate_worker_spec(spec)


def test_worker_spec_normalized():
    assert validate_worker_spec({"imports": ["a.b"], "setup": "a.b:build"}) == {
        "imports": ["a.b"], "setup": "a.b:build", "setup_args": {}, "comfyui": None}


def test_start_rejects_bad_spec_before_spawning(tmp_path):
    g = ParallelGroup("spec", log_dir=str(tmp_path))
    with pytest.raises(WorkerSpecError, match="JSON-able"):
        g.start(["cpu", "cpu"], {"imports": [], "setup_args": {"f": lambda: 0}})
    assert g.state == "idle"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("devices, message", [
    (["cpu"], "at least 2 devices"),
    ("cpu", "must be a list"),
    (["cpu", "cuda:0"], "all 'cpu' or all 'cuda:<index>'"),
    (["cuda", "cuda"], "with its index"),
    (["cuda:1", "cuda:1"], "repeats an index"),
    (["cpu", "tpu:0"], "not a torch device name|all 'cpu'"),
])
def test_bad_devices(devices, message):
    with pytest.raises(WorkerSpecError, match=message):
        parse_devices(devices)


def test_devices_normalized():
    assert parse_devices(["cpu", "cpu", "cpu"]) == (["cpu", "cpu", "cpu"], "cpu")
    assert parse_devices(["cuda:0", "cuda:3"]) == (["cuda:0", "cuda:3"], "cuda")


def test_worker_env_pins_one_device_and_loopback(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    env = worker_env("cuda:2", "cuda")
    assert env["CUDA_VISIBLE_DEVICES"] == "6"
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "lo"
    with pytest.raises(WorkerSpecError, match="not visible"):
        worker_env("cuda:3", "cuda")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert worker_env("cuda:3", "cuda")["CUDA_VISIBLE_DEVICES"] == "3"
    assert worker_env("cpu", "cpu", {"EXTRA": "1"})["CUDA_VISIBLE_DEVICES"] == ""
    assert worker_env("cpu", "cpu", {"EXTRA": "1"})["EXTRA"] == "1"


@pytest.mark.parametrize("field, value", [("op", 0), ("startup", -1), ("cancel", float("nan")), ("close", "5"), ("stopped", None)])
def test_timeouts_must_be_positive(field, value):
    with pytest.raises(ValueError, match=f"Timeouts.{field} must be a positive number"):
        Timeouts(**{field: value})


def test_nccl_data_group_uses_high_priority_streams(monkeypatch):
    # the all-to-all issued before the next chunk's kernels must get SMs ahead of them (NCCL's
    # high-priority streams); gloo keeps torch's defaults
    import types

    import torch.distributed as dist

    from comfy.parallel import process_groups

    class Options:  # stands in where this torch build has no NCCL
        is_high_priority_stream = False

    if not hasattr(dist, "ProcessGroupNCCL"):
        monkeypatch.setattr(dist, "ProcessGroupNCCL", types.SimpleNamespace(Options=Options), raising=False)
    import datetime

    timeout = datetime.timedelta(seconds=42)
    assert process_groups.data_group_options("gloo", timeout) is None
    options = process_groups.data_group_options("nccl", timeout)
    assert isinstance(options, dist.ProcessGroupNCCL.Options) and options.is_high_priority_stream is True
    assert options._timeout == timeout  # the same as init_process_group's, or torch warns
