"""Control frames on the private pipes between rank 0 and a worker: a 4-byte big-endian length, then
one JSON object ``{"kind": str, "body": dict}``. Nothing is unpickled, and no tensor travels here (the
transport moves data). Only the worker inherits its pipes, so no other process can read or write them."""

import json
import os
import select
import struct
import time

MAX_FRAME = 1 << 20
_LENGTH = struct.Struct(">I")


def encode(kind, body):
    """-> the bytes of one frame. TypeError for a body that is not plain JSON or is too large."""
    try:
        raw = json.dumps({"kind": kind, "body": body}, allow_nan=False).encode()
    except (TypeError, ValueError) as e:
        raise TypeError(f"the {kind} message must be JSON (dicts, lists, str, numbers, bool, None; no NaN): {e}") from None
    if len(raw) > MAX_FRAME:
        raise TypeError(f"the {kind} message is {len(raw)} bytes of JSON, more than {MAX_FRAME}; move data with the transport")
    return _LENGTH.pack(len(raw)) + raw


def write(fd, data, timeout):
    """To a non-blocking ``fd``: TimeoutError if the reader does not take it in time, BrokenPipeError if gone."""
    deadline = time.monotonic() + timeout
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the other end did not take a control message within {timeout:g}s") from None
            select.poll().poll(50)


class Reader:
    """Frames from ``fd`` as they arrive: ``feed()`` -> [(kind, body)] (blocks on a blocking fd); EOFError at its end."""

    def __init__(self, fd):
        self.fd, self.buf = fd, bytearray()

    def feed(self):
        try:
            data = os.read(self.fd, 1 << 16)
        except BlockingIOError:
            return []
        if not data:
            raise EOFError("the control channel closed")
        self.buf += data
        out = []
        while len(self.buf) >= _LENGTH.size:
            (size,) = _LENGTH.unpack_from(self.buf)
            if size > MAX_FRAME:
                raise ValueError(f"a control frame of {size} bytes; the limit is {MAX_FRAME}")
            if len(self.buf) < _LENGTH.size + size:
                break
            raw = bytes(self.buf[_LENGTH.size:_LENGTH.size + size])
            del self.buf[:_LENGTH.size + size]
            try:
                frame = json.loads(raw)
            except (ValueError, RecursionError) as e:
                raise ValueError(f"a control frame is not JSON ({type(e).__name__})") from None
            if not (isinstance(frame, dict) and set(frame) == {"kind", "body"} and isinstance(frame["kind"], str)
                    and isinstance(frame["body"], dict)):
                raise ValueError(f"a control frame must be {{kind, body}}, got {raw[:120]!r}")
            out.append((frame["kind"], frame["body"]))
        return out
