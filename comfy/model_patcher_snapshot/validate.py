"""Schema check of a decoded patch snapshot manifest and envelope: every field, type and name.

The manifest's digest was already verified, so what fails here was written by a different schema
or a different program. Every message names the field, what was expected and what was found.
"""

import math

from .codec import DTYPES, SCHEMA_VERSION, SnapshotFormatError, is_digest, tensor_name

_TOP = {
    "snapshot": {"schema", "kind", "force_cast_weights", "object_patches", "patches", "tensors"},
    "delta": {"schema", "kind", "force_cast_weights", "object_patches", "patches", "tensors",
              "base_digest", "target_digest", "removed"},
}
_ENVELOPE = {"snapshot": {"digest", "lineage"}, "delta": {"base_lineage", "digest", "lineage"}}
_ENTRY = {"strength", "strength_model", "offset", "value"}
_VALUE = {"adapter": {"type", "adapter", "weights"}, "diff": {"type", "tensor", "pad_weight"}, "set": {"type", "tensor"}}
_SLOT_KINDS = {"tensor", "float", "int", "ints"}


def _fail(where, expected, found):
    raise SnapshotFormatError(f"manifest {where}: expected {expected}, found {found!r}")


def _keys(obj, expected, where):
    if not isinstance(obj, dict) or set(obj) != expected:
        found = sorted(obj) if isinstance(obj, dict) else obj
        _fail(where, f"an object with the fields {sorted(expected)}", found)


def _count(x, where):
    if type(x) is not int or x < 0:
        _fail(where, "a non-negative integer", x)


def _num(x, where, kind=(int, float)):
    if type(x) not in kind or not math.isfinite(x):
        _fail(where, "a finite number", x)


def _tensor_ref(name, where, seen):
    if not is_digest(name):
        _fail(where, "a tensor name (64 lowercase hex digits)", name)
    seen.setdefault(name, where)


def _value(v, key, i, adapter_names, seen):
    where = f"patches[{key!r}][{i}].value"
    if not isinstance(v, dict) or v.get("type") not in _VALUE:
        _fail(where, f"an object whose type is one of {sorted(_VALUE)}", v)
    _keys(v, _VALUE[v["type"]], where)
    if v["type"] != "adapter":
        _tensor_ref(v["tensor"], where + ".tensor", seen)
        if v["type"] == "diff" and type(v["pad_weight"]) is not bool:
            _fail(where + ".pad_weight", "a bool", v["pad_weight"])
        return
    if v["adapter"] not in adapter_names:
        _fail(where + ".adapter", f"one of {list(adapter_names)}", v["adapter"])
    if not isinstance(v["weights"], list):
        _fail(where + ".weights", "a list of slots", v["weights"])
    for j, slot in enumerate(v["weights"]):
        w = f"{where}.weights[{j}]"
        if slot is None:
            continue
        if not isinstance(slot, dict) or len(slot) != 1 or next(iter(slot)) not in _SLOT_KINDS:
            _fail(w, f"null or an object with one of the fields {sorted(_SLOT_KINDS)}", slot)
        kind, x = next(iter(slot.items()))
        if kind == "tensor":
            _tensor_ref(x, w, seen)
        elif kind == "ints":
            if not isinstance(x, list) or any(type(n) is not int for n in x):
                _fail(w, "a list of integers", x)
        else:
            _num(x, w, (float,) if kind == "float" else (int,))


def _patches(patches, adapter_names, seen):
    if not isinstance(patches, dict):
        _fail("patches", "an object of key -> entries", patches)
    for key, entries in patches.items():
        if not key or not isinstance(entries, list):
            _fail(f"patches[{key!r}]", "a non-empty key with a list of entries", entries)
        for i, e in enumerate(entries):
            where = f"patches[{key!r}][{i}]"
            _keys(e, _ENTRY, where)
            _num(e["strength"], where + ".strength")
            _num(e["strength_model"], where + ".strength_model")
            off = e["offset"]
            if off is not None and (not isinstance(off, list) or len(off) != 3 or any(type(n) is not int or n < 0 for n in off)):
                _fail(where + ".offset", "null or [dim, start, length] of non-negative integers", off)
            _value(e["value"], key, i, adapter_names, seen)


