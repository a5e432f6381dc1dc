"""Control messages between rank 0 and its workers: framing, authentication, schema, order.

The frame format is ``encode``'s docstring. JSON only: nothing here unpickles. This module imports
no torch, so that a worker can authenticate its channel before torch loads.
"""

import hashlib
import hmac
import json
import os
import select
import struct
import time
from dataclasses import dataclass, field

from .errors import ProtocolError

PROTOCOL_VERSION = 1
MAGIC = b"CPG1"
TOKEN_BYTES = 32
MAC_BYTES = 32
_PREFIX = struct.Struct(">4sII")
PAYLOAD_ALIGN = 64

KINDS_TO_WORKER = frozenset({"hello", "run", "cancel", "shutdown"})
KINDS_FROM_WORKER = frozenset({"booted", "connected", "ready", "result"})

# dtype name -> element size in bytes; the names are torch's (torch.float32 -> "float32").
DTYPE_SIZES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
    "complex64": 8, "complex128": 16,
}

_HEADER_KEYS = frozenset({"v", "seq", "id", "kind", "digest", "body"})
_ENTRY_KEYS = frozenset({"name", "dtype", "shape"})


@dataclass(frozen=True)
class Limits:
    """Upper bounds a receiver enforces before trusting a frame."""
    max_header_bytes: int = 1 << 20
    max_manifest_bytes: int = 1 << 20
    max_tensors: int = 4096
    max_ndim: int = 16
    max_name_chars: int = 256
    max_payload_bytes: int = 64 << 30


DEFAULT_LIMITS = Limits()


@dataclass
class Message:
    kind: str
    seq: int
    id: int
    body: dict
    manifest: list = field(default_factory=list)
    digest: str = ""


