"""Canonical bytes for patch snapshots: JSON manifests, tensor hashing and the safetensors payload.

A snapshot (or delta) travels as one byte string:

    MAGIC (8 bytes)
    u64 little-endian  n_env    | envelope JSON   {"digest", "lineage"[, "base_lineage"]}
    u64 little-endian  n_man    | manifest JSON   (schema, patch structure, tensor dtypes/shapes/sha256)
    safetensors payload         (tensors sorted by name, canonical header, no metadata)

All JSON is canonical (sorted keys, no whitespace, ASCII, no NaN/Infinity) and decoding refuses JSON
that is not byte-identical to its canonical form. The manifest records the sha256 of every tensor's
raw bytes, so ``sha256(manifest)`` commits to every byte of the state: that is the snapshot digest.
The envelope carries what is not content (the lineage counter) and the digest it claims.

Nothing here unpickles: once the payload header matched the one the manifest implies byte for byte
and each tensor's bytes their sha256, every tensor is a private copy of its bytes (``torch.frombuffer``).
Hashing runs on a few threads (hashlib releases the GIL on large buffers): it is most of the cost.
"""

import concurrent.futures
import hashlib
import json
import os
import re
import struct
import sys

import torch

SCHEMA_VERSION = 2
MAGIC = b"CMFYPSN\x00"
MAX_ENVELOPE_BYTES = 4096
MAX_MANIFEST_BYTES = 256 * 1024 * 1024

# torch dtype name (manifest) <-> safetensors dtype tag (payload); the only dtypes patch tensors take
DTYPES = {
    "float64": (torch.float64, "F64"),
    "float32": (torch.float32, "F32"),
    "float16": (torch.float16, "F16"),
    "bfloat16": (torch.bfloat16, "BF16"),
    "float8_e4m3fn": (torch.float8_e4m3fn, "F8_E4M3"),
    "float8_e5m2": (torch.float8_e5m2, "F8_E5M2"),
}
DTYPE_NAMES = {dt: name for name, (dt, _) in DTYPES.items()}
_HEX64 = re.compile(r"[0-9a-f]{64}")


class SnapshotFormatError(ValueError):
    """Bytes that are not a valid, canonical, untampered patch snapshot or delta."""


def canonical_json(obj) -> bytes:
    try:
        return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")
    except ValueError as e:
        raise ValueError(f"patch state holds a value JSON cannot carry exactly ({e}); strengths and adapter "
                         "scalars must be finite numbers") from None


def _reject_constant(name):
    raise SnapshotFormatError(f"JSON holds the non-finite number {name}; only finite numbers are valid")


def _no_duplicates(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise SnapshotFormatError(f"JSON object repeats the key {k!r}")
        out[k] = v
    return out


def parse_canonical_json(raw: bytes, what: str):
    try:
        obj = json.loads(raw.decode("ascii"), parse_constant=_reject_constant, object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SnapshotFormatError(f"{what} is not ASCII JSON: {e}") from None
    if canonical_json(obj) != raw:
        raise SnapshotFormatError(f"{what} is valid JSON but not in canonical form (sorted keys, no whitespace, "
                                  "shortest float repr); re-encode it with PatchSnapshot.encode()")
    return obj


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def is_digest(value) -> bool:
    return isinstance(value, str) and _HEX64.fullmatch(value) is not None


def parallel_map(fn, items):
    """[fn(x) for x in items] on a few threads; exceptions propagate in the order of ``items``."""
    items = list(items)
    if len(items) < 2:
        return [fn(x) for x in items]
    with concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1, len(items))) as pool:
        return list(pool.map(fn, items))


