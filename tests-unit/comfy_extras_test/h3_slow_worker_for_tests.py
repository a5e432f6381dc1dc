"""Imported by the workers of a sequence-parallel test: with ``H3SP_TEST_SLOW_S`` in the environment (the
runner's ``env`` reaches the workers only), a worker's checkpoint load and its first LoRA merge each take
that many seconds longer, as a real-size checkpoint's would."""

import os
import time

import comfy.model_patcher
import comfy.sd

SLOW = float(os.environ.get("H3SP_TEST_SLOW_S", "0"))
_load, _patch = comfy.sd.load_diffusion_model, comfy.model_patcher.ModelPatcher.patch_weight_to_device
_merged = []


def load_diffusion_model(*args, **kwargs):
    time.sleep(SLOW)
    return _load(*args, **kwargs)


def patch_weight_to_device(self, key, *args, **kwargs):
    if not _merged:  # the first weight a LoRA patches in this process
        _merged.append(key)
        time.sleep(SLOW)
    return _patch(self, key, *args, **kwargs)


if SLOW:
    comfy.sd.load_diffusion_model = load_diffusion_model
    comfy.model_patcher.ModelPatcher.patch_weight_to_device = patch_weight_to_device
