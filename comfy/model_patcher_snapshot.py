"""Patch snapshots: the static weight patches of a ModelPatcher, rebuilt in another process that holds the same base model.

    snap = PatchSnapshot.capture(patcher, previous=synced)      # rank 0
    update = snap if synced is None else snap.diff(synced)      # a strength change carries no tensor
    send(update.manifest, update.tensors)                       # JSON + {name: tensor}
    update = read(manifest, tensors)                            # a worker
    snap = update.apply_to(held)
    patcher = snap.to_patcher(base, digest)                     # checked before anything is written
    comfy.model_management.load_models_gpu([patcher])           # ComfyUI's own merge and backup policy

Manifest::

    {"kind": "snapshot", "lineage": int, "compute_dtype": null | "bfloat16" | ..., "force_cast_weights": bool,
     "patches": {key: [[strength_patch, value, strength_model, offset], ...]}}
    value:  {"diff": name} | {"diff": name, "pad_weight": true} | {"set": name} | {adapter name: [slot, ...]}
    slot:   null | {"tensor": name} | number | [int, ...]
    offset: null | [dim, start, length]

A delta has "kind": "delta", "base": [lineage, digest] of the snapshot it updates, "digest" of the one it makes, "removed" keys
and, in "patches", only the keys that changed. A tensor's name is the sha256 of its dtype, shape and bytes, so equal content has
one name and a delta carries only the tensors its base lacks. The digest is the sha256 of a snapshot's content (all but the
lineage); its version is (lineage, digest). Only diffusion model patches are captured: the workers run the diffusion model.
"""

import concurrent.futures
import hashlib
import json
import math

import torch

import comfy.weight_adapter

PREFIX = "diffusion_model."
ADAPTERS = {cls.name: cls for cls in comfy.weight_adapter.adapters}
DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16,
                                                                  torch.float8_e4m3fn, torch.float8_e5m2)}


class UnsupportedPatchState(ValueError):
    """Patch state rank 0 holds that a worker cannot rebuild. ``problems``: (key, reason) pairs."""

    def __init__(self, problems):
        self.problems = problems
        shown = "; ".join(f"{key}: {why}" for key, why in problems[:4])
        more = f" (and {len(problems) - 4} more)" if len(problems) > 4 else ""
        super().__init__(f"{len(problems)} patch(es) cannot be sent to the parallel workers: {shown}{more}. "
                         "Remove them or run without the parallel group.")


class SnapshotRefused(ValueError):
    """A worker refused a received snapshot before writing anything; it still holds its previous one."""


class SnapshotNotAcked(RuntimeError):
    """Some rank does not hold the snapshot rank 0 samples with."""


def tensor_name(t):
    """sha256 of a tensor's dtype, shape and bytes (copied to the CPU first when it lives elsewhere)."""
    t = t.detach().to("cpu").contiguous()
    h = hashlib.sha256(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def _tensor_names(tensors):
    """[tensor_name(t) for t in tensors], on a few threads: hashlib releases the GIL on large buffers."""
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        return list(pool.map(tensor_name, tensors))


def _digest(obj):
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()).hexdigest()


def _number(x):
    return type(x) in (int, float) and math.isfinite(x)