def cpu_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous()


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Raw little-endian bytes of a CPU contiguous tensor, without a copy (viewed as uint8: numpy has no
    bfloat16 or float8)."""
    if sys.byteorder != "little":
        raise RuntimeError("patch snapshots store little-endian tensor bytes; this host is big-endian")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def tensor_meta(t: torch.Tensor) -> dict:
    """{"dtype", "shape", "sha256"} of a tensor; raises ValueError for dtypes a snapshot cannot carry."""
    name = DTYPE_NAMES.get(t.dtype)
    if name is None:
        raise ValueError(f"dtype {t.dtype} (expected one of {', '.join(DTYPES)})")
    return {"dtype": name, "shape": list(t.shape), "sha256": sha256_hex(tensor_bytes(cpu_contiguous(t)))}


def tensor_name(meta: dict) -> str:
    """A tensor's name in manifests and payloads: sha256 of its canonical meta (dtype, shape, sha256 of
    the bytes). Equal content has one name wherever it sits, so a delta never resends what its base holds."""
    return sha256_hex(canonical_json(meta))


def _nbytes(meta: dict) -> int:
    n = DTYPES[meta["dtype"]][0].itemsize
    for d in meta["shape"]:
        n *= d
    return n


def _safetensors_header(metas: dict) -> bytes:
    header, offset = {}, 0
    for name in sorted(metas):
        size = _nbytes(metas[name])
        header[name] = {"dtype": DTYPES[metas[name]["dtype"]][1], "shape": metas[name]["shape"],
                        "data_offsets": [offset, offset + size]}
        offset += size
    raw = canonical_json(header)
    # the safetensors writers pad the header with spaces to 8 bytes so tensor data stays aligned
    return raw + b" " * (-len(raw) % 8)


def write_payload(tensors: dict, metas: dict) -> list:
    """The safetensors payload as a list of buffers, joined once by ``pack``."""
    header = _safetensors_header(metas)
    parts = [struct.pack("<Q", len(header)), header]
    return parts + [tensor_bytes(cpu_contiguous(tensors[name])) for name in sorted(metas)]


def _read_tensor(raw: memoryview, meta: dict) -> torch.Tensor:
    dtype = DTYPES[meta["dtype"]][0]
    if not len(raw):
        return torch.empty(meta["shape"], dtype=dtype)
    # a private, writable copy: no tensor keeps the whole message alive
    return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(meta["shape"])


def read_payload(payload: memoryview, metas: dict) -> dict:
    """Tensors of a payload whose header, length and per-tensor sha256 all match ``metas``."""
    head = _safetensors_header(metas)
    head = struct.pack("<Q", len(head)) + head
    expected = len(head) + sum(_nbytes(m) for m in metas.values())
    if len(payload) >= len(head) and bytes(payload[:len(head)]) != head:
        raise SnapshotFormatError("safetensors header does not match the manifest's tensor names, dtypes and shapes")
    if len(payload) != expected:
        raise SnapshotFormatError(f"tensor payload is {len(payload)} bytes, the manifest implies {expected}: "
                                  "the data was truncated or has trailing bytes")
    spans, pos = [], len(head)
    for name in sorted(metas):
        spans.append((name, payload[pos:pos + _nbytes(metas[name])]))
        pos += _nbytes(metas[name])

    def read(span):
        name, raw = span
        if sha256_hex(raw) != metas[name]["sha256"]:
            raise SnapshotFormatError(f"tensor {name!r} does not match its sha256 in the manifest: the payload "
                                      "was altered in transit (or the source tensor changed after capture)")
        return name, _read_tensor(raw, metas[name])

    return dict(parallel_map(read, spans))


def pack(envelope: dict, manifest_raw: bytes, payload) -> bytes:
    """``payload``: bytes, or the list of buffers ``write_payload`` returns."""
    env = canonical_json(envelope)
    parts = payload if isinstance(payload, list) else [payload]
    return b"".join([MAGIC, struct.pack("<Q", len(env)), env, struct.pack("<Q", len(manifest_raw)), manifest_raw, *parts])


def unpack(data, max_bytes=None):
    """bytes -> (envelope dict, manifest bytes, payload memoryview); checks framing and the digest."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise SnapshotFormatError(f"expected bytes, got {type(data).__name__}")
    mv = memoryview(data).cast("B")
    if max_bytes is not None and len(mv) > max_bytes:
        raise SnapshotFormatError(f"snapshot is {len(mv)} bytes, over the limit of {max_bytes}")
    if bytes(mv[:len(MAGIC)]) != MAGIC:
        raise SnapshotFormatError(f"not a patch snapshot: the first bytes are {bytes(mv[:len(MAGIC)])!r}, expected {MAGIC!r}")
    pos = len(MAGIC)
    parts = []
    for what, limit in (("envelope", MAX_ENVELOPE_BYTES), ("manifest", MAX_MANIFEST_BYTES)):
        if len(mv) < pos + 8:
            raise SnapshotFormatError(f"truncated before the {what} length")
        (n,) = struct.unpack("<Q", mv[pos:pos + 8])
        pos += 8
        if n > limit:
            raise SnapshotFormatError(f"{what} length {n} exceeds the limit of {limit} bytes")
        if len(mv) < pos + n:
            raise SnapshotFormatError(f"truncated inside the {what}: {len(mv) - pos} of {n} bytes present")
        parts.append(bytes(mv[pos:pos + n]))
        pos += n
    envelope = parse_canonical_json(parts[0], "envelope")
    if not isinstance(envelope, dict) or not is_digest(envelope.get("digest")):
        raise SnapshotFormatError(f"envelope {envelope!r} lacks a sha256 hex digest")
    actual = sha256_hex(parts[1])
    if actual != envelope["digest"]:
        raise SnapshotFormatError(f"manifest sha256 {actual} does not match the digest {envelope['digest']} "
                                  "the envelope claims: the data was altered")
    return envelope, parts[1], mv[pos:]
