"""H3 test fixtures (importable by any test, script or bench): random weights at any H3 config,
step inputs of every conditioning kind, and checkpoint files in the layouts ComfyUI's loader reads.

File formats (``fmt``):
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
import math

import torch
from safetensors import safe_open
from safetensors.torch import save_file

import comfy.ops
from comfy.ldm.minimax.model import FRAME_RESCALE, MiniMaxH3Model

FORMATS = ("plain", "scaled_fp8", "comfy_quant")
FP8 = torch.float8_e4m3fn
OPS = comfy.ops.disable_weight_init  # what ComfyUI's loader builds H3 with; on "meta" only the keys matter

__all__ = ["FORMATS", "INPUT_KINDS", "TINY_CONFIG", "lora_state_dict", "quantized_layers", "random_state_dict",
           "read_h3_file", "step_inputs", "write_h3_file"]

# small enough for CPU tests, every structural feature of the real model (partial rope: 12 of 16)
TINY_CONFIG = {"hidden_size": 64, "num_layers": 2, "token_refiner_num_layers": 1, "num_attention_heads": 4,
               "attention_head_dim": 16, "ffn_hidden_size": 96, "text_dim": 48, "timestep_input_dim": 32,
               "time_embed_hidden_size": 64, "time_embed_dim": 32, "rope_inv_freq_len": 2}

INPUT_KINDS = ("t2va", "tags", "keyframes", "ref_image", "ref_audio", "ref_video", "ref_video_audio", "refs_all")


def random_state_dict(model, seed=0):
    """Random weights for every tensor of `model` (fan-in scaled, so activations stay O(1))."""
    gen = torch.Generator("cpu").manual_seed(seed)
    out = {}
    for name, t in model.state_dict().items():
        if name.endswith("rope.inv_freq"):
            n = t.shape[0]
            v = 1.0 / (10000.0 ** (torch.arange(n, dtype=torch.float64) / n))
        elif "norm" in (name.split(".")[-2] if "." in name else ""):  # norm, norm1/2, q_norm, k_norm, final_norm
            v = 1.0 + 0.1 * torch.randn(t.shape, generator=gen)
        elif t.ndim == 2 and not name.endswith("adaln_t_table"):
            v = torch.randn(t.shape, generator=gen) / math.sqrt(t.shape[1])
        else:
            v = 0.1 * torch.randn(t.shape, generator=gen)
        out[name] = v.to(t.dtype)
    return out


def _latent(gen, *shape):
    return torch.randn(shape, generator=gen)


def step_inputs(config, kind="t2va", seed=0, text_len=7, frames=3, height=6, width=8, audio_t=5, sigma=0.6,
                raw_text=True, audio_scale=1.0):
    """(x, timestep, context, payload) for one step of a given conditioning kind.

    kinds: t2va, tags, keyframes, ref_image, ref_audio, ref_video, ref_video_audio, refs_all.
    """
    gen = torch.Generator("cpu").manual_seed(seed)
    c, ca = config.get("latents_dim", 24), config.get("audio_latents_dim", 32)
    video = _latent(gen, 1, c, frames, height, width)
    audio = _latent(gen, 1, ca, 2, audio_t)
    width_ctx = config["text_dim"] if raw_text else config["hidden_size"]
    context = _latent(gen, 1, text_len, width_ctx)
    timestep = torch.tensor([sigma * 1000.0])
    payload = {"seed": seed + 11, "audio_scale": audio_scale}
    lh, lw = height + height % 2, width + width % 2
    if kind == "tags":
        tags = torch.ones(text_len, dtype=torch.long)
        tags[1:3] = 0
        tags[-1] = 2
        payload["text_token_tags"] = tags
    elif kind == "keyframes":
        last = int((frames - 1) * 4 // 1)
        kfs = [{"resolved_frame_index": 0, "latent": _latent(gen, 1, c, 1, lh, lw)},
               {"resolved_frame_index": last, "latent": _latent(gen, 1, c, 1, lh, lw),
                "audio_latent": _latent(gen, 1, ca, 2, max(1, audio_t - math.ceil(FRAME_RESCALE * last) + 2))}]
        payload["keyframes"] = kfs
        payload["cond_video_latents"] = [k["latent"] for k in kfs if k.get("latent") is not None]
        payload["cond_audio_latents"] = [k["audio_latent"] for k in kfs if k.get("audio_latent") is not None]
        payload["visual_cond_noise_aug"] = 0.9
        payload["audio_cond_noise_aug"] = 0.8
    elif kind.startswith("ref"):
        blocks = []
        if kind in ("ref_image", "refs_all"):
            blocks.append({"kind": "image", "latent_h": 4, "latent_w": 6, "latent": _latent(gen, 1, c, 1, 4, 6)})
        if kind in ("ref_audio", "refs_all"):
            blocks.append({"kind": "audio", "ref_audio_t": 3, "audio_latent": _latent(gen, 1, ca, 2, 3)})
        if kind in ("ref_video", "refs_all"):
            blocks.append({"kind": "video", "latent_t": 2, "latent_h": 4, "latent_w": 4, "ref_audio_t": 0,
                           "latent": _latent(gen, 1, c, 2, 4, 4), "audio_latent": None})
        if kind in ("ref_video_audio", "refs_all"):
            blocks.append({"kind": "video_audio", "latent_t": 2, "latent_h": 2, "latent_w": 4, "ref_audio_t": 4,
                           "latent": _latent(gen, 1, c, 2, 2, 4), "audio_latent": _latent(gen, 1, ca, 2, 4)})
        if not blocks:
            raise ValueError(f"unknown reference input kind {kind!r}")
        payload["refs"] = blocks
        payload["cond_video_latents"] = [b["latent"] for b in blocks if "latent" in b]
        payload["cond_audio_latents"] = [b["audio_latent"] for b in blocks if b.get("audio_latent") is not None]
        payload["visual_cond_noise_aug"] = 0.95
    elif kind != "t2va":
        raise ValueError(f"unknown input kind {kind!r}")
    return [video, audio], timestep, context, payload


def quantized_layers(config):
    """Layer names (no prefix) whose weights the scaled formats store in fp8."""
    # the model built at a non-fp32 dtype shows which linears follow the model dtype
    probe = MiniMaxH3Model(**config, dtype=torch.bfloat16, device="meta", operations=OPS).state_dict()
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
    sd = random_state_dict(MiniMaxH3Model(**config, dtype=dtype, device="meta", operations=OPS), seed=seed)
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
    for name, w in MiniMaxH3Model(**config, device="meta", operations=OPS).state_dict().items():
        if name.endswith(("qkv_proj.weight", "out_proj.weight", "fc1.weight", "fc2.weight")):
            stem = "lora_unet_" + name[:-len(".weight")].replace(".", "_")
            sd[stem + ".lora_up.weight"] = torch.randn(w.shape[0], rank, generator=g) * scale
            sd[stem + ".lora_down.weight"] = torch.randn(rank, w.shape[1], generator=g) * scale
            sd[stem + ".alpha"] = torch.tensor(float(rank))
    return sd
