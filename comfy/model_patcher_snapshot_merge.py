"""Weight arithmetic for patch snapshots: one key's base weight + its patch entries -> merged weight.

Two implementations, chosen per applier:

* ``"comfyui"``: the patch entries are turned back into the objects ComfyUI itself holds (its weight
  adapter classes, ``("diff", ...)`` / ``("set", ...)`` tuples) and merged by
  ``comfy.lora.calculate_weight`` in ``lora_compute_dtype(device)``, then rounded to the parameter
  dtype by ``comfy.float.stochastic_rounding`` seeded with ``comfy.utils.string_to_seed(key)``: the
  steps of ``ModelPatcher.patch_weight_to_device``, so the result is bit-identical to
  ``patch_model()`` on a device of the same kind. Not claimed: ModelPatcherDynamic (DynamicVRAM)
  and lowvram partial loads, which merge at forward time in the compute dtype instead.
* ``"builtin"``: for processes without ComfyUI; LoRA (plain up/down/alpha), diff and set only,
  float32 intermediate (ComfyUI's choice on CPU), and no float8 targets (those need ComfyUI's
  stochastic rounding). The overlay tests prove it bit-identical to ComfyUI on CPU.

Entries are the manifest form (see ``model_patcher_snapshot``): dicts with ``strength``,
``strength_model``, ``offset`` and ``value``; ``tensors`` maps the names they reference to tensors.
"""

import logging
from types import SimpleNamespace

import torch

ARITHMETICS = ("auto", "comfyui", "builtin")
_BUILTIN_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
# the lora adapter's weights tuple: (up, down, alpha, mid, dora_scale, reshape)
_LORA_EXTRAS = {3: "a LoCon mid weight", 4: "DoRA (dora_scale)", 5: "reshape_weight"}


def _comfy_modules():
    import comfy.float
    import comfy.lora
    import comfy.model_management
    import comfy.utils
    import comfy.weight_adapter
    return SimpleNamespace(float=comfy.float, lora=comfy.lora, mm=comfy.model_management, utils=comfy.utils,
                           adapters={cls.name: cls for cls in comfy.weight_adapter.adapters})


def resolve_arithmetic(arithmetic: str) -> str:
    """"auto" -> "comfyui" when ComfyUI's modules import here, else "builtin"."""
    if arithmetic not in ARITHMETICS:
        raise ValueError(f"arithmetic={arithmetic!r}; expected one of {ARITHMETICS}")
    if arithmetic == "comfyui":
        try:
            _comfy_modules()
        except ImportError as e:
            raise ImportError(f"arithmetic='comfyui' needs ComfyUI importable in this process ({e}); put the "
                              "ComfyUI checkout on sys.path or use arithmetic='builtin'") from e
    if arithmetic != "auto":
        return arithmetic
    try:
        _comfy_modules()
    except ImportError as e:
        logging.info("patch snapshots: ComfyUI not importable (%s); merging with the built-in LoRA/diff/set arithmetic", e)
        return "builtin"
    return "comfyui"


def unsupported_reason(entries: list, param_dtype: torch.dtype, arithmetic: str):
    """Why ``arithmetic`` cannot merge these entries into a ``param_dtype`` weight, or None."""
    if arithmetic == "comfyui":
        known = _comfy_modules().adapters
        for i, e in enumerate(entries):
            v = e["value"]
            if v["type"] == "adapter" and v["adapter"] not in known:
                return f"entry {i}: adapter {v['adapter']!r} is not one of this ComfyUI's adapters {sorted(known)}"
        return None
    if param_dtype not in _BUILTIN_DTYPES:
        return (f"the weight is {param_dtype}; rounding to it needs ComfyUI's comfy.float.stochastic_rounding "
                "(run the worker with ComfyUI importable)")
    for i, e in enumerate(entries):
        v = e["value"]
        if v["type"] != "adapter":
            continue
        if v["adapter"] != "lora":
            return (f"entry {i}: adapter {v['adapter']!r} needs ComfyUI's weight adapter code; the built-in "
                    "arithmetic merges only LoRA, diff and set (run the worker with ComfyUI importable)")
        for slot, what in _LORA_EXTRAS.items():
            if v["weights"][slot] is not None:
                return f"entry {i}: LoRA with {what} needs ComfyUI's adapter code (run the worker with ComfyUI importable)"
    return None