def _tensors(metas, seen, delta):
    if not isinstance(metas, dict):
        _fail("tensors", "an object of name -> {dtype, shape, sha256}", metas)
    # a delta carries only the referenced tensors its base does not hold already
    if (not set(metas) <= set(seen)) if delta else set(seen) != set(metas):
        _fail("tensors", f"{'a subset of' if delta else 'exactly'} the {len(set(seen))} tensors the patches reference",
              sorted(set(metas) - set(seen) if delta else set(metas) ^ set(seen))[:8])
    for name, m in metas.items():
        where = f"tensors[{name!r}]"
        _keys(m, {"dtype", "shape", "sha256"}, where)
        if m["dtype"] not in DTYPES:
            _fail(where + ".dtype", f"one of {list(DTYPES)}", m["dtype"])
        if not isinstance(m["shape"], list):
            _fail(where + ".shape", "a list of non-negative integers", m["shape"])
        for d in m["shape"]:
            _count(d, where + ".shape")
        if not is_digest(m["sha256"]):
            _fail(where + ".sha256", "64 lowercase hex digits", m["sha256"])
        if name != tensor_name(m):
            _fail(f"{where} (referenced at {seen[name]})", f"the canonical tensor name {tensor_name(m)!r} of its content", name)


def validate_manifest(manifest, envelope, adapter_names) -> str:
    """Raise SnapshotFormatError unless manifest + envelope follow this schema; returns the kind."""
    if not isinstance(manifest, dict):
        _fail("", "a JSON object", type(manifest).__name__)
    if manifest.get("schema") != SCHEMA_VERSION or type(manifest.get("schema")) is not int:
        raise SnapshotFormatError(f"manifest schema version is {manifest.get('schema')!r}, this ComfyUI reads "
                                  f"version {SCHEMA_VERSION}; run the same ComfyUI version on every rank")
    kind = manifest.get("kind")
    if kind not in _TOP:
        _fail("kind", f"one of {sorted(_TOP)}", kind)
    _keys(manifest, _TOP[kind], "")
    if set(envelope) != _ENVELOPE[kind]:
        raise SnapshotFormatError(f"envelope of a {kind}: expected the fields {sorted(_ENVELOPE[kind])}, found {sorted(envelope)}")
    _count(envelope["lineage"], "envelope.lineage")
    if type(manifest["force_cast_weights"]) is not bool:
        _fail("force_cast_weights", "a bool", manifest["force_cast_weights"])
    ops = manifest["object_patches"]
    if not isinstance(ops, dict) or set(ops) - {"manual_cast_dtype"} or ops.get("manual_cast_dtype") not in (None, *DTYPES):
        _fail("object_patches", "{} or {\"manual_cast_dtype\": null or a dtype name}", ops)
    seen = {}  # name -> where it is first referenced
    _patches(manifest["patches"], adapter_names, seen)
    _tensors(manifest["tensors"], seen, kind == "delta")
    if kind == "delta":
        _count(envelope["base_lineage"], "envelope.base_lineage")
        for f in ("base_digest", "target_digest"):
            if not is_digest(manifest[f]):
                _fail(f, "64 lowercase hex digits", manifest[f])
        removed = manifest["removed"]
        if not isinstance(removed, list) or any(not isinstance(k, str) for k in removed) or removed != sorted(set(removed)):
            _fail("removed", "a sorted list of distinct keys", removed)
        if set(removed) & set(manifest["patches"]):
            _fail("removed", "keys disjoint from the changed patches", sorted(set(removed) & set(manifest["patches"])))
    return kind
