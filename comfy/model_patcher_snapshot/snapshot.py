"""PatchSnapshot (capture, encode, diff, to_patcher) and SnapshotDelta, and the manifest they share.

Capture reads only what a patcher exposes: ``patches``, ``patches_uuid``, ``object_patches``,
``force_cast_weights``, ``model_state_dict()`` keys, and (to refuse them) ``hook_patches``,
``weight_wrapper_patches`` and ``injections``. Supported patch values: ComfyUI weight adapters
(LoRA, LoHa, LoKr, GLoRA, OFT, BOFT: carried as their ``name`` + ``weights`` tuple and rebuilt as the
same class on the worker), ``("diff", (t,))`` with optional ``pad_weight``, ``("set", (t,))``, the
bare ``(t,)`` diff form, offsets, both strengths and chains of entries per key. Object patches on
the diffusion model and everything else that cannot be replicated raise ``UnsupportedPatchState``.

Manifest (canonical JSON, see ``codec``)::

    {"schema": 2, "kind": "snapshot", "force_cast_weights": bool,
     "object_patches": {"manual_cast_dtype": null | "bfloat16" | ...},   (only when patched)
     "patches": {key: [{"strength": num, "strength_model": num, "offset": null | [dim, start, length],
                        "value": {"type": "adapter", "adapter": "lora", "weights": [slot, ...]}
                               | {"type": "diff", "tensor": name, "pad_weight": bool}
                               | {"type": "set", "tensor": name}}, ...]},
     "tensors": {name: {"dtype": str, "shape": [int], "sha256": hex}}}

    slot: null | {"tensor": name} | {"float": x} | {"int": n} | {"ints": [n, ...]}
    name: sha256 of the tensor's canonical {"dtype", "shape", "sha256"} (``codec.tensor_name``)

A delta has kind "delta", ``base_digest``, ``target_digest``, ``removed`` (sorted keys) and carries
only changed keys, and of their tensors only those whose content its base lacks: names follow content,
so a strength change, a removed or reordered entry sends no tensor bytes. ``digest`` =
sha256(canonical manifest); ``version`` = (lineage, digest).
"""

import math
import sys

import torch

from . import codec
from .acks import SnapshotApplyError
from .codec import SnapshotFormatError
from .validate import validate_manifest

ADAPTER_NAMES = ("lora", "loha", "lokr", "glora", "oft", "boft")
_DIT_PREFIX = "diffusion_model"


class UnsupportedPatchState(ValueError):
    """Patch state a worker cannot replicate. ``problems``: sorted (key, reason) pairs, every one found."""

    def __init__(self, problems):
        self.problems = sorted(problems)
        lines = "\n  ".join(f"{k}: {why}" for k, why in self.problems)
        super().__init__(f"{len(self.problems)} patch state(s) cannot be replicated on parallel workers; remove "
                         f"them (or run without the parallel group):\n  {lines}")

    @property
    def keys(self):
        return sorted({k for k, _ in self.problems})


def _number(x):
    return type(x) in (int, float) and math.isfinite(x)


def _registered_adapters():
    """ComfyUI's adapter classes by name once its weight_adapter module is loaded in this process, else None.

    Real adapters imply that module is loaded; without it (tools, tests) objects exposing ``name``
    and ``weights`` are taken at their word.
    """
    module = sys.modules.get("comfy.weight_adapter")
    return {c.name: c for c in module.adapters} if module is not None else None


def _adapter_class_problem(v):
    registry = _registered_adapters()
    if registry is None:
        return None
    # a subclass may override calculate_weight; the worker would rebuild the base class and diverge
    cls = registry.get(v.name)
    if cls is None or type(v) is not cls:
        return f"adapter object of type {type(v).__name__} (name {v.name!r}) is not ComfyUI's registered adapter class"
    return None


def _carried_tensors(v):
    """The tensors ``_capture_value`` carries from one patch value, when it carries ``v`` at all."""
    if hasattr(v, "weights") and isinstance(getattr(v, "name", None), str):
        return [w for w in v.weights if isinstance(w, torch.Tensor)] if isinstance(v.weights, (tuple, list)) else []
    if isinstance(v, tuple) and len(v) == 1:
        return [v[0]]
    if isinstance(v, tuple) and len(v) == 2 and isinstance(v[1], tuple) and v[1]:
        return [v[1][0]]
    return []


