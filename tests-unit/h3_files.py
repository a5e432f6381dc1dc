"""H3 checkpoint files on disk, in the layouts ComfyUI's loader reads (importable by any test).

Formats (``fmt``):
  plain        every tensor as ``random_state_dict`` makes it at ``dtype`` (fp32 islands stay fp32).
  scaled_fp8   ComfyUI's legacy scaled-fp8 file: a ``scaled_fp8`` marker tensor, each quantized
               linear's weight in float8_e4m3fn with an fp32 per-tensor ``<layer>.scale_weight``
               (weight ~= fp8 * scale). comfy.utils.convert_old_quants turns it into the current
               per-layer form, which makes comfy.utils.detect_layer_quantization pick
               comfy.ops.mixed_precision_ops.
  comfy_quant  that current per-layer form written directly: ``<layer>.comfy_quant`` (uint8 JSON,
               {"format": "float8_e4m3fn"}) and ``<layer>.weight_scale`` next to the fp8 weight.

Quantized layers are the linears the model stores at model dtype; its fp32 islands (patch
projections, time embedder, output heads, curve-form adaLN) keep full precision, as in shipped
fp8 files.
"""

import json

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from comfy.ldm.minimax_h3.model import MiniMaxH3Model
from comfy.ldm.minimax_h3.synthetic import TINY_CONFIG, random_state_dict

FORMATS = ("plain", "scaled_fp8", "comfy_quant")
FP8 = torch.float8_e4m3fn

__all__ = ["FORMATS", "TINY_CONFIG", "lora_state_dict", "quantized_layers", "read_h3_file", "write_h3_file"]


def quantized_layers(config):
    """Layer names (no prefix) whose weights the scaled formats store in fp8."""
    # the model built at a non-fp32 dtype shows which linears follow the model dtype
    probe = MiniMaxH3Model(**config, dtype=torch.bfloat16, device="meta").state_dict()
    return sorted(k[:-len(".weight")] for k, t in probe.items()
                  if k.endswith(".weight") and t.ndim == 2 and t.dtype != torch.float32)


def _fp8_per_tensor(w):
    """(fp8 tensor, fp32 scalar scale) with w ~= fp8.float() * scale; amax maps to the fp8 max."""
    w = w.float()
    scale = (w.abs().max() / torch.finfo(FP8).max).clamp(min=1e-12)
    return (w / scale).clamp(torch.finfo(FP8).min, torch.finfo(FP8).max).to(FP8), scale.reshape(())


def write_h3_file(path, config, seed=0, dtype=torch.float32, fmt="plain", prefix="model.diffusion_model."):
    """Write random H3 weights (random_state_dict(seed) at dtype) to safetensors `path` in format `fmt` (see FORMATS); returns path."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown H3 file format {fmt!r}: use one of {FORMATS}")
    sd = random_state_dict(MiniMaxH3Model(**config, dtype=dtype, device="meta"), seed=seed)
    if fmt != "plain":
        for layer in quantized_layers(config):
            q, scale = _fp8_per_tensor(sd[layer + ".weight"])
            sd[layer + ".weight"] = q
            if fmt == "scaled_fp8":
                sd[layer + ".scale_weight"] = scale
            else:
                sd[layer + ".weight_scale"] = scale
                sd[layer + ".comfy_quant"] = torch.tensor(list(json.dumps({"format": "float8_e4m3fn"}).encode()), dtype=torch.uint8)
        if fmt == "scaled_fp8":
            # the marker's dtype names the fp8 type; one element (two would ask for full-precision matmuls)
            sd["scaled_fp8"] = torch.zeros((), dtype=FP8)
    save_file({prefix + k: v.contiguous() for k, v in sd.items()}, str(path))
    return path


def read_h3_file(path, prefix="model.diffusion_model."):
    """{key without prefix: fp32 tensor} of a file write_h3_file wrote, scaled weights dequantized (fp8 * scale)."""
    with safe_open(str(path), framework="pt", device="cpu") as f:
        raw = {k[len(prefix):]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}
    out = {}
    for k, t in raw.items():
        if k == "scaled_fp8" or k.endswith((".scale_weight", ".weight_scale", ".comfy_quant")):
            continue
        layer = k[:-len(".weight")]
        scale = raw.get(layer + ".scale_weight", raw.get(layer + ".weight_scale")) if k.endswith(".weight") else None
        out[k] = t.float() if scale is None else t.float() * scale.float()
    return out


def lora_state_dict(config, rank=4, seed=5, scale=0.1):
    """A LoRA file's state dict in the kohya naming ComfyUI maps onto H3's linears (qkv, out, fc1, fc2
    of every DiT and token-refiner block): up, down and alpha per weight."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, w in MiniMaxH3Model(**config, device="meta").state_dict().items():
        if name.endswith(("qkv_proj.weight", "out_proj.weight", "fc1.weight", "fc2.weight")):
            stem = "lora_unet_" + name[:-len(".weight")].replace(".", "_")
            sd[stem + ".lora_up.weight"] = torch.randn(w.shape[0], rank, generator=g) * scale
            sd[stem + ".lora_down.weight"] = torch.randn(rank, w.shape[1], generator=g) * scale
            sd[stem + ".alpha"] = torch.tensor(float(rank))
    return sd
