"""Worker side of patch snapshots: apply a snapshot (or delta) to a model in place, restore, acknowledge.

``SnapshotApplier`` owns the base copies of the weights it touched, and only of those. Every apply
merges from the base copy (never from an already patched weight), writes the result into the
existing tensor with ``copy_`` so module references stay valid, and touches only keys whose patch
entries changed since the last apply. Applying the empty snapshot, or ``restore()``, puts the exact
base bytes back and drops the copies.

Only weights change here. A snapshot's ``object_patches`` (compute dtype) and ``force_cast_weights``
are part of its digest and are for the worker to honour where it configures the model.

No denoising may start before every rank acknowledged the version rank 0 holds: ``require_acks``
(rank 0 acks the snapshot it captured, e.g. ``SnapshotAck(0, snap.lineage, snap.digest, snap.key_count)``).
"""

import dataclasses
import logging
import weakref

import torch

from comfy.model_patcher_snapshot_codec import is_digest
from comfy.model_patcher_snapshot_merge import merged_weight, resolve_arithmetic, unsupported_reason


class SnapshotApplyError(RuntimeError):
    """A snapshot could not be applied. The message says which state the model was left in: its previous
    snapshot (refused before any write), its base weights (rolled back), or undefined (rebuild it)."""


class SnapshotNotAcked(RuntimeError):
    """Some rank has not acknowledged the current snapshot version."""


@dataclasses.dataclass(frozen=True)
class SnapshotAck:
    """What a rank reports after applying a snapshot. JSON-able through ``to_json`` / ``from_json``."""

    rank: int
    lineage: int
    digest: str
    key_count: int

    @property
    def version(self):
        return (self.lineage, self.digest)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, obj) -> "SnapshotAck":
        fields = ("digest", "key_count", "lineage", "rank")
        if not isinstance(obj, dict) or sorted(obj) != list(fields):
            raise ValueError(f"snapshot ack must be an object with exactly the fields {fields}, got {obj!r}")
        for f in ("rank", "lineage", "key_count"):
            if type(obj[f]) is not int or obj[f] < 0:
                raise ValueError(f"snapshot ack field {f!r} must be a non-negative int, got {obj[f]!r}")
        if not is_digest(obj["digest"]):
            raise ValueError(f"snapshot ack digest must be 64 lowercase hex digits, got {obj['digest']!r}")
        return cls(**obj)


def require_acks(snapshot, acks, world_size: int) -> None:
    """Raise ``SnapshotNotAcked`` unless ranks 0..world_size-1 each acked exactly ``snapshot``'s version."""
    by_rank = {}
    for ack in acks:
        by_rank.setdefault(ack.rank, []).append(ack)
    problems = []
    for rank in range(world_size):
        got = by_rank.get(rank, [])
        if not got:
            problems.append(f"rank {rank}: no ack")
            continue
        ack = got[-1]
        if ack.version != snapshot.version:
            problems.append(f"rank {rank}: acked version {ack.lineage}/{ack.digest[:12]}")
        elif ack.key_count != snapshot.key_count:
            problems.append(f"rank {rank}: acked {ack.key_count} patched keys, the snapshot has {snapshot.key_count}")
    extra = sorted(r for r in by_rank if not 0 <= r < world_size)
    if extra:
        problems.append(f"acks from ranks {extra} outside a world of {world_size}")
    if problems:
        raise SnapshotNotAcked(f"refusing to run: not every rank holds patch snapshot version "
                               f"{snapshot.lineage}/{snapshot.digest[:12]} ({'; '.join(problems)}); "
                               "send that snapshot to the listed ranks and wait for their acks")


