"""Synthetic H3 checkpoints and step inputs for tests, benchmarks and the demo job.

Random weights at any H3 config (the real one included) written with upstream's key names, and
inputs covering every conditioning form: t2va, text tags, keyframes (video and audio rows), and
reference blocks of each kind.
"""

import math

import torch

from .layout import FRAME_RESCALE

# small enough for CPU tests, every structural feature of the real model (partial rope: 12 of 16)
TINY_CONFIG = {"hidden_size": 64, "num_layers": 2, "token_refiner_num_layers": 1, "num_attention_heads": 4,
               "attention_head_dim": 16, "ffn_hidden_size": 96, "text_dim": 48, "timestep_input_dim": 32,
               "time_embed_hidden_size": 64, "time_embed_dim": 32, "rope_inv_freq_len": 2}

REAL_CONFIG = {"hidden_size": 5376, "num_layers": 50, "token_refiner_num_layers": 2, "num_attention_heads": 56,
               "attention_head_dim": 128, "ffn_hidden_size": 14336, "text_dim": 5120}


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


INPUT_KINDS = ("t2va", "tags", "keyframes", "ref_image", "ref_audio", "ref_video", "ref_video_audio", "refs_all")


class LoraWeights:
    """A LoRA patch value as ComfyUI's weight adapters expose it: ``name`` + ``weights``
    (up, down, alpha, mid, dora_scale, reshape), for runs without ComfyUI."""

    def __init__(self, up, down, alpha):
        self.name = "lora"
        self.weights = (up, down, alpha, None, None, None)


def lora_value(up, down, alpha):
    """ComfyUI's own LoRAAdapter when ComfyUI is importable (snapshots accept only the real class
    there), else the stand-in."""
    try:
        from comfy.weight_adapter.lora import LoRAAdapter
    except ModuleNotFoundError:
        return LoraWeights(up, down, alpha)
    return LoRAAdapter(set(), (up, down, alpha, None, None, None))


class SyntheticPatcher:
    """The attributes PatchSnapshot.capture reads from a ModelPatcher, for runs without ComfyUI."""

    def __init__(self, model, prefix="diffusion_model."):
        self.prefix = prefix
        self._keys = [prefix + k for k in model.state_dict()]
        self.patches = {}
        self.patches_uuid = 0
        self.object_patches = {}
        self.force_cast_weights = False

    def model_state_dict(self):
        return dict.fromkeys(self._keys)

    def add_lora(self, model, rank=4, strength=1.0, seed=0, targets=("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")):
        """A random rank-`rank` LoRA on the target linears of every DiT and refiner block."""
        gen = torch.Generator("cpu").manual_seed(seed)
        for name, w in model.state_dict().items():
            if not any(name.endswith(t + ".weight") for t in targets):
                continue
            up = torch.randn(w.shape[0], rank, generator=gen) * 0.1
            down = torch.randn(rank, w.shape[1], generator=gen) / math.sqrt(w.shape[1])
            self.patches.setdefault(self.prefix + name, []).append((strength, lora_value(up, down, float(rank)), 1.0, None, None))
        self.patches_uuid += 1
        return self

    def set_strength(self, strength):
        self.patches = {k: [(strength, *e[1:]) for e in v] for k, v in self.patches.items()}
        self.patches_uuid += 1
        return self
