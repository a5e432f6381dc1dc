"""What makes a worker process a headless ComfyUI: rank 0's execution settings and its loader call.

Rank 0 describes both as JSON (``execution_settings``, ``loader_call``); a worker applies the
settings before any ComfyUI model code is imported (``configure``), then builds its model with
the very loader call rank 0's ModelPatcher came from (``load``). ``describe`` is what both sides
must agree on afterwards (dtypes, patcher kind, attention backend, code).
"""

import functools
import hashlib
import importlib
import json
import os
import sys
import weakref

import torch

SCHEMA = 1

# comfy.cli_args.args entries that change how a model loads or computes; everything else
# (ports, paths, previews, caching, logging) stays rank 0's business
EXECUTION_ARGS = (
    "cpu", "gpu_only", "highvram", "lowvram", "novram", "disable_smart_memory",
    "disable_dynamic_vram", "enable_dynamic_vram", "fast_disk", "disable_pinned_memory",
    "async_offload", "disable_async_offload", "force_non_blocking", "reserve_vram", "vram_headroom",
    "force_fp32", "force_fp16", "fp32_unet", "fp64_unet", "bf16_unet", "fp16_unet",
    "fp8_e4m3fn_unet", "fp8_e5m2_unet", "fp8_e8m0fnu_unet", "supports_fp8_compute",
    "enable_triton_backend", "disable_triton_backend", "force_channels_last", "deterministic", "fast",
    "use_split_cross_attention", "use_quad_cross_attention", "use_pytorch_cross_attention",
    "use_sage_attention", "use_flash_attention", "use_ck_attention", "disable_xformers",
    "force_upcast_attention", "dont_upcast_attention", "disable_cuda_graphs",
)

# ComfyUI loaders whose ModelPatcher records how to rebuild it (cached_patcher_init)
LOADERS = {
    "load_diffusion_model": "comfy.sd:load_diffusion_model",
    "load_checkpoint_guess_config": "comfy.sd:load_checkpoint_guess_config",
}

# model code whose source both sides must share (the diffusion model's own module is added)
CODE_MODULES = ("comfy.model_patcher", "comfy.model_base", "comfy.ops", "comfy.lora", "comfy.sd",
                "comfy.model_management", "comfy.ldm.modules.attention")

_DTYPE_TAG = "torch.dtype"


def execution_settings():
    """Rank 0's settings that a worker must share, as JSON."""
    from comfy.cli_args import args
    import comfy.memory_management
    values = {}
    for name in EXECUTION_ARGS:
        v = getattr(args, name)
        values[name] = sorted(f.value for f in v) if name == "fast" else v
    return {"schema": SCHEMA, "args": values, "dynamic_vram": bool(comfy.memory_management.aimdo_enabled)}


def configure(settings, device_kind):
    """On a worker, before comfy.model_management is imported: take rank 0's settings."""
    if settings.get("schema") != SCHEMA:
        raise ValueError(f"execution settings schema {settings.get('schema')!r}, this worker reads {SCHEMA}: "
                         "rank 0 and the workers must run the same ComfyUI")
    if "comfy.model_management" in sys.modules:
        raise RuntimeError("comfy.model_management was imported before the execution settings were applied")
    from comfy.cli_args import PerformanceFeature, args
    unknown = sorted(set(settings["args"]) - set(EXECUTION_ARGS))
    if unknown:
        raise ValueError(f"execution settings carry unknown args {unknown}")
    for name, v in settings["args"].items():
        setattr(args, name, {PerformanceFeature(f) for f in v} if name == "fast" else v)
    if device_kind == "cpu":
        args.cpu = True
    if settings["dynamic_vram"]:
        _enable_dynamic_vram(args)


