"""What every rank runs alike: the op registry, the ``OpContext`` an op sees, and the group's own
torch.distributed set-up and collectives (process groups, probe, op preflight)."""

import datetime
import hashlib
import os
import traceback
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .errors import ParallelCancelled, ParallelStateError, PreflightMismatch

_OPS = {}


def register_op(name, fn=None):
    """Register ``fn(ctx, tensors, meta) -> (tensors, meta)`` as op ``name`` (without ``fn``: a decorator).

    An op runs on every rank, rank 0 in the calling thread. ``tensors`` are rank 0's inputs, on ``ctx.device``
    (to workers they travel in the control frame), ``meta`` its JSON meta. Only rank 0's output tensors reach the
    caller (an op gathers what rank 0 needs over ``ctx.data_group``); every rank's JSON meta does. Workers
    import the modules named in ``ParallelGroup.start(devices, imports)``, which register their ops."""
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
    tensors: dict  # rank 0's outputs
    metas: list  # rank r's JSON meta at [r]
    op_id: int
    seconds: float


@dataclass
class OpContext:
    """One rank's view. ``state`` lives as long as the workers (e.g. the built model); ``preflight`` and
    ``cancelled`` are collectives: every rank calls them at the same points of an op."""
    rank: int
    world_size: int
    device: torch.device
    data_group: object
    control_group: object
    state: dict = field(default_factory=dict)
    op_id: int = 0
    op_name: str = ""
    cancel_requested: object = None

    def preflight(self, digest):
        """Raise ``PreflightMismatch`` on every rank unless every rank computed the same ``digest`` (str)."""
        raw = str(digest).encode()
        mine = torch.frombuffer(bytearray(hashlib.sha256(raw).digest() + raw[:32].ljust(32, b"\0")), dtype=torch.uint8)
        records = [bytes(r.tolist()) for r in _all_gather(mine, self.control_group, self.world_size)]
        odd = [r for r in range(self.world_size) if records[r][:32] != records[0][:32]]
        if odd:
            shown = [r[32:].rstrip(b"\0").decode("utf-8", "replace") for r in records]
            raise PreflightMismatch(f"op {self.op_name!r}: ranks {odd} computed a different preflight digest than rank 0 "
                                    f"({shown}); every rank must derive the same plan from the same inputs", shown)

    def cancelled(self):
        """True on every rank once ``ParallelGroup.cancel()`` reached any rank."""
        if self.cancel_requested is None:
            raise ParallelStateError("ctx.cancelled() is a collective that only an op can call")
        flag = torch.tensor([int(self.cancel_requested())])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.control_group)
        return bool(flag.item())

    def check_cancelled(self):
        if self.cancelled():
            raise ParallelCancelled(f"op {self.op_name!r} (id {self.op_id}) was cancelled")


def _all_gather(t, group, world_size):
    dist.all_gather(parts := [torch.empty_like(t) for _ in range(world_size)], t, group=group)
    return parts


def op_preflight(ctx, has_op, cancel):
    """Every op starts with this gather: any rank lacking the op stops every rank before data moves.
    Returns True if a cancel reached any rank."""
    views = _all_gather(torch.tensor([ctx.op_id, int(has_op), int(cancel)]), ctx.control_group, ctx.world_size)
    lacking = [r for r, v in enumerate(views) if not v[1]]
    if lacking or any(v[0] != ctx.op_id for v in views):
        raise PreflightMismatch(f"op {ctx.op_name!r} stopped before any data collective: ranks {lacking} do not have it "
                                "registered (start(imports=...) names the module that registers it)",
                                [v.tolist() for v in views])
    return any(bool(v[2]) for v in views)


def init_groups(store_path, rank, world_size, device, collective, op_limit):
    """Join the default gloo group (the control group; on CPU also the data group), on CUDA also an NCCL
    data group on high-priority streams. -> (data, control).

    The rendezvous is a FileStore at ``store_path``. ``collective`` bounds it and every wait inside
    one gloo collective: a FileStore
    wait ends only by its timeout, and a gloo send waits for its receiver until then even when that
    receiver has died (a recv fails at once), so this is the bound on both."""
    # one host: gloo listens on loopback only; torch takes the interface from this variable alone
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    try:
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=collective))
    except BaseException:
        if not dist.is_initialized():
            # torch names groups by a counter that only destroy_process_group() resets: a world of one
            # made and destroyed puts it back, so the next rendezvous uses the keys fresh workers use
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            dist.destroy_process_group()
        raise
    finally:
        os.environ.pop("GLOO_SOCKET_IFNAME") if ifname is None else os.environ.update(GLOO_SOCKET_IFNAME=ifname)
    control = dist.group.WORLD
    if device.type != "cuda":
        return control, control
    # sequence-parallel attention issues each all-to-all ahead of the next chunk's kernels, which would
    # otherwise take the SMs first
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = True
    return dist.new_group(backend="nccl", timeout=datetime.timedelta(seconds=op_limit), pg_options=options), control


def destroy_groups(data, control, abort):
    if data is not control and abort:
        data.abort()  # NCCL would wait on a dead peer
    dist.destroy_process_group()


def probe(ctx):
    """all_reduce and all_to_all with known answers on the data group, all_reduce on the control group."""
    n, r = ctx.world_size, ctx.rank
    t = torch.full((n,), r + 1, dtype=torch.int64, device=ctx.device)
    dist.all_reduce(t, group=ctx.data_group)
    send = torch.arange(n, dtype=torch.float32, device=ctx.device) + r * n
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=ctx.data_group)
    c = torch.tensor([r + 1])
    dist.all_reduce(c, group=ctx.control_group)
    want = (n * (n + 1) // 2, [float(j * n + r) for j in range(n)])
    if (t[0].item(), recv.tolist()) != want or c.item() != want[0]:
        raise RuntimeError(f"the start-up probe returned {t.tolist()}, {recv.tolist()}, {c.item()}, expected {want}")


def seal_fds(before):
    """Make the fds opened since ``before`` (gloo's sockets, epoll and pipe, NCCL's: torch opens them inheritable)
    close-on-exec, so that no child this process starts (``close_fds=False``, ``os.system``) holds them."""
    for fd, target in open_fds().items():
        if before.get(fd) != target:
            try:
                os.set_inheritable(fd, False)
            except OSError:
                pass  # closed meanwhile (the listing's own fd among them)


def in_collective(exc):
    """True if ``exc`` came out of a collective (a peer died, hung or timed out): raised in torch.distributed,
    or by a ``Work.wait()`` with gloo's or NCCL's plain RuntimeError, which names its source."""
    return (isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and ("/gloo/" in str(exc) or "NCCL" in str(exc)))
            or any(f.filename == dist.distributed_c10d.__file__ for f in traceback.extract_tb(exc.__traceback__)))


def open_fds():
    """{fd: what it points to} (a number alone may have been closed and reused)."""
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass  # closed meanwhile (the listing's own fd among them)
    return out


register_op("parallel.noop", lambda ctx, tensors, meta: ({}, {}))