class SnapshotApplier:
    """Applies snapshots to one model (an ``nn.Module`` or a mapping of name -> tensor) in place.

    ``key_prefix`` is stripped from snapshot keys to get model keys: a worker holding only the
    diffusion model passes ``"diffusion_model."``. Base copies live on ``backup_device`` (default
    CPU, like ComfyUI's offload device); ``None`` keeps them on each weight's own device.
    ``base_weights``: optional ``model_key -> tensor`` giving the base weight on demand (e.g. read
    from the memory-mapped checkpoint the model was built from); with it no copies are kept, which
    matters at H3 scale, where a LoRA on every block linear touches 40 GB of bfloat16 weights.
    ``arithmetic``: "auto" (ComfyUI when importable), "comfyui" or "builtin".
    """

    def __init__(self, model, key_prefix: str = "", backup_device="cpu", arithmetic: str = "auto", base_weights=None):
        self._model = lambda: model
        self.key_prefix = key_prefix
        self.backup_device = backup_device
        self.base_weights = base_weights
        self.arithmetic = resolve_arithmetic(arithmetic)
        self._backup = {}
        self._touched = set()
        self._applied = None
        self._broken = None

    @property
    def applied(self):
        """The snapshot the model currently reflects (None: base weights, nothing applied yet)."""
        return self._applied

    @property
    def backup_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._backup.values())

    def _resolve(self, key):
        if not key.startswith(self.key_prefix):
            return None, f"key is outside this model's prefix {self.key_prefix!r}"
        name = key[len(self.key_prefix):]
        model = self._model()
        if model is None:
            raise SnapshotApplyError("the model this applier was made for has been garbage collected")
        if not isinstance(model, torch.nn.Module):
            t = model.get(name)
            return (t, None) if isinstance(t, torch.Tensor) else (None, "key is not in the state dict")
        owner_name, _, attr = name.rpartition(".")
        try:
            owner = model.get_submodule(owner_name)
        except AttributeError:
            return None, "no such submodule"
        t = getattr(owner, attr, None)
        if not isinstance(t, torch.Tensor):
            return None, "no such parameter or buffer"
        if hasattr(owner, f"set_{attr}") or hasattr(owner, f"convert_{attr}"):
            return None, (f"{type(owner).__name__} stores {attr} through set_{attr}/convert_{attr} (quantized "
                          "weights); in-place apply supports plain float weights only")
        return t, None

    def apply(self, update) -> list:
        """Apply a ``PatchSnapshot`` or a ``SnapshotDelta`` on top of the applied one; returns the keys rewritten."""
        if self._broken:
            raise SnapshotApplyError(f"{self._broken}: this model's weights are undefined; rebuild it")
        target = update.apply_to(self._applied) if update.kind == "delta" else update
        old = self._applied.key_digests if self._applied is not None else {}
        new = target.key_digests
        changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        params, problems = {}, []
        for key in changed:
            param, why = self._resolve(key)
            if param is None:
                problems.append(f"{key}: {why}")
                continue
            params[key] = param
            if key in new:
                why = unsupported_reason(target.entries(key), param.dtype, self.arithmetic)
                if why:
                    problems.append(f"{key}: {why}")
        if problems:
            raise SnapshotApplyError(f"cannot apply patch snapshot {target.lineage}/{target.digest[:12]} "
                                     f"({self.arithmetic} arithmetic); nothing was changed:\n  " + "\n  ".join(problems))
        try:
            with torch.no_grad():
                for key in changed:
                    self._rewrite(key, params[key], target)
        except Exception as e:
            what = f"applying patch snapshot {target.lineage}/{target.digest[:12]} failed at a weight ({e})"
            try:
                self.restore()
            except Exception as again:
                self._broken = f"{what}, and restoring the base weights failed too ({again})"
                raise SnapshotApplyError(f"{self._broken}: this model's weights are undefined; rebuild it") from e
            raise SnapshotApplyError(f"{what}; the model was restored to its base weights") from e
        self._applied = target
        logging.debug("patch snapshot %s/%s applied: %d keys rewritten", target.lineage, target.digest[:12], len(changed))
        return changed

    def _base(self, key, param):
        if self.base_weights is None:
            return self._backup[key]
        base = self.base_weights(key[len(self.key_prefix):])
        if not isinstance(base, torch.Tensor) or base.shape != param.shape or base.dtype != param.dtype:
            found = f"{tuple(base.shape)} {base.dtype}" if isinstance(base, torch.Tensor) else type(base).__name__
            raise ValueError(f"{key}: base_weights gave {found}, the parameter is {tuple(param.shape)} {param.dtype}; "
                             "base_weights must return the weights the model was built from")
        return base

    def _rewrite(self, key, param, target):
        if key not in target.key_digests:
            param.copy_(self._base(key, param))
            self._backup.pop(key, None)
            self._touched.discard(key)
            return
        if self.base_weights is None and key not in self._backup:
            device = param.device if self.backup_device is None else self.backup_device
            self._backup[key] = param.detach().to(device=device, copy=True)
        base = self._base(key, param)
        self._touched.add(key)
        out = merged_weight(key, base, param.device, param.dtype, target.entries(key), target.tensors, self.arithmetic)
        if out.shape != param.shape:
            raise ValueError(f"{key}: the merged weight is {tuple(out.shape)}, the parameter {tuple(param.shape)}; "
                             "patches that resize a weight (pad_weight, reshape_weight) cannot be applied in place")
        param.copy_(out)

    def restore(self) -> list:
        """Put the base bytes back into every touched weight; returns the keys restored."""
        keys = sorted(self._touched)
        with torch.no_grad():
            for key in keys:
                param, _ = self._resolve(key)
                param.copy_(self._base(key, param))
                self._backup.pop(key, None)
                self._touched.discard(key)
        self._applied = None
        return keys

    def ack(self, rank: int) -> SnapshotAck:
        if self._applied is None:
            raise SnapshotApplyError(f"rank {rank} has no snapshot applied; apply one first "
                                     "(PatchSnapshot.empty() describes the base model)")
        return SnapshotAck(rank, self._applied.lineage, self._applied.digest, self._applied.key_count)


_APPLIERS = weakref.WeakKeyDictionary()


def apply(update, model: torch.nn.Module, key_prefix: str = "", backup_device="cpu", arithmetic: str = "auto") -> SnapshotApplier:
    """Apply a snapshot or delta to ``model`` in place; the applier (with its base copies) stays with the model."""
    applier = _APPLIERS.get(model)
    if applier is None or (applier.key_prefix, applier.backup_device) != (key_prefix, backup_device) \
            or applier.arithmetic != resolve_arithmetic(arithmetic):
        if applier is not None and applier.applied is not None:
            raise SnapshotApplyError("this model already has a snapshot applied with other settings "
                                     f"(key_prefix={applier.key_prefix!r}, arithmetic={applier.arithmetic!r}); "
                                     "restore(model) first")
        applier = _APPLIERS[model] = SnapshotApplier(model, key_prefix, backup_device, arithmetic)
        # the registry must not keep the model alive: its applier refers to it weakly
        applier._model = weakref.ref(model)
    applier.apply(update)
    return applier


def restore(model: torch.nn.Module) -> list:
    """Restore the base weights ``apply`` changed on ``model``; returns the keys restored."""
    applier = _APPLIERS.get(model)
    return applier.restore() if applier is not None else []