def _enable_dynamic_vram(args):
    # what main.py does at start-up when DynamicVRAM is on (rank 0 had it on)
    import comfy_aimdo.control
    import comfy.memory_management
    import comfy.model_management
    import comfy.model_patcher
    headroom = None if args.reserve_vram is None else int(args.reserve_vram * 1024 ** 3)
    comfy_aimdo.control.init(simple_vram_headroom=headroom, nvml_pressure=not args.disable_nvml_pressure)
    devices = ((d.index, int(args.vram_headroom * 1024 ** 3)) for d in comfy.model_management.get_all_torch_devices())
    if not comfy_aimdo.control.init_devices(devices):
        raise RuntimeError("rank 0 runs with DynamicVRAM, but comfy-aimdo did not start on this worker's device; "
                           "start ComfyUI with --disable-dynamic-vram to run every rank without it")
    comfy.model_patcher.CoreModelPatcher = comfy.model_patcher.ModelPatcherDynamic
    comfy.memory_management.aimdo_enabled = True


def _encode(value, where):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.dtype):
        return {_DTYPE_TAG: str(value).removeprefix("torch.")}
    if isinstance(value, (list, tuple)):
        return [_encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        if _DTYPE_TAG in value:
            raise ValueError(f"{where} uses the reserved key {_DTYPE_TAG!r}")
        return {k: _encode(v, f"{where}[{k!r}]") for k, v in value.items()}
    raise ValueError(f"{where} is a {type(value).__name__}; worker processes rebuild the model from JSON-able loader "
                     "arguments only. Load the model without that option to run it in parallel")


def _decode(value):
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {_DTYPE_TAG}:
            dtype = getattr(torch, value[_DTYPE_TAG], None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"unknown torch dtype {value[_DTYPE_TAG]!r} in a loader call")
            return dtype
        return {k: _decode(v) for k, v in value.items()}
    return value


def _loader(name):
    if name not in LOADERS:
        raise ValueError(f"loader {name!r} is not one of {sorted(LOADERS)}")
    module, _, fn = LOADERS[name].partition(":")
    return getattr(importlib.import_module(module), fn)


def file_identity(path):
    """Size, mtime, inode and safetensors header hash: a changed file changes it, no full read."""
    st = os.stat(path)
    with open(path, "rb") as f:
        head = f.read(8)
        size = int.from_bytes(head, "little") if len(head) == 8 else 0
        header = f.read(min(size, 100 * 1024 * 1024))
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino,
            "header_sha256": hashlib.sha256(head + header).hexdigest()}


def loader_call(patcher):
    """Rank 0's ModelPatcher -> the JSON call that builds the same base model in another process."""
    init = getattr(patcher, "cached_patcher_init", None)
    if init is None:
        raise ValueError("this model was not built by a ComfyUI loader that records how to rebuild it "
                         "(cached_patcher_init): load it with 'Load Diffusion Model' or 'Load Checkpoint'")
    fn, args = init[0], init[1]
    index = init[2] if len(init) > 2 else None
    name = next((n for n in LOADERS if _loader(n) is fn), None)
    if name is None:
        raise ValueError(f"this model was built by {getattr(fn, '__qualname__', fn)!r}; worker processes can rebuild "
                         f"models from {sorted(LOADERS)} only: load it with 'Load Diffusion Model' or 'Load Checkpoint'")
    path = args[0]
    return {"schema": SCHEMA, "loader": name, "args": _encode(list(args), name), "index": index,
            "file": {"path": os.path.realpath(path), **file_identity(path)}}


def load(call):
    """On a worker: run rank 0's loader call -> the ModelPatcher it returns."""
    if call.get("schema") != SCHEMA:
        raise ValueError(f"loader call schema {call.get('schema')!r}, this worker reads {SCHEMA}")
    _check_file(call["file"])
    out = _loader(call["loader"])(*_decode(call["args"]))
    patcher = out if call["index"] is None else out[call["index"]]
    _check_file(call["file"])  # replaced while loading
    return patcher


def _check_file(expected):
    path = expected["path"]
    found = {"path": path, **file_identity(path)}
    if found != expected:
        changed = sorted(k for k in expected if found.get(k) != expected[k])
        raise ValueError(f"checkpoint {path} changed on disk since rank 0 loaded it ({', '.join(changed)} differ): "
                         "workers would get other weights. Load the model again in ComfyUI so every rank reads one file")


