"""Ops that the parallel tests run on every rank; workers import this module by name.

``PARALLEL_TEST_SLOW_IMPORT=<seconds>`` (``start(env=...)`` reaches the workers only) makes a worker's
import of this module take that long, as a slow start-up would.
"""

import os
import sys
import time

import torch

from comfy.parallel import channel, register_op

time.sleep(float(os.environ.get("PARALLEL_TEST_SLOW_IMPORT", "0")))


@register_op("test.echo")
def echo(ctx, meta):
    """Every rank's rank, world size, pid and the meta it got."""
    return {"rank": ctx.rank, "world": ctx.world_size, "pid": os.getpid(), "meta": meta}


@register_op("test.exchange")
def exchange(ctx, meta):
    """all_to_all of known values in ``meta['sizes']`` (bytes, rank i -> rank j), then a broadcast; -> True where right."""
    n, r, sizes = ctx.world_size, ctx.rank, meta["sizes"]
    sends = [torch.full((sizes[r][j] // 4,), 100.0 * r + j, device=ctx.device) for j in range(n)]
    recvs = [torch.empty(sizes[i][r] // 4, device=ctx.device) for i in range(n)]
    ctx.transport.all_to_all(sends, recvs, sizes).wait()
    want = torch.arange(meta["broadcast"], dtype=torch.int32, device=ctx.device)
    shared = [want.clone() if r == 0 else torch.empty_like(want)]
    ctx.transport.broadcast(shared)
    return all(bool((recvs[i] == 100.0 * i + r).all()) for i in range(n)) and torch.equal(shared[0], want)


@register_op("test.busy")
def busy(ctx, meta):
    """Ranks in ``meta['ranks']`` work ``meta['seconds']`` before the collective the others wait in."""
    if ctx.rank in meta["ranks"]:
        time.sleep(meta["seconds"])
    ctx.transport.all_gather_bytes(b"done")
    return {}


@register_op("test.fail")
def fail(ctx, meta):
    """Rank ``meta['rank']`` raises ValueError before a collective; the others wait in it."""
    if ctx.rank == meta["rank"]:
        raise ValueError(f"bad input on rank {ctx.rank}")
    ctx.transport.all_gather_bytes(b"x")
    return {}


@register_op("test.preflight")
def preflight(ctx, meta):
    ctx.preflight("same" if ctx.rank != meta.get("odd") else "other")
    return {}


@register_op("test.reply")
def reply(ctx, meta):
    """Rank 1 writes ``meta['raw']`` (latin-1) to its reply pipe, as a broken worker would."""
    if ctx.rank == 1:
        channel.write(int(sys.argv[4]), meta["raw"].encode("latin-1"), 30.0)  # the worker's argv: -c, path, rank, cmd fd, reply fd
        time.sleep(30)
    return {}


@register_op("test.silent")
def silent(ctx, meta):
    """Rank 1 stops its heartbeat and blocks without CPU, as a worker wedged in a system call would."""
    if ctx.rank == 1:
        ctx.transport.heartbeat = lambda: None
        r, _ = os.pipe()
        os.read(r, 1)
    ctx.transport.all_gather_bytes(b"x")
    return {}


@register_op("test.grad_modes")
def grad_modes(ctx, meta):
    """Whether this rank runs the op in inference mode, and whether a product of a weight that requires grad keeps a graph."""
    w = torch.ones(4, requires_grad=True)
    return {"inference": torch.is_inference_mode_enabled(), "graph": (w * 2).requires_grad}


@register_op("test.value")
def value(ctx, meta):
    """Rank 0 returns a tensor; a worker returns a list, or with ``meta['bad']`` a set, which is not JSON."""
    return torch.arange(3) if ctx.rank == 0 else ({1, 2} if meta["bad"] else [1, 2])


@register_op("test.stream")
def stream(ctx, meta):
    """All-to-alls of ``meta['mb']`` MB per pair for ``meta['seconds']`` (a peer may be killed meanwhile)."""
    n, size = ctx.world_size, int(meta["mb"] * 1e6) // 4 * 4
    sends = [torch.ones(size // 4, device=ctx.device) for _ in range(n)]
    recvs = [torch.empty(size // 4, device=ctx.device) for _ in range(n)]
    end = time.monotonic() + meta["seconds"]
    while time.monotonic() < end:
        ctx.transport.all_to_all(sends, recvs, [[size] * n for _ in range(n)]).wait()
    return {}
