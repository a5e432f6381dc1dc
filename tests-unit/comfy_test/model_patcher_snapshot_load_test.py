"""A worker's ``snapshot.load(base)`` against the pinned ComfyUI (COMFYUI_DIR), on CPU and on CUDA.

Rank 0 is ComfyUI's own ``patch_model()`` of a ModelPatcher holding the LoRAs, on its own copy of the
model; the worker goes through first load, strength change, LoRA swap and clear with snapshots and
deltas that crossed ``encode``/``decode``. After every step the worker's weights must equal rank 0's
bit for bit. On CUDA the worker's backups must be its own original weights, on the device (no host
copy), as the free memory of any CUDA device allows for this tiny model.
"""

import pytest
import torch

from comfy.cli_args import args

if not torch.cuda.is_available():
    args.cpu = True

from comfy.model_patcher_snapshot import PatchSnapshot, decode
from model_patcher_snapshot_overlay_test import PREFIX, TinyH3Base, _assert_same_weights, _load, _lora_files

pytestmark = pytest.mark.comfyui
CPU = torch.device("cpu")
CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])


@pytest.fixture
def comfy(comfyui_models):
    import comfy.lora
    import comfy.model_management
    import comfy.model_patcher
    import comfy.model_patcher_snapshot.load
    return comfy


def _rank0_weights(comfy, model, device, loras):
    """ComfyUI's own merge of ``loras`` [(loaded, strength)] on ``device``, read back to the CPU."""
    p = comfy.model_patcher.ModelPatcher(model, load_device=device, offload_device=CPU)
    for loaded, strength in loras:
        p.add_patches(loaded, strength)
    p.patch_model(device_to=device)
    out = {k: v.to(CPU, copy=True) for k, v in model.diffusion_model.state_dict().items()}
    p.unpatch_model(device_to=CPU)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_worker_load_equals_comfyui_through_load_strength_swap_and_clear(comfy, device, dtype):
    device = torch.device(device, 0) if device == "cuda" else CPU
    rank0_model = TinyH3Base(comfy, dtype)
    main, turbo = (_load(comfy, rank0_model, sd) for sd in _lora_files(full_family=dtype != torch.float8_e4m3fn))
    steps = {"first load": [(main, 0.8), (turbo, 1.0)], "strength change": [(main, 0.3), (turbo, 1.0)],
             "swap": [(turbo, 0.6)], "clear": []}
    worker_model = TinyH3Base(comfy, dtype)  # same seed: the same base weights, built the same way
    base_sd = {k: v.clone() for k, v in worker_model.diffusion_model.state_dict().items()}
    # as ComfyUI's loaders build it: offload device on the host
    base = comfy.model_patcher.ModelPatcher(worker_model, load_device=device, offload_device=CPU)

    held, sent, backup_ptrs = None, {}, {}
    try:
        for step, loras in steps.items():
            rank0 = comfy.model_patcher.ModelPatcher(rank0_model, load_device=device, offload_device=CPU)
            for loaded, strength in loras:
                rank0.add_patches(loaded, strength)
            snap = PatchSnapshot.capture(rank0, previous=held)
            update = snap if held is None else snap.diff(held)
            sent[step] = update.describe()["tensor_bytes"]
            update = decode(update.encode())
            held = update if update.kind == "snapshot" else update.apply_to(held)
            assert held.version == snap.version, step

            worker = held.load(base)
            assert base.patches == {}, step
            got = {k: v.to(CPU) for k, v in worker_model.diffusion_model.state_dict().items()}
            expected = _rank0_weights(comfy, rank0_model, device, loras) if loras else base_sd
            _assert_same_weights(got, expected)
            assert {t.device.type for t in worker_model.diffusion_model.state_dict().values()} == {device.type}, step
            if device.type == "cuda":
                # backups on the device, made once: later changes restore and re-merge by reference
                assert worker.offload_device == device, step
                assert sorted(worker.backup) == sorted(worker.patches), step
                for key, b in worker.backup.items():
                    assert b.weight.device == device and b.weight.data_ptr() == backup_ptrs.setdefault(key, b.weight.data_ptr()), (step, key)
        if device.type == "cuda":
            # cleared: the model holds the very tensors that were the backups
            restored = {PREFIX + k: v.data_ptr() for k, v in worker_model.diffusion_model.state_dict().items()}
            assert backup_ptrs and all(restored[k] == ptr for k, ptr in backup_ptrs.items())
    finally:
        comfy.model_management.unload_all_models()
    # a strength change carries numbers only; the swap drops main and keeps turbo's factors on the worker
    assert sent["strength change"] == sent["swap"] == sent["clear"] == 0 < sent["first load"]
    _assert_same_weights({k: v.to(CPU) for k, v in worker_model.diffusion_model.state_dict().items()}, base_sd)


def test_backups_stay_on_the_device_exactly_when_weights_backups_and_headroom_fit(comfy, monkeypatch):
    """The choice as numbers: ComfyUI's reserve plus a tenth of the device must stay free (any CPU machine)."""
    mm, choose = comfy.model_management, comfy.model_patcher_snapshot.load.backup_device
    gpu = torch.device("cuda", 0)
    model = TinyH3Base(comfy, torch.bfloat16)
    main, _ = (_load(comfy, model, sd) for sd in _lora_files(full_family=False))
    patcher = comfy.model_patcher.ModelPatcher(model, load_device=gpu, offload_device=CPU).clone()
    patcher.add_patches(main, 1.0)
    sd = model.state_dict()
    weights = sum(v.numel() * v.element_size() for v in sd.values())
    backups = sum(sd[k].numel() * sd[k].element_size() for k in patcher.patches)
    assert 0 < backups < weights
    total = 80 * 1024 ** 3
    monkeypatch.setattr(mm, "get_total_memory", lambda dev=None, torch_total_too=False: total)
    fits = weights + backups + mm.minimum_inference_memory() + total / 10
    for free, expected in ((fits, gpu), (fits - 1, None), (total, gpu), (0, None)):
        monkeypatch.setattr(mm, "get_free_memory", lambda dev=None, torch_free_too=False, free=free: free)
        assert choose(patcher) == expected, free
    # nothing to choose: one device for both, or a CPU load device
    assert choose(comfy.model_patcher.ModelPatcher(model, load_device=gpu, offload_device=gpu)) is None
    assert choose(comfy.model_patcher.ModelPatcher(model, load_device=CPU, offload_device=CPU)) is None
