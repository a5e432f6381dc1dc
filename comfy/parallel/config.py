"""What a group is started with: timeouts, devices, the worker spec and the workers' environment.

All of it is checked before any process is spawned, and all of it is JSON (the spec crosses to
the workers inside an authenticated control message; nothing is pickled).
"""

import math
import os
import re
import socket
import sys
from dataclasses import asdict, dataclass

from .errors import WorkerSpecError
from .protocol import canonical_json

_MODULE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_SPEC_KEYS = ("imports", "setup", "setup_args", "comfyui")


@dataclass(frozen=True)
class Timeouts:
    """Seconds. Each bounds a different wait, so a slow model load does not stretch the op timeout.

    * ``startup``: spawn -> every worker ready, including ``setup`` (a model build may take minutes).
    * ``rendezvous``: creating the process groups once every worker has connected to the store
      (the only wait in which a dead worker is noticed by this timeout rather than within seconds).
    * ``op``: default deadline of one ``run()``; late workers are killed.
    * ``cancel``: ``cancel()`` -> every worker has left the op; late workers are killed.
    * ``collective``: backstop timeout of a single gloo/NCCL collective inside an op.
    * ``stopped``: how long a worker may stay stopped (SIGSTOP, a tracer) before the group faults
      naming it; its peers would otherwise wait in a collective until the op deadline.
    * ``close``: grace for workers to exit on ``close()`` before SIGTERM, then SIGKILL.
    """
    startup: float = 600.0
    rendezvous: float = 60.0
    op: float = 600.0
    cancel: float = 10.0
    collective: float = 600.0
    stopped: float = 5.0
    close: float = 5.0

    def __post_init__(self):
        for name, value in asdict(self).items():
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"Timeouts.{name} must be a positive number of seconds, got {value!r}")

    def to_json(self):
        return asdict(self)


def parse_devices(devices):
    """``["cpu", "cpu"]`` or ``["cuda:0", "cuda:1", ...]`` -> (normalized names, "cpu" | "cuda")."""
    import torch
    if isinstance(devices, (str, bytes)) or not hasattr(devices, "__iter__"):
        raise WorkerSpecError(f"devices must be a list such as ['cuda:0', 'cuda:1'], got {devices!r}")
    parsed = []
    for d in devices:
        try:
            parsed.append(torch.device(d))
        except (RuntimeError, TypeError) as e:
            raise WorkerSpecError(f"device {d!r} is not a torch device name: {e}") from None
    if len(parsed) < 2:
        raise WorkerSpecError(f"a parallel group needs at least 2 devices, got {len(parsed)}; "
                              "with one device run the model directly (the native path)")
    kinds = {d.type for d in parsed}
    if len(kinds) != 1 or not kinds <= {"cpu", "cuda"}:
        raise WorkerSpecError(f"devices must be all 'cpu' or all 'cuda:<index>', got {[str(d) for d in parsed]}")
    kind = kinds.pop()
    if kind == "cuda":
        if any(d.index is None for d in parsed):
            raise WorkerSpecError(f"name each CUDA device with its index (cuda:0, cuda:1, ...), got {[str(d) for d in parsed]}")
        indices = [d.index for d in parsed]
        if len(set(indices)) != len(indices):
            raise WorkerSpecError(f"each rank needs its own CUDA device; {indices} repeats an index")
    return [str(d) for d in parsed], kind


def validate_worker_spec(spec):
    """Check and normalize ``{"imports": [...], "setup": "module:function" | None, "setup_args": {...},
    "comfyui": execution settings | None}`` (``comfyui``: see ``headless.execution_settings``)."""
    if not isinstance(spec, dict):
        raise WorkerSpecError(f"worker_spec must be a dict with keys {list(_SPEC_KEYS)}, got {type(spec).__name__}")
    unknown = sorted(set(spec) - set(_SPEC_KEYS))
    if unknown:
        raise WorkerSpecError(f"worker_spec has unknown keys {unknown}; allowed: {list(_SPEC_KEYS)}")
    try:
        canonical_json(spec)
    except (TypeError, ValueError) as e:
        raise WorkerSpecError(f"worker_spec must be JSON-able (it reaches the workers as JSON, never as pickle): {e}; "
                              "pass paths and plain values, not objects") from None
    imports = spec.get("imports") or []
    if not isinstance(imports, list) or not all(isinstance(m, str) and _MODULE_RE.match(m) for m in imports):
        raise WorkerSpecError(f"worker_spec['imports'] must be a list of module names such as 'comfy.ldm.minimax_h3.sequence_parallel', got {imports!r}")
    setup = spec.get("setup")
    if setup is not None:
        mod, _, fn = setup.partition(":") if isinstance(setup, str) else ("", "", "")
        if not (_MODULE_RE.match(mod) and _MODULE_RE.match(fn)):
            raise WorkerSpecError(f"worker_spec['setup'] must be 'module:function' or None, got {setup!r}")
    setup_args = spec.get("setup_args") or {}
    if not isinstance(setup_args, dict):
        raise WorkerSpecError(f"worker_spec['setup_args'] must be a JSON object (keyword arguments of setup), got {type(setup_args).__name__}")
    comfyui = spec.get("comfyui")
    if comfyui is not None and not isinstance(comfyui, dict):
        raise WorkerSpecError(f"worker_spec['comfyui'] must be execution settings (a JSON object) or None, got {type(comfyui).__name__}")
    return {"imports": list(imports), "setup": setup, "setup_args": setup_args, "comfyui": comfyui}


def loopback_ifname():
    """Name of the loopback interface ('lo' on Linux, 'lo0' on BSD/macOS)."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return "lo"
    for name in ("lo", "lo0"):
        if name in names:
            return name
    return next((n for n in names if n.startswith("lo")), "lo")


def worker_env(device, device_kind, extra=None):
    """Environment of one worker: this process's, plus import path, one visible device, loopback sockets."""
    env = dict(os.environ)
    # Workers must import what rank 0 imports (e.g. the module that registers the ops).
    paths = [os.path.abspath(p) if p else os.getcwd() for p in sys.path]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env["PYTHONSAFEPATH"] = "1"  # exactly that path: `python -m` would put the working directory first
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    lo = loopback_ifname()
    env["GLOO_SOCKET_IFNAME"] = lo
    env["NCCL_SOCKET_IFNAME"] = lo
    if device_kind == "cuda":
        index = int(device.split(":")[1])
        # cuda:<i> means the i-th device this process sees, which may itself be a remapped subset.
        visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        if visible and index >= len(visible):
            raise WorkerSpecError(f"{device} is not visible: CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r}")
        env["CUDA_VISIBLE_DEVICES"] = visible[index].strip() if visible else str(index)
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
    for k, v in (extra or {}).items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise WorkerSpecError(f"env entries must be str -> str, got {k!r}: {v!r}")
        env[k] = v
    return env
