"""Control frames on the private pipes between rank 0 and a worker: a 4-byte big-endian length, a JSON header
``{"kind", "body", "tensors": [[name, dtype, shape], ...]}``, then each tensor's bytes. Nothing is unpickled.
Only the worker inherits its pipes, so no other process can read or write them: no token to check."""

import json
import os
import select
import struct
import time

import torch

MAX_HEADER = 1 << 24
_LENGTH = struct.Struct(">I")
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64)}


def check_json(value, what):
    try:
        return json.dumps(value, allow_nan=False).encode()
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what} must be JSON-able (dicts, lists, str, numbers, bool, None; no NaN): {e}") from None


def encode(kind, body, tensors=None):
    """-> the buffers of one frame. TypeError for a body that is not JSON or a dtype workers cannot take."""
    entries, blobs = [], []
    for name, t in (tensors or {}).items():
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise TypeError(f"tensor {name!r} is {t.dtype}, which cannot be sent to workers; use one of {sorted(DTYPES)}")
        entries.append([name, dtype, list(t.shape)])
        blobs.append(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().data)
    header = check_json({"kind": kind, "body": body, "tensors": entries}, f"the {kind} message")
    if len(header) > MAX_HEADER:
        raise TypeError(f"the {kind} message is {len(header)} bytes of JSON; send bulk data as tensors")
    return [_LENGTH.pack(len(header)) + header, *blobs]


def write(fd, buffers, timeout):
    """To a non-blocking ``fd``: TimeoutError if the reader does not take them in time, BrokenPipeError if gone."""
    deadline = time.monotonic() + timeout
    for buf in buffers:
        view = memoryview(buf).cast("B")
        while view:
            try:
                view = view[os.write(fd, view):]
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the worker did not take a control message within {timeout:g}s") from None
                select.select([], [fd], [], 0.5)


def _read_into(fd, view):
    while view:
        n = os.readv(fd, [view])
        if n == 0:
            raise EOFError("the control channel closed inside a frame")
        view = view[n:]


def _header(raw):
    (size,) = _LENGTH.unpack(raw)
    if size > MAX_HEADER:
        raise ValueError(f"control frame header of {size} bytes; the limit is {MAX_HEADER}")
    return size


def _parse(raw):
    header = json.loads(raw)
    try:
        ok = set(header) == {"kind", "body", "tensors"} and isinstance(header["body"], dict) and all(
            len(e) == 3 and isinstance(e[0], str) and e[1] in DTYPES and all(isinstance(d, int) and d >= 0 for d in e[2])
            for e in header["tensors"])
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(f"a control frame header must be {{kind, body, tensors}}, got {raw[:200]!r}")
    return header


def read(fd):
    """One frame from a blocking ``fd`` -> (kind, body, tensors); EOFError when it closes between frames."""
    head = bytearray(_LENGTH.size)
    first = os.readv(fd, [head])
    if not first:
        raise EOFError("the control channel closed")
    _read_into(fd, memoryview(head)[first:])
    raw = bytearray(_header(head))
    _read_into(fd, memoryview(raw))
    header = _parse(bytes(raw))
    tensors = {}
    for name, dtype, shape in header["tensors"]:
        tensors[name] = torch.empty(shape, dtype=DTYPES[dtype])
        _read_into(fd, memoryview(tensors[name].reshape(-1).view(torch.uint8).numpy()).cast("B"))
    return header["kind"], header["body"], tensors


def split(buf):
    """The complete tensor-less frames at the start of ``buf`` (a bytearray, consumed) -> [(kind, body)]."""
    out = []
    while len(buf) >= _LENGTH.size and len(buf) >= _LENGTH.size + _header(buf[:_LENGTH.size]):
        end = _LENGTH.size + _header(buf[:_LENGTH.size])
        header = _parse(bytes(buf[_LENGTH.size:end]))
        del buf[:end]
        if header["tensors"]:
            raise ValueError("a worker's reply carries no tensors")
        out.append((header["kind"], header["body"]))
    return out
