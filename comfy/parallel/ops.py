"""What every rank runs alike: the op registry, the ``OpContext`` an op sees, and the code fingerprints
that prove every rank runs the same code."""

import hashlib
import importlib
import types
from dataclasses import dataclass, field

import torch

from .errors import PreflightMismatch

_OPS = {}


def register_op(name, fn=None):
    """Register ``fn(ctx, meta) -> value`` as op ``name`` (without ``fn``: a decorator). It runs on every rank
    (rank 0 in the calling thread) with rank 0's JSON ``meta``; ranks move tensors with ``ctx.transport``.
    Rank 0's value reaches the caller as is, a worker's must be JSON. Workers import the modules named in
    ``ParallelGroup.start(devices, imports)``, which register their ops."""
    if fn is None:
        return lambda f: register_op(name, f)
    old = _OPS.get(name)
    if old is not None and old.__qualname__ != fn.__qualname__:
        raise ValueError(f"op {name!r} is already registered by {old.__module__}.{old.__qualname__}")
    _OPS[name] = fn
    return fn


def unregister_op(name):
    del _OPS[name]


def get_op(name):
    if name not in _OPS:
        raise KeyError(f"op {name!r} is not registered; import the module that registers it (workers: start(imports=...))")
    return _OPS[name]


@dataclass
class OpResult:
    values: list  # rank r's value at [r]: rank 0's as returned, the workers' as JSON


@dataclass
class OpContext:
    """One rank's view. ``state`` lives as long as the workers (e.g. the model a worker built)."""
    rank: int
    world_size: int
    device: torch.device
    transport: object
    state: dict = field(default_factory=dict)
    op_name: str = ""

    def preflight(self, digest):
        """Raise ``PreflightMismatch`` on every rank unless every rank computed the same ``digest`` (str)."""
        mine = hashlib.sha256(str(digest).encode()).digest()
        records = self.transport.all_gather_bytes(mine + str(digest).encode()[:32])
        odd = [r for r in range(self.world_size) if records[r][:32] != records[0][:32]]
        if odd:
            shown = [r[32:].rstrip(b"\0").decode("utf-8", "replace") for r in records]
            raise PreflightMismatch(f"op {self.op_name!r}: ranks {odd} computed another preflight digest than rank 0 "
                                    f"({shown}); every rank must derive the same plan from the same inputs")


def _hash_code(h, code):
    h.update(code.co_code)
    h.update(repr((code.co_names, code.co_varnames, code.co_freevars)).encode())
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            _hash_code(h, c)
        else:
            # a frozenset's order follows string hashing, which differs between processes
            h.update(repr(sorted(map(repr, c)) if isinstance(c, frozenset) else c).encode())


def code_fingerprints(module_names):
    """{module name: sha256 of the code it runs}, from the loaded code objects (not from disk: a file edited
    since this process imported it then differs from what a new process imports)."""
    out = {}
    for name in module_names:
        h = out[name] = hashlib.sha256()
        for key, obj in sorted(vars(importlib.import_module(name)).items()):
            if getattr(obj, "__module__", None) != name:
                continue
            for item in vars(obj).values() if isinstance(obj, type) else [obj]:
                item = item.fget if isinstance(item, property) else getattr(item, "__func__", item)
                if isinstance(item, types.FunctionType):
                    h.update(key.encode())
                    _hash_code(h, item.__code__)
    return {name: h.hexdigest() for name, h in out.items()}


@register_op("parallel.probe")
def probe(ctx, meta):
    """A known answer from every rank over the transport; then, on CUDA, the stream path's set-up."""
    got = [r.rstrip(b"\0") for r in ctx.transport.all_gather_bytes(f"rank {ctx.rank}".encode())]
    want = [f"rank {r}".encode() for r in range(ctx.world_size)]
    if got != want:
        raise RuntimeError(f"the transport's start-up probe returned {got}, expected {want}")
    path = None
    if ctx.device.type == "cuda":
        from . import stream_path
        path = ctx.transport.stream_path = stream_path.attach(ctx.transport, meta.get("device_path", True))
    return {"data_path": "host, on the calling thread" if path is None else path.mode}