def _hash_tensors(patches):
    """{id(t): tensor_meta(t)} of every plain tensor the patches carry, hashed on a few threads up front."""
    found = {id(t): t for entries in patches.values() for p in entries if isinstance(p, tuple) and len(p) == 5
             for t in _carried_tensors(p[1]) if type(t) in (torch.Tensor, torch.nn.Parameter) and t.dtype in codec.DTYPE_NAMES}
    return dict(zip(found, codec.parallel_map(codec.tensor_meta, found.values())))


def _capture_tensor(t, tensors, metas, hashed):
    """-> (name, None) or (None, reason)."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        return None, f"tensor of type {type(t).__name__}; only plain tensors can be carried"
    try:
        meta = hashed[id(t)] if id(t) in hashed else codec.tensor_meta(t)
    except ValueError as e:
        return None, f"tensor with {e}"
    name = codec.tensor_name(meta)
    metas[name] = meta
    tensors.setdefault(name, t.detach())
    return name, None


def _capture_value(v, tensors, metas, hashed):
    """One patch value -> (manifest value, None) or (None, reason)."""
    if hasattr(v, "weights") and isinstance(getattr(v, "name", None), str):
        if v.name not in ADAPTER_NAMES:
            return None, f"adapter {v.name!r} is not one this schema carries {ADAPTER_NAMES}"
        why = _adapter_class_problem(v)
        if why:
            return None, why
        slots = []
        for j, w in enumerate(v.weights):
            if w is None:
                slots.append(None)
            elif isinstance(w, torch.Tensor):
                name, why = _capture_tensor(w, tensors, metas, hashed)
                if why:
                    return None, f"adapter {v.name} slot {j}: {why}"
                slots.append({"tensor": name})
            elif _number(w):
                slots.append({"float" if type(w) is float else "int": w})
            elif isinstance(w, (list, tuple)) and all(type(n) is int for n in w):
                slots.append({"ints": list(w)})
            else:
                return None, f"adapter {v.name} slot {j} holds {type(w).__name__} {w!r}"
        return {"type": "adapter", "adapter": v.name, "weights": slots}, None
    if isinstance(v, list):
        return None, "nested patch list (a merged model's weights with its conversion function)"
    if not isinstance(v, tuple) or len(v) not in (1, 2):
        return None, f"patch value of type {type(v).__name__} is not an adapter, (tensor,) or (kind, args) tuple"
    kind, args = ("diff", v) if len(v) == 1 else v
    if not isinstance(kind, str):
        return None, f"patch value is a pair whose first item is {type(kind).__name__}, expected a patch type name"
    if kind not in ("diff", "set"):
        why = "needs the original weights, which only hook patches provide" if kind == "model_as_lora" else "is not a weight patch ComfyUI merges"
        return None, f"patch type {kind!r} {why}"
    if not isinstance(args, tuple) or not args:
        return None, f"{kind} patch arguments are {type(args).__name__}, expected (tensor, ...)"
    name, why = _capture_tensor(args[0], tensors, metas, hashed)
    if why:
        return None, f"{kind} {why}"
    if kind == "set":
        return {"type": "set", "tensor": name}, None
    pad = False
    if len(args) > 1:
        if not isinstance(args[1], dict) or type(args[1].get("pad_weight")) is not bool:
            return None, f"diff options {args[1]!r} lack a bool 'pad_weight'"
        pad = args[1]["pad_weight"]
    return {"type": "diff", "tensor": name, "pad_weight": pad}, None


def _resizing_set_problem(t, weight):
    """Why a "set" of another shape than the weight's (a PDD LoRA's head bank) cannot be replicated, or None.
    Only newer ComfyUIs resize a weight with a "set": comfy.lora.calculate_weight is asked, on a 1x1 weight."""
    import comfy.lora
    if tuple(t.shape) == tuple(weight.shape):
        return None
    try:
        if comfy.lora.calculate_weight([(1.0, ("set", (torch.ones(2, 1),)), 1.0, None, None)], torch.zeros(1, 1), "").shape == (2, 1):
            return None
    except RuntimeError:
        pass
    return (f"set of shape {list(t.shape)} on a weight of shape {list(weight.shape)}: this ComfyUI's comfy.lora.calculate_weight "
            "cannot change a weight's shape (a PDD LoRA's head bank needs a newer ComfyUI)")


def _capture_patches(patcher, problems):
    weights = patcher.model_state_dict()
    model_keys = set(weights.keys())
    patches, tensors, metas, hashed = {}, {}, {}, _hash_tensors(patcher.patches)
    for key in sorted(patcher.patches):
        if key not in model_keys:
            problems.append((key, "the model has no such weight"))
            continue
        entries = []
        for i, p in enumerate(patcher.patches[key]):
            if not isinstance(p, tuple) or len(p) != 5:
                problems.append((key, f"entry {i}: {type(p).__name__} is not ModelPatcher's "
                                      "(strength, value, strength_model, offset, function) tuple"))
                continue
            strength, v, strength_model, offset, function = p
            why = None
            if function is not None:
                why = f"has a custom function {getattr(function, '__name__', type(function).__name__)}"
            elif not (_number(strength) and _number(strength_model)):
                why = f"strengths ({strength!r}, {strength_model!r}) are not finite Python numbers"
            elif offset is not None and not (isinstance(offset, (tuple, list)) and len(offset) == 3
                                             and all(type(n) is int and n >= 0 for n in offset)):
                why = f"offset {offset!r} is not (dim, start, length)"
            if why is None:
                value, why = _capture_value(v, tensors, metas, hashed)
            if why is None and offset is None and value["type"] == "set":
                # refused here, before anything is sent: a worker failing to apply it would break the group
                why = _resizing_set_problem(v[1][0], weights[key])
            if why is not None:
                problems.append((key, f"entry {i}: {why}"))
                continue
            entries.append({"strength": strength, "strength_model": strength_model,
                            "offset": list(offset) if offset is not None else None, "value": value})
        patches[key] = entries
    return patches, tensors, metas


def _capture_state(patcher, problems):
    for hook_patches in getattr(patcher, "hook_patches", {}).values():
        problems.extend((k, "weight hook patch (hooks change weights per step)") for k in hook_patches)
    for k in getattr(patcher, "weight_wrapper_patches", {}):
        problems.append((k, "weight wrapper function"))
    for name, injections in getattr(patcher, "injections", {}).items():
        if injections:
            problems.append((f"injections[{name}]", "patcher injection (e.g. bypass-mode LoRA) changes the forward"))
    object_patches = {}
    for name, obj in patcher.object_patches.items():
        if name == "manual_cast_dtype":
            if obj is not None and obj not in codec.DTYPE_NAMES:
                problems.append((name, f"compute dtype {obj!r} is not one of {list(codec.DTYPES)}"))
            else:
                object_patches[name] = codec.DTYPE_NAMES[obj] if obj is not None else None
        elif name == _DIT_PREFIX or name.startswith(_DIT_PREFIX + "."):
            problems.append((name, f"object patch replaces {type(obj).__name__} inside the diffusion model"))
        # other object patches (model_sampling, latent_format, ...) act outside the diffusion model, on rank 0
    return object_patches


class PatchSnapshot:
    """Patch state; treat as immutable. Build with ``capture``, ``empty`` or ``decode``, never by hand."""

    kind = "snapshot"

    def __init__(self, patches, tensors, metas, object_patches, force_cast_weights, lineage, source=None):
        self.patches = patches
        self.tensors = tensors
        self.tensor_metas = metas
        self.object_patches = object_patches
        self.force_cast_weights = force_cast_weights
        self.lineage = lineage
        self.source = source
        self.manifest_bytes = codec.canonical_json(self._manifest())
        self.digest = codec.sha256_hex(self.manifest_bytes)
        self.key_digests = {k: codec.sha256_hex(codec.canonical_json(
            [entries, {n: metas[n] for e in entries for n in _names(e)}])) for k, entries in patches.items()}

    def _manifest(self):
        return {"schema": codec.SCHEMA_VERSION, "kind": "snapshot", "force_cast_weights": self.force_cast_weights,
                "object_patches": self.object_patches, "patches": self.patches, "tensors": self.tensor_metas}

    @classmethod
    def empty(cls, lineage: int = 0) -> "PatchSnapshot":
        """The base model: no patches, no object patches."""
        return cls({}, {}, {}, {}, False, lineage)

    @classmethod
    def capture(cls, patcher, previous: "PatchSnapshot" = None) -> "PatchSnapshot":
        """Snapshot ``patcher``; lineage is ``previous``'s, plus one when the content changed.

        Patch tensors are held by reference, not copied: a tensor changed in place after capture
        no longer matches its recorded sha256, and decoding on the worker refuses it.
        """
        problems = []
        uuid = str(patcher.patches_uuid)
        if previous is not None and previous.source == uuid:
            # ComfyUI itself re-patches weights only when patches_uuid changes, so the entries are current
            patches, tensors, metas = previous.patches, previous.tensors, previous.tensor_metas
        else:
            patches, tensors, metas = _capture_patches(patcher, problems)
        object_patches = _capture_state(patcher, problems)
        if problems:
            raise UnsupportedPatchState(problems)
        lineage = previous.lineage if previous is not None else 0
        snap = cls(patches, tensors, metas, object_patches, bool(patcher.force_cast_weights), lineage, uuid)
        if previous is None or snap.digest != previous.digest:
            snap.lineage = lineage + 1
        return snap

    @property
    def version(self):
        return (self.lineage, self.digest)

    @property
    def key_count(self) -> int:
        return len(self.patches)

    def keys(self):
        return sorted(self.patches)

    def entries(self, key):
        return self.patches[key]

    def encode(self) -> bytes:
        payload = codec.write_payload(self.tensors, self.tensor_metas)
        return codec.pack({"digest": self.digest, "lineage": self.lineage}, self.manifest_bytes, payload)

    def to_patcher(self, base):
        """A clone of ``base`` (an unpatched ModelPatcher of the same model) holding this patch state,
        set through ComfyUI's own API (``add_patches``, ``set_model_compute_dtype``); ComfyUI merges it
        when the clone is loaded."""
        import comfy.weight_adapter
        adapters = {cls.name: cls for cls in comfy.weight_adapter.adapters}
        p = base.clone()
        # one add_patches call per (entry index, strengths): a LoRA loader's single call stays one
        calls = {}
        for key in self.keys():
            for i, e in enumerate(self.patches[key]):
                v = e["value"]
                if v["type"] == "adapter":
                    value = adapters[v["adapter"]](set(), tuple(_slot(s, self.tensors) for s in v["weights"]))
                elif v["type"] == "diff":
                    t = self.tensors[v["tensor"]]
                    value = ("diff", (t, {"pad_weight": True}) if v["pad_weight"] else (t,))
                else:
                    value = ("set", (self.tensors[v["tensor"]],))
                k = (key, tuple(e["offset"])) if e["offset"] is not None else key
                calls.setdefault((i, e["strength"], e["strength_model"]), {})[k] = value
        for (_, strength, strength_model), patches in sorted(calls.items(), key=lambda c: c[0][0]):
            p.add_patches(patches, strength, strength_model)
        if "manual_cast_dtype" in self.object_patches:
            name = self.object_patches["manual_cast_dtype"]
            p.set_model_compute_dtype(codec.DTYPES[name][0] if name is not None else None)
        p.force_cast_weights = self.force_cast_weights
        return p

    def load(self, base):
        """``to_patcher(base)`` loaded by ComfyUI's load_models_gpu, patch backups on the device when it has
        room (``load``) -> that clone."""
        from . import load
        return load.load(self, base)

    @staticmethod
    def decode(data, max_bytes=None) -> "PatchSnapshot":
        update = decode(data, max_bytes)
        if update.kind != "snapshot":
            raise SnapshotFormatError(f"expected a full snapshot, got a {update.kind}; use decode() for either")
        return update

    def diff(self, previous: "PatchSnapshot") -> "SnapshotDelta":
        """The delta that turns ``previous`` into this snapshot: changed keys only, and of their tensors
        only those whose content ``previous`` does not hold (a strength change, a removed or reordered
        entry sends numbers, not tensors)."""
        changed = sorted(k for k in self.patches if previous.key_digests.get(k) != self.key_digests[k])
        removed = sorted(set(previous.patches) - set(self.patches))
        names = sorted({n for k in changed for e in self.patches[k] for n in _names(e)} - set(previous.tensor_metas))
        return SnapshotDelta({k: self.patches[k] for k in changed}, {n: self.tensors[n] for n in names},
                             {n: self.tensor_metas[n] for n in names}, removed, self.object_patches,
                             self.force_cast_weights, previous.version, self.version)

    def describe(self) -> dict:
        kinds = {}
        for entries in self.patches.values():
            for e in entries:
                v = e["value"]
                kind = v["adapter"] if v["type"] == "adapter" else v["type"]
                kinds[kind] = kinds.get(kind, 0) + 1
        return {"kind": "snapshot", "lineage": self.lineage, "digest": self.digest[:16], "keys": self.key_count,
                "entries": kinds, "tensors": len(self.tensor_metas), "tensor_bytes": _bytes(self.tensor_metas),
                "object_patches": self.object_patches, "force_cast_weights": self.force_cast_weights}


class SnapshotDelta:
    """The changed keys between two snapshots; ``apply_to(base)`` rebuilds (and verifies) the target."""

    kind = "delta"

    def __init__(self, patches, tensors, metas, removed, object_patches, force_cast_weights, base_version, version):
        self.patches, self.tensors, self.tensor_metas, self.removed = patches, tensors, metas, removed
        self.object_patches, self.force_cast_weights = object_patches, force_cast_weights
        (self.base_lineage, self.base_digest), (self.lineage, self.target_digest) = base_version, version
        self.manifest_bytes = codec.canonical_json({
            "schema": codec.SCHEMA_VERSION, "kind": "delta", "base_digest": self.base_digest,
            "target_digest": self.target_digest, "force_cast_weights": force_cast_weights,
            "object_patches": object_patches, "patches": patches, "removed": removed, "tensors": metas})
        self.digest = codec.sha256_hex(self.manifest_bytes)

    @property
    def version(self):
        """The version the delta produces."""
        return (self.lineage, self.target_digest)

    @property
    def base_version(self):
        return (self.base_lineage, self.base_digest)

    def apply_to(self, base: PatchSnapshot) -> PatchSnapshot:
        if base is None or base.digest != self.base_digest:
            have = f"{base.lineage}/{base.digest[:12]}" if base is not None else "nothing applied"
            raise SnapshotApplyError(f"delta updates version {self.base_lineage}/{self.base_digest[:12]}, this side "
                                     f"holds {have}; send the full snapshot instead")
        stale = set(self.removed) | set(self.patches)
        patches = {k: e for k, e in base.patches.items() if k not in stale}
        patches.update(self.patches)
        keep = {n for k in patches for e in patches[k] for n in _names(e)}
        missing = sorted({k for k in patches for e in patches[k] for n in _names(e) if n not in self.tensors and n not in base.tensors})
        if missing:
            raise SnapshotApplyError(f"delta references tensors that neither it nor version {base.lineage}/{base.digest[:12]} "
                                     f"holds (patches of {missing[:4]}); send the full snapshot instead")
        tensors = {n: self.tensors[n] if n in self.tensors else base.tensors[n] for n in keep}
        metas = {n: self.tensor_metas[n] if n in self.tensor_metas else base.tensor_metas[n] for n in keep}
        out = PatchSnapshot(dict(sorted(patches.items())), tensors, metas, self.object_patches,
                            self.force_cast_weights, self.lineage)
        if out.digest != self.target_digest:
            raise SnapshotApplyError(f"delta applied to {base.digest[:12]} gives digest {out.digest[:12]}, the delta "
                                     f"promises {self.target_digest[:12]}; send the full snapshot instead")
        return out

    def encode(self) -> bytes:
        payload = codec.write_payload(self.tensors, self.tensor_metas)
        envelope = {"base_lineage": self.base_lineage, "digest": self.digest, "lineage": self.lineage}
        return codec.pack(envelope, self.manifest_bytes, payload)

    def describe(self) -> dict:
        return {"kind": "delta", "base": [self.base_lineage, self.base_digest[:16]],
                "target": [self.lineage, self.target_digest[:16]], "changed": len(self.patches),
                "removed": len(self.removed), "tensor_bytes": _bytes(self.tensor_metas)}


def _slot(slot, tensors):
    if slot is None:
        return None
    kind, value = next(iter(slot.items()))
    if kind == "tensor":
        return tensors[value]
    return list(value) if kind == "ints" else value


def _names(entry):
    v = entry["value"]
    if v["type"] != "adapter":
        return [v["tensor"]]
    return [s["tensor"] for s in v["weights"] if s is not None and "tensor" in s]


def _bytes(metas):
    return sum(codec.DTYPES[m["dtype"]][0].itemsize * math.prod(m["shape"]) for m in metas.values())


def decode(data, max_bytes=None):
    """Bytes from ``encode()`` -> ``PatchSnapshot`` or ``SnapshotDelta``; anything else raises SnapshotFormatError."""
    envelope, manifest_raw, payload = codec.unpack(data, max_bytes)
    manifest = codec.parse_canonical_json(manifest_raw, "manifest")
    kind = validate_manifest(manifest, envelope, ADAPTER_NAMES)
    tensors = codec.read_payload(payload, manifest["tensors"])
    flags = (manifest["object_patches"], manifest["force_cast_weights"])
    if kind == "snapshot":
        snap = PatchSnapshot(manifest["patches"], tensors, manifest["tensors"], *flags, envelope["lineage"])
    else:
        snap = SnapshotDelta(manifest["patches"], tensors, manifest["tensors"], manifest["removed"], *flags,
                             (envelope["base_lineage"], manifest["base_digest"]),
                             (envelope["lineage"], manifest["target_digest"]))
    if snap.manifest_bytes != manifest_raw:
        raise SnapshotFormatError("manifest does not re-encode to the same bytes; it was not written by encode()")
    return snap
