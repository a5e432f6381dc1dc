"""Ops (and setups) that the parallel tests run on every rank; workers import this module by name."""

import hashlib
import os
import signal
import subprocess
import sys
import threading
import time

import torch
import torch.distributed as dist

from comfy.parallel import register_op


def digest(t):
    return hashlib.sha256(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


@register_op("test.echo")
def echo(ctx, tensors, meta):
    """Hands rank 0's inputs back and reports, per rank, what arrived (sha256 of the bytes, dtype, shape)."""
    seen = {k: [digest(t), str(t.dtype), list(t.shape), str(t.device)] for k, t in tensors.items()}
    return dict(tensors), {"rank": ctx.rank, "world": ctx.world_size, "seen": seen, "meta": meta}


@register_op("test.collectives")
def collectives(ctx, tensors, meta):
    """all_reduce and all_to_all over the data group; rank 0 returns both results."""
    n = ctx.world_size
    total = torch.full((3,), float(ctx.rank + 1), device=ctx.device)
    dist.all_reduce(total, group=ctx.data_group)
    send = torch.tensor([100.0 * ctx.rank + j for j in range(n)], device=ctx.device)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=ctx.data_group)
    scaled = tensors["x"] * (ctx.rank + 1)
    dist.all_reduce(scaled, group=ctx.data_group)
    return {"sum": total, "a2a": recv, "scaled": scaled}, {"rank": ctx.rank, "a2a": recv.tolist()}


@register_op("test.wait_for_cancel")
def wait_for_cancel(ctx, tensors, meta):
    """Checks ctx.cancelled() every ``poll`` s for at most ``seconds``; rank 0 flags entry in ctx.state."""
    started = ctx.state.get("started")
    if started is not None:
        started.set()
    deadline = time.monotonic() + meta.get("seconds", 30.0)
    checks = 0
    while time.monotonic() < deadline:
        checks += 1
        if ctx.cancelled():
            ctx.check_cancelled()
        time.sleep(meta.get("poll", 0.02))
    return {}, {"checks": checks}


@register_op("test.workers_sleep")
def workers_sleep(ctx, tensors, meta):
    """Workers sleep ``seconds`` without any check; rank 0 then waits in a collective with them."""
    started = ctx.state.get("started")
    if started is not None:
        started.set()
    if ctx.rank > 0:
        time.sleep(meta.get("seconds", 30.0))
    ctx.check_cancelled()
    return {}, {}


@register_op("test.finish_ignoring_cancel")
def finish_ignoring_cancel(ctx, tensors, meta):
    """Never checks for cancellation: workers sleep ``seconds``, then every rank meets in a barrier and
    the op finishes normally on all of them."""
    started = ctx.state.get("started")
    if started is not None:
        started.set()
    if ctx.rank > 0:
        time.sleep(meta.get("seconds", 1.0))
    dist.barrier(group=ctx.control_group)
    return {}, {"finished": True}


@register_op("test.rank0_busy")
def rank0_busy(ctx, tensors, meta):
    """Rank 0 computes for ``seconds`` outside any collective (killing the workers cannot end that);
    workers wait for it in a barrier."""
    started = ctx.state.get("started")
    if started is not None:
        started.set()
    if ctx.rank == 0:
        time.sleep(meta.get("seconds", 30.0))
    dist.barrier(group=ctx.control_group)
    return {}, {}


@register_op("test.raise_on")
def raise_on(ctx, tensors, meta):
    """Raises ValueError on rank ``meta['rank']`` (the others wait in a collective)."""
    if ctx.rank == meta["rank"]:
        raise ValueError(f"boom on rank {ctx.rank}")
    dist.barrier(group=ctx.control_group)
    return {}, {}


@register_op("test.preflight")
def preflight(ctx, tensors, meta):
    """ctx.preflight with a digest that differs on rank ``meta['odd']`` (or nowhere when -1)."""
    ctx.preflight("plan-odd" if ctx.rank == meta["odd"] else "plan-same")
    return {}, {"passed": True}


@register_op("test.state")
def state(ctx, tensors, meta):
    """Reports what setup left in ctx.state."""
    return {}, {"rank": ctx.rank, "built": ctx.state.get("built")}


@register_op("test.setup_build")
def setup_build(ctx, tensors, meta):
    """Records its argument in ctx.state on the workers (as a model build would)."""
    if ctx.rank > 0:
        ctx.state["built"] = f"{meta['value']}-rank{ctx.rank}"
    return {}, {"built": ctx.state.get("built"), "pid": os.getpid()}


@register_op("test.die_in")
def die_in(ctx, tensors, meta):
    """Rank ``meta['rank']`` enters ``meta['collective']`` and SIGKILLs itself while its peers are in it."""
    n, big = ctx.world_size, meta.get("numel", 1 << 22)
    if meta["collective"] == "broadcast":
        x = torch.zeros(big, dtype=torch.uint8)
        call = lambda: dist.broadcast(x, src=0, group=ctx.data_group, async_op=True)
    elif meta["collective"] == "all_to_all":
        x = torch.zeros(n * big // 4)
        call = lambda: dist.all_to_all_single(torch.empty_like(x), x, group=ctx.data_group, async_op=True)
    else:
        x = torch.zeros(big // 4)
        parts = [torch.empty_like(x) for _ in range(n)] if ctx.rank == 0 else None
        call = lambda: dist.gather(x, parts, dst=0, group=ctx.data_group, async_op=True)
    work = call()
    if ctx.rank == meta["rank"]:
        os.kill(os.getpid(), signal.SIGKILL)
    work.wait()
    return {}, {}


@register_op("test.hang_on")
def hang_on(ctx, tensors, meta):
    """Rank ``meta['rank']`` blocks forever (a deadlock); the others wait for it in a collective."""
    if ctx.rank == meta["rank"]:
        threading.Event().wait()
    dist.barrier(group=ctx.data_group)
    return {}, {}


@register_op("test.spawn_child")
def spawn_child(ctx, tensors, meta):
    """Rank 0 starts a child with close_fds=False (as os.system does) and lists the fds it holds."""
    if ctx.rank == 0:
        out = subprocess.run([sys.executable, "-c", "import os; print(' '.join(os.listdir('/proc/self/fd')))"],
                             close_fds=False, capture_output=True, text=True, check=True)
        return {}, {"child_fds": [int(f) for f in out.stdout.split()]}
    return {}, {}