def canonical_json(obj):
    """One byte string per JSON value: sorted keys, no spaces, no NaN (ValueError), UTF-8."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")


def request_digest(kind, op_id, body, manifest):
    h = hashlib.sha256(canonical_json({"kind": kind, "id": op_id, "body": body}))
    h.update(b"\n")
    h.update(canonical_json(manifest))
    return h.hexdigest()


def payload_layout(manifest):
    """Manifest -> ([byte offset of each entry], total bytes) of the packed data-group buffer."""
    offsets, pos = [], 0
    for entry in manifest:
        pos = -(-pos // PAYLOAD_ALIGN) * PAYLOAD_ALIGN
        offsets.append(pos)
        n = DTYPE_SIZES[entry["dtype"]]
        for d in entry["shape"]:
            n *= d
        pos += n
    return offsets, pos


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def check_manifest(manifest, limits=DEFAULT_LIMITS):
    """Raise ProtocolError unless ``manifest`` is a list of unique, well-formed tensor entries."""
    if not isinstance(manifest, list):
        raise ProtocolError(f"manifest must be a JSON array, got {type(manifest).__name__}")
    if len(manifest) > limits.max_tensors:
        raise ProtocolError(f"manifest has {len(manifest)} tensors; the limit is {limits.max_tensors}")
    names = set()
    for i, e in enumerate(manifest):
        if not isinstance(e, dict) or set(e) != _ENTRY_KEYS:
            raise ProtocolError(f"manifest entry {i} must be an object with exactly {sorted(_ENTRY_KEYS)}, got {e!r:.200}")
        name, dtype, shape = e["name"], e["dtype"], e["shape"]
        if not isinstance(name, str) or not name or len(name) > limits.max_name_chars:
            raise ProtocolError(f"manifest entry {i}: name must be a non-empty string of at most {limits.max_name_chars} characters")
        if name in names:
            raise ProtocolError(f"manifest names tensor {name!r} twice")
        names.add(name)
        if dtype not in DTYPE_SIZES:
            raise ProtocolError(f"manifest entry {name!r}: dtype {dtype!r} is not one of {sorted(DTYPE_SIZES)}")
        if not isinstance(shape, list) or len(shape) > limits.max_ndim or not all(_is_int(d) and d >= 0 for d in shape):
            raise ProtocolError(f"manifest entry {name!r}: shape must be a list of at most {limits.max_ndim} non-negative ints, got {shape!r:.200}")
    total = payload_layout(manifest)[1]
    if total > limits.max_payload_bytes:
        raise ProtocolError(f"manifest describes {total} bytes of tensors; the limit is {limits.max_payload_bytes}")
    return total


def encode(token, kind, seq, op_id, body, manifest=(), limits=DEFAULT_LIMITS):
    """One authenticated frame. Raises ValueError for a body that is not JSON (NaN, objects...).

    Layout (integers big-endian)::

        magic     4 bytes   b"CPG1"
        hlen      u32       length of the header
        mlen      u32       length of the manifest
        header    hlen      UTF-8 JSON object {"v", "seq", "id", "kind", "digest", "body"}
        manifest  mlen      UTF-8 JSON array [{"name", "dtype", "shape"}, ...]
        mac       32 bytes  HMAC-SHA256(token, magic || hlen || mlen || header || manifest)

    ``v`` protocol version; ``seq`` per-direction counter that goes up by exactly one (a gap or repeat
    is a lost, replayed or injected frame); ``id`` the op the message is about; ``kind`` one of the
    kinds allowed in that direction; ``digest`` sha256 of the canonical JSON of (kind, id, body) and
    the manifest, which the ranks compare in the preflight gather. Tensor bytes never travel in a
    frame: the manifest names them and they go over the data group, packed by ``payload_layout``.
    """
    manifest = list(manifest)
    check_manifest(manifest, limits)
    digest = request_digest(kind, op_id, body, manifest)
    header = canonical_json({"v": PROTOCOL_VERSION, "seq": seq, "id": op_id, "kind": kind, "digest": digest, "body": body})
    man = canonical_json(manifest)
    if len(header) > limits.max_header_bytes or len(man) > limits.max_manifest_bytes:
        raise ValueError(f"{kind} message too large: header {len(header)} B, manifest {len(man)} B; "
                         f"limits {limits.max_header_bytes} B / {limits.max_manifest_bytes} B (keep meta small, send data as tensors)")
    framed = _PREFIX.pack(MAGIC, len(header), len(man)) + header + man
    return framed + hmac.new(token, framed, hashlib.sha256).digest()


class FrameReader:
    """Incremental, authenticated decoder for one direction of one channel.

    ``feed(bytes) -> [Message]``; ``close()`` at EOF raises if a frame was cut short. The prefix is
    checked against ``limits`` before the rest is read; a bad MAC, magic, version, kind or schema,
    non-JSON text, NaN, too deep nesting, a duplicate name or an EOF inside a frame raise
    ``ProtocolError``, and the channel is dead.
    """

    def __init__(self, token, kinds, limits=DEFAULT_LIMITS):
        if len(token) < TOKEN_BYTES:
            raise ValueError(f"token must be at least {TOKEN_BYTES} bytes")
        self._token = token
        self._kinds = frozenset(kinds)
        self.limits = limits
        self._buf = bytearray()
        self._seq = 0

    def feed(self, data):
        self._buf += data
        out = []
        while True:
            msg = self._next()
            if msg is None:
                return out
            out.append(msg)

    def close(self):
        if self._buf:
            need = self._frame_len() if len(self._buf) >= _PREFIX.size else _PREFIX.size
            raise ProtocolError(f"truncated control message: channel closed after {len(self._buf)} of {need} bytes")

    def _frame_len(self):
        magic, hlen, mlen = _PREFIX.unpack_from(self._buf)
        if magic != MAGIC:
            raise ProtocolError(f"bad magic {bytes(magic)!r} (expected {MAGIC!r}): not a comfy.parallel frame or the stream is out of step")
        if hlen > self.limits.max_header_bytes or mlen > self.limits.max_manifest_bytes:
            raise ProtocolError(f"oversize control message: header {hlen} B, manifest {mlen} B; "
                                f"limits {self.limits.max_header_bytes} B / {self.limits.max_manifest_bytes} B")
        return _PREFIX.size + hlen + mlen + MAC_BYTES

    def _next(self):
        if len(self._buf) < _PREFIX.size:
            return None
        total = self._frame_len()
        if len(self._buf) < total:
            return None
        frame = bytes(self._buf[:total])
        del self._buf[:total]
        _, hlen, mlen = _PREFIX.unpack_from(frame)
        body_end = total - MAC_BYTES
        expected = hmac.new(self._token, frame[:body_end], hashlib.sha256).digest()
        if not hmac.compare_digest(expected, frame[body_end:]):
            raise ProtocolError("bad MAC: the control message was not signed with this group's token")
        # any failure to decode is the sender's fault: a reader that raised anything else would die
        # and leave its side waiting for messages it will never decode
        try:
            header = json.loads(frame[_PREFIX.size:_PREFIX.size + hlen].decode("utf-8"), parse_constant=_reject_constant)
            manifest = json.loads(frame[_PREFIX.size + hlen:body_end].decode("utf-8"), parse_constant=_reject_constant)
            return self._check(header, manifest)
        except (UnicodeDecodeError, ValueError) as e:
            raise ProtocolError(f"control message is not valid UTF-8 JSON: {e}") from None
        except RecursionError:
            raise ProtocolError("control message nests too deeply to decode (a control message is a few levels of "
                                "JSON; send bulk data as tensors)") from None

    def _check(self, header, manifest):
        if not isinstance(header, dict) or set(header) != _HEADER_KEYS:
            keys = sorted(header) if isinstance(header, dict) else type(header).__name__
            raise ProtocolError(f"control header must have exactly the keys {sorted(_HEADER_KEYS)}, got {keys}")
        if not _is_int(header["v"]) or header["v"] != PROTOCOL_VERSION:
            raise ProtocolError(f"protocol version {header['v']!r} is not supported (this side speaks {PROTOCOL_VERSION}); "
                                "rank 0 and the workers must run the same comfy.parallel")
        kind = header["kind"]
        if kind not in self._kinds:
            raise ProtocolError(f"unknown message kind {kind!r} here; expected one of {sorted(self._kinds)}")
        seq, op_id, body = header["seq"], header["id"], header["body"]
        if not _is_int(seq) or not _is_int(op_id) or op_id < 0 or not isinstance(body, dict):
            raise ProtocolError("control header fields have the wrong types (seq/id must be ints >= 0, body an object)")
        if seq != self._seq + 1:
            raise ProtocolError(f"message out of order: seq {seq} after {self._seq} (expected {self._seq + 1})")
        check_manifest(manifest, self.limits)
        if header["digest"] != request_digest(kind, op_id, body, manifest):
            raise ProtocolError("digest does not match the header and manifest")
        self._seq = seq
        return Message(kind, seq, op_id, body, manifest, header["digest"])


def _reject_constant(name):
    raise ValueError(f"{name} is not allowed in control messages")


def write_all(fd, data, timeout):
    """Write all of ``data`` to a non-blocking ``fd`` within ``timeout`` seconds.

    Raises TimeoutError when the reader does not drain the pipe in time, BrokenPipeError when it
    has gone.
    """
    deadline = time.monotonic() + timeout
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
            view = view[n:]
            continue
        except BlockingIOError:
            pass
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"could not write {len(view)} more bytes of a control message within {timeout:.1f}s")
        select.select([], [fd], [], min(left, 0.5))


def read_exact(fd, n, timeout):
    """Read exactly ``n`` bytes from a blocking or non-blocking ``fd`` within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    out = bytearray()
    while len(out) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"got {len(out)} of {n} bytes within {timeout:.1f}s")
        ready, _, _ = select.select([fd], [], [], min(left, 0.5))
        if not ready:
            continue
        try:
            chunk = os.read(fd, n - len(out))
        except BlockingIOError:
            continue
        if not chunk:
            raise EOFError(f"channel closed after {len(out)} of {n} bytes")
        out += chunk
    return bytes(out)
