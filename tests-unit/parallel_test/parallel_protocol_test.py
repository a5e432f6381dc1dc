"""Control-message framing, authentication and schema checks (no processes)."""

import hashlib
import hmac
import json
import struct

import pytest

from comfy.parallel.errors import ProtocolError
from comfy.parallel.protocol import (
    KINDS_FROM_WORKER,
    KINDS_TO_WORKER,
    MAGIC,
    MAC_BYTES,
    PAYLOAD_ALIGN,
    FrameReader,
    Limits,
    canonical_json,
    encode,
    payload_layout,
    request_digest,
)

TOKEN = bytes(range(32))
MANIFEST = [{"name": "x", "dtype": "bfloat16", "shape": [2, 3]}, {"name": "m", "dtype": "bool", "shape": [5]}]


def reader(**limits):
    return FrameReader(TOKEN, KINDS_TO_WORKER, Limits(**limits))


def forge(header, manifest, token=TOKEN):
    """A frame with a valid MAC around an arbitrary header (what a token holder could send)."""
    return forge_raw(json.dumps(header).encode(), json.dumps(manifest).encode(), token)


def forge_raw(h, m, token=TOKEN):
    framed = struct.pack(">4sII", MAGIC, len(h), len(m)) + h + m
    return framed + hmac.new(token, framed, hashlib.sha256).digest()


def good_header(seq=1, kind="run", body=None, manifest=()):
    body = body if body is not None else {"op": "x", "meta": {}}
    return {"v": 1, "seq": seq, "id": 1, "kind": kind, "body": body, "digest": request_digest(kind, 1, body, list(manifest))}


def test_round_trip_fed_one_byte_at_a_time():
    frames = encode(TOKEN, "run", 1, 7, {"op": "h3.forward", "meta": {"step": 3, "s": "é"}}, MANIFEST)
    frames += encode(TOKEN, "cancel", 2, 7, {})
    r = reader()
    got = []
    for i in range(len(frames)):
        got += r.feed(frames[i:i + 1])
    r.close()
    assert [(m.kind, m.seq, m.id) for m in got] == [("run", 1, 7), ("cancel", 2, 7)]
    assert got[0].body == {"op": "h3.forward", "meta": {"step": 3, "s": "é"}}
    assert got[0].manifest == MANIFEST
    assert got[0].digest == request_digest("run", 7, got[0].body, MANIFEST)
    assert payload_layout(got[0].manifest)[1] == 64 + 5


@pytest.mark.parametrize("where", ["header", "manifest", "mac"])
def test_flipped_byte_is_a_bad_mac(where):
    frame = bytearray(encode(TOKEN, "run", 1, 1, {"op": "x", "meta": {}}, MANIFEST))
    index = {"header": 14, "manifest": len(frame) - MAC_BYTES - 3, "mac": len(frame) - 1}[where]
    frame[index] ^= 0x01
    with pytest.raises(ProtocolError, match="bad MAC"):
        reader().feed(bytes(frame))


def test_other_token_is_a_bad_mac():
    frame = encode(bytes(32), "run", 1, 1, {"op": "x", "meta": {}})
    with pytest.raises(ProtocolError, match="bad MAC"):
        reader().feed(frame)


def test_unknown_kind_rejected_even_with_valid_mac():
    with pytest.raises(ProtocolError, match="unknown message kind 'exec'"):
        reader().feed(forge(good_header(kind="exec"), []))
    # a worker's reply kind is unknown in the other direction
    with pytest.raises(ProtocolError, match="unknown message kind 'result'"):
        reader().feed(encode(TOKEN, "result", 1, 1, {"status": "ok", "meta": {}}))
    assert "run" not in KINDS_FROM_WORKER


def test_oversize_rejected_from_the_prefix_alone():
    r = reader(max_header_bytes=1000)
    with pytest.raises(ProtocolError, match="oversize control message: header 4096 B"):
        r.feed(struct.pack(">4sII", MAGIC, 4096, 2))


def test_oversize_manifest_and_payload_rejected():
    with pytest.raises(ProtocolError, match="oversize"):
        reader(max_manifest_bytes=10).feed(encode(TOKEN, "run", 1, 1, {"op": "x", "meta": {}}, MANIFEST))
    frame = encode(TOKEN, "run", 1, 1, {"op": "x", "meta": {}}, [{"name": "big", "dtype": "float32", "shape": [1 << 20]}])
    with pytest.raises(ProtocolError, match="4194304 bytes of tensors; the limit is 1000"):
        reader(max_payload_bytes=1000).feed(frame)
    with pytest.raises(ValueError, match="run message too large"):
        encode(TOKEN, "run", 1, 1, {"op": "x", "meta": {"blob": "a" * 2000}}, (), Limits(max_header_bytes=1000))


