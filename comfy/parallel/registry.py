"""The op registry and what an op sees: ``OpContext`` in, ``OpResult`` out.

Model packages register ops at import time; a worker imports the modules named in
``worker_spec["imports"]``, so the same registration runs on every rank.
"""

import hashlib
import re
from dataclasses import dataclass, field

from .errors import ParallelCancelled, ParallelStateError, PreflightMismatch, UnknownOpError

_OPS = {}
_NAME_RE = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")


def register_op(name, fn=None, *, replace=False):
    """Register ``fn`` as op ``name``; without ``fn`` returns a decorator.

    An op is ``fn(ctx, tensors, meta) -> (tensors, meta)`` and runs on EVERY rank, rank 0 included (in
    the calling thread). ``tensors`` are rank 0's inputs, broadcast once and placed on ``ctx.device``;
    ``meta`` is rank 0's JSON meta. Each rank returns output tensors (only rank 0's reach the caller;
    an op gathers what rank 0 needs through ``ctx.data_group``) and a JSON-able meta (every rank's
    reaches the caller, in rank order).

    Registering the same function again (e.g. a module imported twice) is a no-op; a different
    function under a taken name raises unless ``replace=True``.
    """
    if fn is None:
        return lambda f: register_op(name, f, replace=replace)
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"op name must match {_NAME_RE.pattern} (letters, digits, '_.:-', at most 128), got {name!r}")
    if not callable(fn):
        raise TypeError(f"op {name!r}: expected a callable fn(ctx, tensors, meta), got {type(fn).__name__}")
    old = _OPS.get(name)
    if old is not None and old is not fn and not replace and _qualname(old) != _qualname(fn):
        raise ValueError(f"op {name!r} is already registered by {_qualname(old)}; refusing to replace it with "
                         f"{_qualname(fn)} (pass replace=True if that is intended)")
    _OPS[name] = fn
    return fn


def unregister_op(name):
    """Remove op ``name`` (no error if it is not registered)."""
    _OPS.pop(name, None)


def get_op(name):
    try:
        return _OPS[name]
    except KeyError:
        raise UnknownOpError(f"op {name!r} is not registered in this process (registered: {registered_ops()}); "
                             "import the module that registers it (on workers: list it in worker_spec['imports'])") from None


def registered_ops():
    return sorted(_OPS)


def check_op_output(name, out):
    """``out`` must be ``(dict[str, Tensor], dict)``; returns it as a tuple."""
    import torch
    if not (isinstance(out, (tuple, list)) and len(out) == 2 and isinstance(out[0], dict) and isinstance(out[1], dict)):
        raise TypeError(f"op {name!r} must return (tensors: dict[str, Tensor], meta: dict), got {type(out).__name__}")
    bad = [k for k, v in out[0].items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        raise TypeError(f"op {name!r} returned non-tensor outputs (or non-str names) for {bad[:5]}")
    return out[0], out[1]


def _qualname(fn):
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


@dataclass
class OpResult:
    """``tensors``: rank 0's output tensors; ``metas[r]``: rank r's JSON meta; ``seconds``: wall time."""
    tensors: dict
    metas: list
    op_id: int
    seconds: float


@dataclass
class OpContext:
    """One rank's view while it runs setup or an op.

    ``state`` is a per-rank dict that lives as long as the group (e.g. the built model). The
    collective methods (``preflight``, ``cancelled``) must be called by every rank at the same
    points of an op, like any collective; outside an op they raise.
    """
    rank: int
    world_size: int
    device: object
    data_group: object
    control_group: object
    state: dict = field(default_factory=dict)
    op_id: int | None = None
    op_name: str | None = None
    _cancel_requested: object = None

    def preflight(self, digest):
        """Check that every rank computed the same ``digest`` (str) before the next data collective.

        A gather over the gloo control group of fixed-width records (sha256 of the digest plus its
        first 32 bytes for the message); raises ``PreflightMismatch`` on every rank if any differ.
        """
        from .collectives import gather_records
        self._require_op("preflight")
        raw = str(digest).encode("utf-8")
        record = hashlib.sha256(raw).digest() + raw[:32].ljust(32, b"\0")
        records = gather_records(record, self.control_group, self.world_size)
        if any(r[:32] != records[0][:32] for r in records):
            shown = [r[32:].rstrip(b"\0").decode("utf-8", "replace") for r in records]
            odd = [r for r in range(self.world_size) if records[r][:32] != records[0][:32]]
            raise PreflightMismatch(
                f"op {self.op_name!r} (id {self.op_id}): ranks {odd} computed a different preflight digest than rank 0 "
                f"(digest prefixes by rank: {shown}); every rank must derive the same plan from the same inputs, "
                "so check that rank 0 sends everything the plan depends on and that all ranks run the same code", shown)

    def cancelled(self):
        """True on every rank once ``cancel()`` reached any rank; a collective (all_reduce MAX) over the control group.

        Ranks must call it at the same points so that all of them leave the op at the same boundary
        and no data collective is left half-entered.
        """
        from .collectives import agree_any
        self._require_op("cancelled")
        return agree_any(bool(self._cancel_requested()), self.control_group)

    def check_cancelled(self):
        """Raise ``ParallelCancelled`` (on every rank alike) if ``cancelled()``."""
        if self.cancelled():
            raise ParallelCancelled(f"op {self.op_name!r} (id {self.op_id}) was cancelled")

    def _require_op(self, what):
        if self.op_id is None or self._cancel_requested is None:
            raise ParallelStateError(f"ctx.{what}() is a collective over all ranks and is only valid inside an op, "
                                     "not in setup (rank 0 does not run setup)")


@register_op("parallel.noop")
def _noop(ctx, tensors, meta):
    return {}, {}
