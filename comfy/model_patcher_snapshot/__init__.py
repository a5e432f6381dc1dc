"""The patch state of a downstream ModelPatcher, for worker processes that built the same base model:
captured on rank 0, sent as canonical JSON + safetensors (no pickle), rebuilt through ComfyUI's own
patch path and acknowledged before any step. ``snapshot`` holds the manifest format.

    snap = PatchSnapshot.capture(patcher, previous=last)     # rank 0; snap.diff(last).encode() sends only changes
    update = decode(blob)                                    # worker
    snap = update if update.kind == "snapshot" else update.apply_to(held)
    comfy.model_management.load_models_gpu([snap.to_patcher(base)])
    require_acks(snap, acks, world_size)                     # rank 0, before denoising
"""

from .acks import SnapshotAck, SnapshotApplyError, SnapshotNotAcked, require_acks
from .codec import SnapshotFormatError
from .snapshot import PatchSnapshot, SnapshotDelta, UnsupportedPatchState, decode

__all__ = [
    "PatchSnapshot",
    "SnapshotAck",
    "SnapshotApplyError",
    "SnapshotDelta",
    "SnapshotFormatError",
    "SnapshotNotAcked",
    "UnsupportedPatchState",
    "decode",
    "require_acks",
]
