"""A worker's side of a PatchSnapshot: ComfyUI's own load_models_gpu of ``snapshot.to_patcher(base)``,
with the patched weights' backups kept on the load device when its measured free memory allows.

Called by the sequence-parallel workers (``comfy/ldm/minimax_h3/sequence_parallel.py``) for every
snapshot or delta rank 0 sends.
"""

import logging

import comfy.model_management
import comfy.model_patcher

# the forward's activations are unknown when patches change: this share of the device stays free for them
ACTIVATION_HEADROOM = 0.1


def load(snapshot, base):
    """Merge ``snapshot`` into ``base``'s model (``base``: its unpatched ModelPatcher) -> the loaded clone.

    ComfyUI backs each patched weight up to the patcher's offload device before merging and restores
    it before the next merge. With the offload device on the host, every LoRA change copies the
    patched weights out and the whole model back in, and each worker holds a private host copy of
    them. Backed up on the device, a backup is the original weight itself (no copy): a change
    restores references and merges on the device. That is the arithmetic and the state ComfyUI's
    --highvram mode gives; here it is chosen per load from measured free memory.
    """
    patcher = snapshot.to_patcher(base)
    device = backup_device(patcher)
    if device is not None:
        patcher.offload_device = device
    comfy.model_management.load_models_gpu([patcher])
    return patcher


def backup_device(patcher):
    """``patcher.load_device`` when the model's weights, the backups of its patched weights and the
    headroom fit in the device's memory; None (keep ComfyUI's offload device) otherwise, or when there
    is nothing to choose: DynamicVRAM patches at forward time and keeps no backups."""
    load, offload = patcher.load_device, patcher.offload_device
    if patcher.is_dynamic() or load == offload or comfy.model_management.is_device_cpu(load):
        return None
    weights = comfy.model_management.module_size(patcher.model)
    backups = sum(_nbytes(comfy.model_patcher.get_key_weight(patcher.model, key)[0]) for key in patcher.patches)
    # what this model holds on the device now (weights, merged copies, earlier backups) is freed for the new state
    available = comfy.model_management.get_free_memory(load) + _bytes_on(patcher, load)
    reserve = (comfy.model_management.minimum_inference_memory()
               + ACTIVATION_HEADROOM * comfy.model_management.get_total_memory(load))
    if available - weights - backups >= reserve:
        return load
    gib = 1024 ** 3
    logging.info("patch backups stay on %s: %s holds %.1f GiB of weights + %.1f GiB of backups + %.1f GiB reserve "
                 "> %.1f GiB available", offload, load, weights / gib, backups / gib, reserve / gib, available / gib)
    return None


def _nbytes(t):
    return t.nelement() * t.element_size()


def _bytes_on(patcher, device):
    tensors = {id(t): t for t in patcher.model.state_dict(keep_vars=True).values()}
    tensors.update((id(b.weight), b.weight) for b in patcher.backup.values())
    return sum(_nbytes(t) for t in tensors.values() if _on(t, device))


def _on(t, device):
    # ComfyUI names devices with and without an index ("cuda" vs "cuda:0")
    return t.device.type == device.type and (device.index is None or t.device.index in (None, device.index))