def _slot(slot, tensors):
    if slot is None:
        return None
    kind, value = next(iter(slot.items()))
    if kind == "tensor":
        return tensors[value]
    return list(value) if kind == "ints" else value


def comfy_patches(entries: list, tensors: dict) -> list:
    """Manifest entries -> the 5-tuples ``ModelPatcher.patches[key]`` holds, with ComfyUI's own objects."""
    adapters = _comfy_modules().adapters
    out = []
    for e in entries:
        v = e["value"]
        if v["type"] == "adapter":
            value = adapters[v["adapter"]](set(), tuple(_slot(s, tensors) for s in v["weights"]))
        elif v["type"] == "diff":
            value = ("diff", (tensors[v["tensor"]], {"pad_weight": True}) if v["pad_weight"] else (tensors[v["tensor"]],))
        else:
            value = ("set", (tensors[v["tensor"]],))
        offset = tuple(e["offset"]) if e["offset"] is not None else None
        out.append((e["strength"], value, e["strength_model"], offset, None))
    return out


def _merge_comfyui(key, base, device, dtype, entries, tensors):
    c = _comfy_modules()
    temp = c.mm.cast_to_device(base, device, c.mm.lora_compute_dtype(device), copy=True)
    out = c.lora.calculate_weight(comfy_patches(entries, tensors), temp, key)
    return c.float.stochastic_rounding(out, dtype, seed=c.utils.string_to_seed(key))


def _add_lora(target, v, strength, tensors, key):
    up, down = (tensors[v["weights"][i]["tensor"]] for i in (0, 1))
    alpha = _slot(v["weights"][2], tensors)
    scale = alpha / down.shape[0] if alpha is not None else 1.0
    up = up.to(device=target.device, dtype=torch.float32).flatten(start_dim=1)
    down = down.to(device=target.device, dtype=torch.float32).flatten(start_dim=1)
    if up.shape[0] * down.shape[1] != target.numel():
        # ComfyUI logs and skips a LoRA whose product does not fit the weight; replicate, not improve
        logging.error("lora %s: up %s x down %s does not fit weight %s; entry skipped as ComfyUI does",
                      key, tuple(up.shape), tuple(down.shape), tuple(target.shape))
        return
    target += ((strength * scale) * torch.mm(up, down).reshape(target.shape)).to(target.dtype)


def _merge_builtin(key, base, device, dtype, entries, tensors):
    weight = base.to(device=device, dtype=torch.float32, copy=True)
    for e in entries:
        target = weight.narrow(*e["offset"]) if e["offset"] is not None else weight
        if e["strength_model"] != 1.0:
            target *= e["strength_model"]
        v = e["value"]
        if v["type"] == "adapter":
            _add_lora(target, v, e["strength"], tensors, key)
        elif v["type"] == "set":
            target.copy_(tensors[v["tensor"]])
        else:
            diff = tensors[v["tensor"]]
            if diff.shape != target.shape:
                if v["pad_weight"]:
                    raise ValueError(f"{key}: diff {tuple(diff.shape)} pads weight {tuple(target.shape)}; a padded "
                                     "weight changes the parameter's shape, which an in-place apply cannot do")
                logging.warning("diff %s: shape %s != weight %s; not merged, as ComfyUI does", key, tuple(diff.shape), tuple(target.shape))
            elif e["strength"] != 0.0:
                target += e["strength"] * diff.to(device=target.device, dtype=target.dtype)
    return weight.to(dtype)


def merged_weight(key: str, base: torch.Tensor, device, dtype, entries: list, tensors: dict, arithmetic: str) -> torch.Tensor:
    """The weight ``key`` takes on ``device`` in ``dtype``: ``base`` with ``entries`` merged in order."""
    merge = _merge_comfyui if arithmetic == "comfyui" else _merge_builtin
    return merge(key, base, device, dtype, entries, tensors)