def describe(patcher):
    """What every rank must agree on once its model is built: dtypes, patcher kind, attention backend, code
    and base weights."""
    import comfy.ldm.modules.attention as attention
    model = patcher.model
    folders = (os.path.dirname(sys.modules[type(model.diffusion_model).__module__].__file__), os.path.dirname(__file__))
    return {"model_dtype": str(patcher.model_dtype()), "manual_cast_dtype": str(model.manual_cast_dtype),
            "patcher": type(patcher).__name__, "attention": attention.optimized_attention.__name__,
            "torch": torch.__version__, "code_sha256": _code_sha256(CODE_MODULES, folders),
            "weights_sha256": weights_fingerprint(patcher)}


@functools.cache
def _code_sha256(modules, folders):
    # imported code does not change within a process: hash its source once. Every .py file in the model's
    # folder and in comfy/parallel counts, imported yet or not, so both sides hash the same file list
    files = [sys.modules[name].__file__ for name in modules]
    for folder in folders:
        files += [os.path.join(folder, f) for f in sorted(os.listdir(folder)) if f.endswith(".py")]
    code = hashlib.sha256()
    for path in files:
        with open(path, "rb") as f:
            code.update(os.path.basename(path).encode() + b"\0" + f.read())
    return code.hexdigest()


def weights_fingerprint(patcher, samples=64):
    """sha256 over an evenly strided sample of every base weight of the diffusion model.

    Weights that ComfyUI patched in place are read from the patcher's backups (shared by its clones), so
    rank 0 with a LoRA applied and a freshly loaded worker agree exactly when their base weights do.
    Quantized tensors are sampled through their inner tensors (``__tensor_flatten__``). Base weights do
    not change in memory, so the value is kept per base model.
    """
    found = _fingerprints.get(patcher.model)
    if found is None:
        found = _fingerprints[patcher.model] = _weights_sha256(patcher, samples)
    return found


_fingerprints = weakref.WeakKeyDictionary()


def _weights_sha256(patcher, samples):
    code = hashlib.sha256()
    for key, value in sorted(patcher.model.diffusion_model.state_dict(keep_vars=True).items()):
        backup = patcher.backup.get("diffusion_model." + key)
        tensor = (backup.weight if backup is not None else value).detach()
        code.update(f"{key}|{tuple(tensor.shape)}|{tensor.dtype}".encode())
        for inner in _plain_tensors(tensor):
            flat = inner.reshape(-1)
            sample = flat[::max(1, flat.numel() // samples)][:samples].to("cpu").contiguous()
            code.update(sample.view(torch.uint8).numpy().tobytes() if sample.numel() else b"")
    return code.hexdigest()


def _plain_tensors(tensor):
    if type(tensor) in (torch.Tensor, torch.nn.Parameter) or not hasattr(tensor, "__tensor_flatten__"):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    return [t for name in names for t in _plain_tensors(getattr(tensor, name))]


def check_same(rank0, others):
    """Raise ValueError naming the first rank whose ``describe`` differs from rank 0's."""
    for rank, d in sorted(others.items()):
        diff = {k: (rank0.get(k), d.get(k)) for k in sorted(set(rank0) | set(d)) if rank0.get(k) != d.get(k)}
        if diff:
            lines = "; ".join(f"{k}: rank 0 {a!r}, rank {rank} {b!r}" for k, (a, b) in diff.items())
            fix = ("the checkpoint file changed since rank 0 loaded it: load the model again in ComfyUI"
                   if "weights_sha256" in diff else
                   "all ranks need the same kind of device, ComfyUI code and start-up flags")
            raise ValueError(f"rank {rank} does not run the model as rank 0 does ({lines}); {fix}")


def digest(obj):
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def attention_name(override):
    """The registered name of the attention function ``ModelPatcher.set_model_optimized_attention`` installed."""
    import comfy.ldm.modules.attention as attention
    targets = [c.cell_contents for c in (getattr(override, "__closure__", None) or ())]
    for name, fn in attention.REGISTERED_ATTENTION_FUNCTIONS.items():
        if any(t is fn for t in targets):
            return name
    raise ValueError("this model's attention override is not one of ComfyUI's registered attention functions "
                     f"{sorted(attention.REGISTERED_ATTENTION_FUNCTIONS)}; workers can only select a backend by name "
                     "(remove the node that sets it, or register it with register_attention_function)")
