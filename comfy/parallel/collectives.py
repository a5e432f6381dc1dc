"""The collectives the group itself issues: input broadcast, preflight gather, cancel agreement, probe.

Everything crosses as tensors (bytes as uint8), never as pickled objects: no
``all_gather_object`` / ``broadcast_object_list``.
"""

import struct

import torch
import torch.distributed as dist

from .errors import PreflightMismatch
from .protocol import DTYPE_SIZES, payload_layout

TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPE_SIZES if hasattr(torch, name)}

# Preflight record of one op: op id, request digest (sha256), status, cancel flag.
_OP_RECORD = struct.Struct(">Q32sBB")
STATUS_OK = 0
STATUS_UNKNOWN_OP = 1
_STATUS_WORDS = {STATUS_UNKNOWN_OP: "does not have the op registered (check worker_spec['imports'])"}


def dtype_name(dtype):
    name = str(dtype).removeprefix("torch.")
    if name not in TORCH_DTYPES:
        raise TypeError(f"dtype {dtype} cannot be sent to workers; supported: {sorted(TORCH_DTYPES)}")
    return name


def manifest_for(tensors):
    """{name: tensor} -> manifest entries in insertion order."""
    return [{"name": k, "dtype": dtype_name(t.dtype), "shape": list(t.shape)} for k, t in tensors.items()]


def broadcast_inputs(manifest, tensors, device, group):
    """Rank 0's ``tensors`` -> the same tensors on ``device`` on every rank, with one broadcast.

    Rank 0 passes its tensors; workers pass None. All tensors travel packed in one uint8 buffer
    ``[total bytes]`` laid out by ``protocol.payload_layout`` (64-byte aligned, so the per-tensor
    views need no copy). Nothing is sent when the payload is empty.
    """
    offsets, total = payload_layout(manifest)
    if tensors is not None:
        placed = {e["name"]: tensors[e["name"]].to(device) for e in manifest}
        if total:
            buf = torch.zeros(total, dtype=torch.uint8, device=device)
            for e, off in zip(manifest, offsets):
                flat = placed[e["name"]].detach().contiguous().reshape(-1).view(torch.uint8)
                buf[off:off + flat.numel()].copy_(flat)
            dist.broadcast(buf, src=0, group=group)
        return placed
    buf = torch.empty(total, dtype=torch.uint8, device=device)
    if total:
        dist.broadcast(buf, src=0, group=group)
    out = {}
    for e, off in zip(manifest, offsets):
        dtype = TORCH_DTYPES[e["dtype"]]
        n = DTYPE_SIZES[e["dtype"]]
        for d in e["shape"]:
            n *= d
        out[e["name"]] = buf[off:off + n].view(dtype).reshape(e["shape"])
    return out


def gather_records(record, group, world_size):
    """Every rank's fixed-width ``record`` (bytes, same length on all ranks) -> list in rank order."""
    mine = torch.frombuffer(bytearray(record), dtype=torch.uint8)
    parts = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(parts, mine, group=group)
    return [p.numpy().tobytes() for p in parts]


def agree_any(flag, group):
    """True on every rank if ``flag`` is True on any rank."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def op_preflight(op_id, op_name, digest, status, cancel, group, world_size):
    """The gather every op starts with. Returns True if any rank saw a cancel; raises PreflightMismatch.

    Runs over the gloo control group before the input broadcast, so a rank that got a different
    request, or lacks the op, makes every rank stop before any data collective.
    """
    record = _OP_RECORD.pack(op_id, bytes.fromhex(digest), status, 1 if cancel else 0)
    views = [_OP_RECORD.unpack(r) for r in gather_records(record, group, world_size)]
    problems = []
    for r, (rid, rdigest, rstatus, _) in enumerate(views):
        if rstatus != STATUS_OK:
            problems.append(f"rank {r} {_STATUS_WORDS.get(rstatus, f'reported status {rstatus}')}")
        elif (rid, rdigest) != (views[0][0], views[0][1]):
            problems.append(f"rank {r} is at op {rid} with digest {rdigest.hex()[:12]}, rank 0 at op {views[0][0]} "
                            f"with digest {views[0][1].hex()[:12]}")
    if problems:
        raise PreflightMismatch(f"op {op_name!r} (id {op_id}) stopped before any data collective: " + "; ".join(problems),
                                [(v[0], v[1].hex(), v[2]) for v in views])
    return any(v[3] for v in views)


def probe(rank, world_size, device, data_group, control_group):
    """all_reduce on both groups and all_to_all on the data group, with known answers.

    Raises RuntimeError describing the wrong answer; transport errors propagate as they are.
    """
    expected_sum = world_size * (world_size + 1) // 2
    t = torch.full((world_size,), rank + 1, dtype=torch.int64, device=device)
    dist.all_reduce(t, group=data_group)
    if t.cpu().tolist() != [expected_sum] * world_size:
        raise RuntimeError(f"data all_reduce returned {t.cpu().tolist()}, expected {[expected_sum] * world_size}")
    send = torch.tensor([rank * world_size + j for j in range(world_size)], dtype=torch.float32, device=device)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=data_group)
    want = [float(j * world_size + rank) for j in range(world_size)]
    if recv.cpu().tolist() != want:
        raise RuntimeError(f"data all_to_all returned {recv.cpu().tolist()}, expected {want}")
    c = torch.tensor([rank + 1], dtype=torch.int64)
    dist.all_reduce(c, group=control_group)
    if c.item() != expected_sum:
        raise RuntimeError(f"control all_reduce returned {c.item()}, expected {expected_sum}")