def test_truncated_frame_rejected_at_eof():
    frame = encode(TOKEN, "run", 1, 1, {"op": "x", "meta": {}}, MANIFEST)
    r = reader()
    assert r.feed(frame[:-5]) == []
    with pytest.raises(ProtocolError, match=f"truncated control message: channel closed after {len(frame) - 5} of {len(frame)} bytes"):
        r.close()
    r = reader()
    r.feed(frame[:5])
    with pytest.raises(ProtocolError, match="truncated"):
        r.close()


def test_bad_magic_and_version_rejected():
    frame = encode(TOKEN, "run", 1, 1, {"op": "x", "meta": {}})
    with pytest.raises(ProtocolError, match="bad magic"):
        reader().feed(b"XXXX" + frame[4:])
    header = good_header()
    header["v"] = 2
    with pytest.raises(ProtocolError, match="protocol version 2 is not supported"):
        reader().feed(forge(header, []))


def test_sequence_gap_and_replay_rejected():
    first = encode(TOKEN, "run", 1, 1, {"op": "x", "meta": {}})
    r = reader()
    r.feed(first)
    with pytest.raises(ProtocolError, match="out of order: seq 1 after 1"):
        r.feed(first)
    with pytest.raises(ProtocolError, match="out of order: seq 3 after 0"):
        reader().feed(encode(TOKEN, "run", 3, 1, {"op": "x", "meta": {}}))


def test_schema_violations_rejected():
    extra = good_header()
    extra["pickle"] = "gASV"
    with pytest.raises(ProtocolError, match="exactly the keys"):
        reader().feed(forge(extra, []))
    wrong_digest = good_header()
    wrong_digest["digest"] = "0" * 64
    with pytest.raises(ProtocolError, match="digest does not match"):
        reader().feed(forge(wrong_digest, []))
    nan = json.dumps(good_header()).encode().replace(b'"meta": {}', b'"meta": NaN')
    assert b"NaN" in nan
    with pytest.raises(ProtocolError, match="NaN is not allowed"):
        reader().feed(forge_raw(nan, b"[]"))
    with pytest.raises(ProtocolError, match="not valid UTF-8 JSON"):
        reader().feed(forge_raw(b"\xff\xfe", b"[]"))


def test_deep_nesting_is_a_protocol_error():
    # validly signed: a token holder's bug must end the channel with a clear error, not kill the reader
    nested = b"[" * 100000 + b"]" * 100000
    header = json.dumps(good_header()).encode().replace(b'"meta": {}', b'"meta": ' + nested)
    with pytest.raises(ProtocolError, match="nests too deeply to decode"):
        reader().feed(forge_raw(header, b"[]"))
    with pytest.raises(ProtocolError, match="nests too deeply to decode"):
        reader().feed(forge_raw(json.dumps(good_header()).encode(), nested))


@pytest.mark.parametrize("manifest, message", [
    ([{"name": "a", "dtype": "float32", "shape": [1]}] * 2, "names tensor 'a' twice"),
    ([{"name": "a", "dtype": "object", "shape": [1]}], "dtype 'object' is not one of"),
    ([{"name": "a", "dtype": "float32", "shape": [-1]}], "non-negative ints"),
    ([{"name": "a", "dtype": "float32", "shape": [True]}], "non-negative ints"),
    ([{"name": "a", "dtype": "float32"}], "exactly"),
    ([{"name": "", "dtype": "float32", "shape": []}], "non-empty string"),
])
def test_bad_manifests_rejected(manifest, message):
    with pytest.raises(ProtocolError, match=message):
        reader().feed(forge(good_header(manifest=manifest), manifest))


def test_encode_refuses_non_json_bodies():
    with pytest.raises(ValueError):
        encode(TOKEN, "run", 1, 1, {"op": "x", "meta": {"v": float("nan")}})
    with pytest.raises(TypeError):
        encode(TOKEN, "run", 1, 1, {"op": "x", "meta": {"v": object()}})


def test_payload_layout_is_aligned():
    manifest = [{"name": "a", "dtype": "uint8", "shape": [3]}, {"name": "b", "dtype": "float64", "shape": [2, 2]},
                {"name": "c", "dtype": "bool", "shape": [0]}, {"name": "d", "dtype": "int16", "shape": []}]
    offsets, total = payload_layout(manifest)
    assert offsets == [0, PAYLOAD_ALIGN, 2 * PAYLOAD_ALIGN, 2 * PAYLOAD_ALIGN]
    assert total == 2 * PAYLOAD_ALIGN + 2


def test_canonical_json_is_order_independent():
    assert canonical_json({"b": 1, "a": [1, {"d": 2, "c": 3}]}) == b'{"a":[1,{"c":3,"d":2}],"b":1}'
