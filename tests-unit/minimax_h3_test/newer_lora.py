"""Stand-in for what comfy/lora.py gained with PDD LoRAs (ComfyUI PR #15908) and 0f1fa67 lacks, for tests:

* ``load_lora`` maps ``{x}.set_bias`` to a "set" patch of that layer's bias (the key taken from a
  ``(key, offset)`` entry of ``to_load`` too);
* a "set" patch may change a weight's shape: ``calculate_weight`` continues from the set tensor instead of
  copying it into the weight, and ``calculate_shape`` reports its shape.

The PR's own calculate_weight hunk is not in any stored source, so this follows its description ("set_weight
patches may change a weight's shape; the patcher already handles resized weights"). Importing this module
installs it in the process (sequence-parallel workers import it through ``worker_spec['imports']``);
``uninstall()`` restores ComfyUI's functions.
"""

import comfy.lora

_ORIGINAL = {}


def _resizing_set(patch, weight):
    v = patch[1]
    return isinstance(v, tuple) and len(v) == 2 and v[0] == "set" and tuple(v[1][0].shape) != tuple(weight.shape)


def load_lora(lora, to_load, log_missing=True):
    patch_dict = _ORIGINAL["load_lora"](lora, to_load, log_missing=False)
    for x, target in to_load.items():
        bias = lora.get(f"{x}.set_bias")
        if bias is not None:
            key = target[0] if isinstance(target, tuple) else target
            patch_dict[key[:-len(".weight")] + ".bias"] = ("set", (bias,))
    return patch_dict


def calculate_weight(patches, weight, key, intermediate_dtype=None, original_weights=None):
    kwargs = {"original_weights": original_weights}
    if intermediate_dtype is not None:
        kwargs["intermediate_dtype"] = intermediate_dtype
    for i in range(len(patches) - 1, -1, -1):
        if _resizing_set(patches[i], weight):  # what came before it is overwritten
            weight = patches[i][1][1][0].to(device=weight.device, dtype=weight.dtype, copy=True)
            return _ORIGINAL["calculate_weight"](patches[i + 1:], weight, key, **kwargs)
    return _ORIGINAL["calculate_weight"](patches, weight, key, **kwargs)


def calculate_shape(patches, weight, key, original_weights=None):
    for i in range(len(patches) - 1, -1, -1):
        if _resizing_set(patches[i], weight):
            weight = patches[i][1][1][0]
            return _ORIGINAL["calculate_shape"](patches[i + 1:], weight, key, original_weights)
    return _ORIGINAL["calculate_shape"](patches, weight, key, original_weights)


def install():
    for name, fn in (("load_lora", load_lora), ("calculate_weight", calculate_weight), ("calculate_shape", calculate_shape)):
        _ORIGINAL.setdefault(name, getattr(comfy.lora, name))
        setattr(comfy.lora, name, fn)


def uninstall():
    for name, fn in _ORIGINAL.items():
        setattr(comfy.lora, name, fn)


install()