def _tensors_in(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            yield from _tensors_in(x)
    elif isinstance(obj, comfy.weight_adapter.WeightAdapterBase):
        yield from _tensors_in(obj.weights)


def _names(entries):
    """The tensor names the manifest entries of one key refer to."""
    for _, value, _, _ in entries:
        for kind, x in value.items():
            if kind in ("diff", "set"):
                yield x
            elif kind in ADAPTERS:
                yield from (slot["tensor"] for slot in x if isinstance(slot, dict))


class _Refused(Exception):
    pass


def _encode_value(v, name_of):
    """One patch value as add_patches stored it -> its manifest form; raises _Refused with the reason."""
    if type(v) in ADAPTERS.values():
        return {v.name: [_encode_slot(v.name, w, name_of) for w in v.weights]}
    if isinstance(v, comfy.weight_adapter.WeightAdapterBase):
        raise _Refused(f"adapter class {type(v).__name__} is not one of ComfyUI's")
    if isinstance(v, list):
        raise _Refused("a merged model's weights (they carry a conversion function)")
    kind, args = ("diff", v) if len(v) == 1 else v
    if kind not in ("diff", "set"):
        raise _Refused(f"patch type {kind!r} is not a static weight patch")
    out = {kind: name_of(args[0])}
    if kind == "diff" and len(args) > 1 and args[1]["pad_weight"]:
        out["pad_weight"] = True
    return out


def _encode_slot(adapter, w, name_of):
    if w is None or _number(w):
        return w
    if isinstance(w, torch.Tensor):
        return {"tensor": name_of(w)}
    if isinstance(w, (list, tuple)) and all(type(n) is int for n in w):
        return list(w)
    raise _Refused(f"{adapter} adapter holds a {type(w).__name__}")


def _misfits(patches, tensors, weights):
    """(key, reason) for every key that is not a weight of the model whose state dict is ``weights``, every offset outside its
    weight, every missing tensor and every diff or set whose shape does not fit its weight."""
    out = []
    for key, entries in patches.items():
        if key not in weights:
            out.append((key, "not a weight of this model"))
            continue
        for _, value, _, offset in entries:
            shape = list(weights[key].shape)
            if offset is not None:
                dim, start, length = offset
                if dim >= len(shape) or start + length > shape[dim]:
                    out.append((key, f"offset {offset} lies outside the weight's shape {shape}"))
                    continue
                shape[dim] = length
            missing = [n for n in _names([(None, value, None, None)]) if n not in tensors]
            if missing:
                out.append((key, f"tensor {missing[0][:12]} was not sent"))
                continue
            kind = "set" if "set" in value else "diff" if "diff" in value else None
            if kind is None:
                continue
            got = list(tensors[value[kind]].shape)
            fits = (len(got) == len(shape) and all(g >= s for g, s in zip(got, shape))) if value.get("pad_weight") else got == shape
            if not fits:
                out.append((key, f"{kind} of shape {got} on a weight of shape {shape}"))
    return out


def _dtype_name(dtype):
    return None if dtype is None else str(dtype).removeprefix("torch.")


class PatchSnapshot:
    """The replicable patch state of a ModelPatcher; treat it as immutable. Build it with ``capture``, ``empty`` or ``read``."""

    kind = "snapshot"

    def __init__(self, patches, tensors, compute_dtype, force_cast_weights, lineage):
        self.patches = patches  # {key: [[strength_patch, value, strength_model, offset], ...]}, JSON
        self.tensors = tensors  # {name: tensor}, every tensor the patches name
        self.compute_dtype = compute_dtype
        self.force_cast_weights = force_cast_weights
        self.lineage = lineage
        self.digest = _digest({"compute_dtype": compute_dtype, "force_cast_weights": force_cast_weights, "patches": patches})

    @classmethod
    def empty(cls):
        """What a worker holds before its first sync: version 0, which no delta updates."""
        return cls({}, {}, None, False, 0)

    @classmethod
    def capture(cls, patcher, previous=None):
        """Snapshot ``patcher``'s diffusion model patches; the lineage is ``previous``'s, plus one when the content changed.

        Raises ValueError (from ``ModelPatcher.get_static_patches``) naming hooks, weight wrappers, injections and object patches
        inside the diffusion model, and UnsupportedPatchState naming every key whose patches cannot be sent. Tensors are held by
        reference and hashed once: a tensor ``previous`` holds is not hashed again (changed in place since, it fails the
        workers' ``read``).
        """
        static = patcher.get_static_patches(PREFIX)
        known = {id(t): name for name, t in previous.tensors.items()} if previous is not None else {}
        found = {id(t): t for entries in static.values() for p in entries for t in _tensors_in(p[1])
                 if id(t) not in known and type(t) in (torch.Tensor, torch.nn.Parameter)}
        known.update(zip(found, _tensor_names(found.values())))
        tensors = {}

        def name_of(t):
            if id(t) not in known:
                raise _Refused(f"a tensor of type {type(t).__name__}")
            tensors[known[id(t)]] = t
            return known[id(t)]

        patches, problems = {}, []
        for key in sorted(static):
            entries = []
            for strength_patch, value, strength_model, offset, function in static[key]:
                try:
                    if function is not None:
                        raise _Refused(f"a weight function ({getattr(function, '__name__', type(function).__name__)})")
                    if not (_number(strength_patch) and _number(strength_model)):
                        raise _Refused(f"strengths {strength_patch!r}, {strength_model!r} are not finite numbers")
                    entries.append([strength_patch, _encode_value(value, name_of), strength_model,
                                    list(offset) if offset is not None else None])
                except _Refused as e:
                    problems.append((key, str(e)))
            patches[key] = entries
        problems += _misfits(patches, tensors, patcher.model_state_dict(PREFIX))
        if problems:
            raise UnsupportedPatchState(problems)
        snap = cls(patches, tensors, _dtype_name(patcher.get_model_object("manual_cast_dtype")), patcher.force_cast_weights, 0)
        snap.lineage = 1 if previous is None else previous.lineage + (snap.digest != previous.digest)
        return snap

    @property
    def version(self):
        return (self.lineage, self.digest)

    @property
    def manifest(self):
        return {"kind": "snapshot", "lineage": self.lineage, "compute_dtype": self.compute_dtype,
                "force_cast_weights": self.force_cast_weights, "patches": self.patches}

    def apply_to(self, held):
        """A full snapshot replaces whatever a worker holds."""
        return self

    def diff(self, previous):
        """The delta that turns ``previous`` into this snapshot: the changed keys, and of their tensors only those ``previous``
        does not hold."""
        changed = {k: e for k, e in self.patches.items() if previous.patches.get(k) != e}
        names = sorted({n for entries in changed.values() for n in _names(entries)} - previous.tensors.keys())
        return SnapshotDelta(changed, sorted(previous.patches.keys() - self.patches.keys()), {n: self.tensors[n] for n in names},
                             self.compute_dtype, self.force_cast_weights, self.lineage, previous.version, self.digest)

    def to_patcher(self, base, digest):
        """A clone of ``base`` (the unpatched ModelPatcher of the base model) holding this snapshot through ComfyUI's
        ``add_patches`` and ``set_model_compute_dtype``: ComfyUI merges it when the clone is loaded.

        Raises SnapshotRefused, before anything is written, unless this is the snapshot of ``digest`` (the one rank 0 announced)
        and every patch fits a weight of ``base``'s model.
        """
        if self.digest != digest:
            raise SnapshotRefused(f"received patch state {self.digest[:12]}, rank 0 announced {digest[:12]}: it changed in transit "
                                  "or was built on another version")
        misfits = _misfits(self.patches, self.tensors, base.model_state_dict())
        if misfits:
            key, why = misfits[0]
            raise SnapshotRefused(f"patch of {key} refused: {why}" + (f" (and {len(misfits) - 1} more)" if len(misfits) > 1 else ""))
        p = base.clone()
        # one add_patches call per (entry index, strengths): a LoRA loader's single call stays one
        calls = {}
        for key, entries in self.patches.items():
            for i, (strength_patch, value, strength_model, offset) in enumerate(entries):
                k = (key, tuple(offset)) if offset is not None else key
                calls.setdefault((i, strength_patch, strength_model), {})[k] = self._value(value)
        for (_, strength_patch, strength_model), patches in sorted(calls.items(), key=lambda c: c[0][0]):
            p.add_patches(patches, strength_patch, strength_model)
        if self.force_cast_weights or self.compute_dtype != _dtype_name(base.get_model_object("manual_cast_dtype")):
            p.set_model_compute_dtype(DTYPES[self.compute_dtype] if self.compute_dtype is not None else None)
        return p

    def _value(self, value):
        if "set" in value:
            return ("set", (self.tensors[value["set"]],))
        if "diff" in value:
            t = self.tensors[value["diff"]]
            return ("diff", (t, {"pad_weight": True})) if value.get("pad_weight") else ("diff", (t,))
        (name, slots), = value.items()
        return ADAPTERS[name](set(), tuple(self.tensors[s["tensor"]] if isinstance(s, dict) else s for s in slots))

    def describe(self):
        return {"version": [self.lineage, self.digest[:12]], "keys": len(self.patches), "tensors": len(self.tensors),
                "tensor_bytes": sum(t.nbytes for t in self.tensors.values())}


class SnapshotDelta:
    """The keys that changed between two snapshots; ``apply_to(held)`` rebuilds the newer one on a worker."""

    kind = "delta"

    def __init__(self, patches, removed, tensors, compute_dtype, force_cast_weights, lineage, base_version, digest):
        self.patches, self.removed, self.tensors = patches, removed, tensors
        self.compute_dtype, self.force_cast_weights = compute_dtype, force_cast_weights
        self.lineage, self.digest = lineage, digest
        self.base_version = tuple(base_version)

    @property
    def version(self):
        """The version this delta makes."""
        return (self.lineage, self.digest)

    @property
    def manifest(self):
        return {"kind": "delta", "lineage": self.lineage, "digest": self.digest, "base": list(self.base_version),
                "compute_dtype": self.compute_dtype, "force_cast_weights": self.force_cast_weights,
                "patches": self.patches, "removed": self.removed}

    def apply_to(self, held):
        """``held`` (the snapshot a worker holds) with this delta applied; raises SnapshotRefused when ``held`` is not the
        delta's base or the result is not the snapshot rank 0 diffed."""
        if held.version != self.base_version:
            raise SnapshotRefused(f"the patch delta updates version {self.base_version[0]}/{self.base_version[1][:12]}, this rank "
                                  f"holds {held.lineage}/{held.digest[:12]}; send the full snapshot")
        patches = {k: e for k, e in held.patches.items() if k not in self.removed and k not in self.patches}
        patches.update(self.patches)
        tensors = {n: self.tensors[n] if n in self.tensors else held.tensors.get(n)
                   for entries in patches.values() for n in _names(entries)}
        snap = PatchSnapshot(dict(sorted(patches.items())), {n: t for n, t in tensors.items() if t is not None},
                             self.compute_dtype, self.force_cast_weights, self.lineage)
        if snap.digest != self.digest:
            raise SnapshotRefused(f"the patch delta gives {snap.digest[:12]} on this rank, rank 0 diffed {self.digest[:12]}; "
                                  "send the full snapshot")
        return snap

    def describe(self):
        return {"version": [self.lineage, self.digest[:12]], "base": [self.base_version[0], self.base_version[1][:12]],
                "changed": len(self.patches), "removed": len(self.removed), "tensors": len(self.tensors),
                "tensor_bytes": sum(t.nbytes for t in self.tensors.values())}


def read(manifest, tensors):
    """A received manifest and its tensors -> PatchSnapshot or SnapshotDelta. Raises SnapshotRefused naming the key of any
    tensor whose content is not its name."""
    got = dict(zip(tensors, _tensor_names(tensors.values())))
    bad = sorted(n for n, name in got.items() if name != n)
    if bad:
        keys = [k for k, e in manifest["patches"].items() if bad[0] in set(_names(e))] or ["no patch"]
        raise SnapshotRefused(f"tensor {bad[0][:12]} of {keys[0]} does not match its content hash: it changed in transit")
    flags = (manifest["compute_dtype"], manifest["force_cast_weights"], manifest["lineage"])
    if manifest["kind"] == "snapshot":
        return PatchSnapshot(manifest["patches"], dict(tensors), *flags)
    return SnapshotDelta(manifest["patches"], manifest["removed"], dict(tensors), *flags, manifest["base"], manifest["digest"])
