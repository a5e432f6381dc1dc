"""Seeded tiny MiniMax H3 models and step inputs covering every conditioning path of the forward.

``run_case(name)`` runs one case through ``comfy.ldm.minimax.model.MiniMaxH3Model`` as the sampler
calls it.
"""

import math
import zlib

import torch
import torch.nn as nn

from comfy.cli_args import args

if not torch.cuda.is_available():
    args.cpu = True

import comfy.ops  # noqa: E402
from comfy.ldm.minimax.controlnet import MiniMaxH3FunControl  # noqa: E402
from comfy.ldm.minimax.model import MiniMaxH3Model  # noqa: E402

SEED = 7
TINY = {"hidden_size": 64, "num_layers": 2, "token_refiner_num_layers": 1, "num_attention_heads": 4,
        "attention_head_dim": 16, "ffn_hidden_size": 96, "text_dim": 48, "timestep_input_dim": 32,
        "time_embed_hidden_size": 64, "time_embed_dim": 32, "rope_inv_freq_len": 2}
PDD_HEADS = 16  # with 8 sampler steps every step spans two heads of the bank

# name -> (model options, input options)
CASES = {
    "t2va": ({}, {}),
    "keyframes_tags": ({}, {"keyframes": True, "tags": True}),
    "refs_all": ({}, {"refs": True}),
    "odd_hw": ({}, {"height": 5, "width": 7}),
    "audio_scale": ({}, {"audio_scale": 0.7}),
    "refined_text": ({}, {"refined_text": True}),
    "curve": ({"curve": 9}, {}),
    "bf16": ({"dtype": "bfloat16"}, {"keyframes": True}),
    "gate_compress": ({"gate_compress": True}, {}),
    "video_mask_binary": ({}, {"video_mask": "binary"}),
    "video_mask_levels": ({}, {"video_mask": "levels"}),
    "video_mask_uniform": ({}, {"video_mask": "uniform"}),
    "video_mask_odd_hw": ({}, {"height": 5, "width": 7, "video_mask": "levels"}),
    "audio_mask": ({}, {"audio_mask": True}),
    "masks_keyframes_scale": ({}, {"keyframes": True, "tags": True, "audio_scale": 0.7, "video_mask": "levels",
                                   "audio_mask": True}),
    "masks_refs_curve": ({"curve": 9}, {"refs": True, "video_mask": "binary", "audio_mask": True}),
    "pdd_first": ({"pdd_heads": PDD_HEADS}, {"step": 0}),
    "pdd_mid": ({"pdd_heads": PDD_HEADS}, {"step": 3, "audio_scale": 0.7}),
    "pdd_mask": ({"pdd_heads": PDD_HEADS}, {"step": 2, "video_mask": "binary", "audio_mask": True}),
    "block_patch": ({}, {"keyframes": True, "block_patch": True}),
    "controlnet": ({}, {"refs": True, "controlnet": True}),
}


def seeded_weights(model, seed=SEED):
    """Weights for every tensor of `model`, each from a generator seeded by its key (order-independent)."""
    out = {}
    for name, t in model.state_dict().items():
        gen = torch.Generator("cpu").manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        module = name.split(".")[-2] if "." in name else ""
        if name.endswith("rope.inv_freq"):
            v = 1.0 / (10000.0 ** (torch.arange(t.shape[0], dtype=torch.float64) / t.shape[0]))
        elif "norm" in module:
            v = 1.0 + 0.1 * torch.randn(t.shape, generator=gen)
        elif t.ndim == 2 and not name.endswith("adaln_t_table"):
            v = torch.randn(t.shape, generator=gen) / math.sqrt(t.shape[1])
        else:
            v = 0.1 * torch.randn(t.shape, generator=gen)
        out[name] = v.to(t.dtype)
    return out


def build_model(model_opts, seed=SEED, operations=comfy.ops.disable_weight_init, **config):
    cfg = dict(TINY, adaln_curve_grid=model_opts.get("curve"), gate_compress=model_opts.get("gate_compress", False), **config)
    dtype = getattr(torch, model_opts.get("dtype", "float32"))
    model = MiniMaxH3Model(**cfg, dtype=dtype, operations=operations).requires_grad_(False)
    if model_opts.get("pdd_heads"):
        # a PDD LoRA's set_weight / set_bias leaves the output heads as a bank of heads
        for lin in (model.final_layer.video_out, model.final_layer.audio_out):
            out_f, in_f = lin.weight.shape
            lin.weight = nn.Parameter(torch.empty(model_opts["pdd_heads"] * out_f, in_f), requires_grad=False)
            lin.bias = nn.Parameter(torch.empty(model_opts["pdd_heads"] * out_f), requires_grad=False)
    model.load_state_dict(seeded_weights(model, seed))
    return own_patch_lists(model)


def own_patch_lists(model):
    # comfy.ops layers start with class-level weight_function / bias_function lists (ModelPatcher
    # assigns its own per layer): give these models their own, so that no other test's append reaches them
    for m in model.modules():
        if hasattr(m, "weight_function"):
            m.weight_function, m.bias_function = [], []
    return model


def sample_sigmas(steps=8, shift=12.0):
    # ComfyUI's simple schedule for a flow model with this shift
    t = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
    return (shift * t / (1.0 + (shift - 1.0) * t)).to(torch.float32)


def video_mask(kind, frames, height, width):
    t, h, w = torch.meshgrid(torch.arange(frames), torch.arange(height), torch.arange(width), indexing="ij")
    if kind == "binary":  # whole 2x2 patches at 0: preserved rows
        m = torch.ones(frames, height, width)
        m[0, 0:2, 0:4] = 0.0
        m[-1, 2:4, 2:6] = 0.0
    elif kind == "levels":  # 3x3 blocks straddle the 2x2 patches
        m = torch.tensor([0.0, 0.25, 0.5, 1.0])[(t + h // 3 + w // 3) % 4]
    else:
        m = torch.full((frames, height, width), 0.5)
    return m[None, None].float()


def case_inputs(name, dtype=torch.float32, seed=SEED):
    """(x, timestep, context, payload, kwargs, transformer_options) of one case; kwargs carry the masks."""
    _, opts = CASES[name]
    frames, height, width = 2, opts.get("height", 4), opts.get("width", 6)
    audio_t, text_len = 5, 7
    gen = torch.Generator("cpu").manual_seed(seed + zlib.crc32(name.encode()))
    c, ca = 24, 32
    video = torch.randn(1, c, frames, height, width, generator=gen)
    audio = torch.randn(1, ca, 2, audio_t, generator=gen)
    width_ctx = TINY["hidden_size"] if opts.get("refined_text") else TINY["text_dim"]
    context = torch.randn(1, text_len, width_ctx, generator=gen).to(dtype)
    options = {}
    sigma = 0.6
    if "step" in opts:
        options["sample_sigmas"] = sample_sigmas()
        sigma = float(options["sample_sigmas"][opts["step"]])
    payload = {"seed": seed + 11, "audio_scale": opts.get("audio_scale", 1.0)}
    lh, lw = height + height % 2, width + width % 2
    if opts.get("tags"):
        tags = torch.ones(text_len, dtype=torch.long)
        tags[1:3] = 0
        tags[-1] = 2
        payload["text_token_tags"] = tags
    if opts.get("keyframes"):
        kfs = [{"resolved_frame_index": 0, "latent": torch.randn(1, c, 1, lh, lw, generator=gen)},
               {"resolved_frame_index": 4, "latent": torch.randn(1, c, 1, lh, lw, generator=gen),
                "audio_latent": torch.randn(1, ca, 2, 2, generator=gen)}]
        payload.update(keyframes=kfs, visual_cond_noise_aug=0.9, audio_cond_noise_aug=0.8,
                       cond_video_latents=[k["latent"] for k in kfs],
                       cond_audio_latents=[k["audio_latent"] for k in kfs if "audio_latent" in k])
    if opts.get("refs"):
        blocks = [{"kind": "image", "latent_h": 4, "latent_w": 6, "latent": torch.randn(1, c, 1, 4, 6, generator=gen)},
                  {"kind": "audio", "ref_audio_t": 3, "audio_latent": torch.randn(1, ca, 2, 3, generator=gen)},
                  {"kind": "video_audio", "latent_t": 2, "latent_h": 2, "latent_w": 4, "ref_audio_t": 4,
                   "latent": torch.randn(1, c, 2, 2, 4, generator=gen),
                   "audio_latent": torch.randn(1, ca, 2, 4, generator=gen)}]
        payload.update(refs=blocks, visual_cond_noise_aug=0.95,
                       cond_video_latents=[b["latent"] for b in blocks if "latent" in b],
                       cond_audio_latents=[b["audio_latent"] for b in blocks if "audio_latent" in b])
    kwargs = {}
    if opts.get("video_mask"):
        kwargs["denoise_mask"] = video_mask(opts["video_mask"], frames, height, width).to(dtype)
    if opts.get("audio_mask"):
        m = torch.ones(1, 1, 2, audio_t)
        m[..., 0:2] = 0.0
        m[0, 0, 0, 2] = 0.5
        kwargs["audio_denoise_mask"] = m.to(dtype)
    if opts.get("controlnet"):
        options["control_latent"] = torch.randn(1, 4, frames, height, width, generator=gen)
    return [video.to(dtype), audio.to(dtype)], torch.tensor([sigma * 1000.0]), context, payload, kwargs, options


def half_attention_patches(model):
    """Block patches that run the original block with an attention of half the block's own output."""
    def patch(args, extra):
        attn = model.blocks[args["transformer_options"]["block_index"]].attn

        def half(h, rope_freqs=None, transformer_options={}):
            return attn(h, rope_freqs=rope_freqs, transformer_options=transformer_options) * 0.5
        return extra["original_block"](dict(args, attention=half))
    return {("double_block", i): patch for i in range(len(model.blocks))}


def controlnet_patches(model, control_latent, strength=0.7, seed=SEED):
    """A Fun ControlNet-Union tower (controlnet.py) driven through double-block patches: its stream
    starts at block 0 and each injection layer adds its hint to the base stream."""
    control = MiniMaxH3FunControl(control_in_dim=control_latent.shape[1], injection_layers=(0, 1), hidden_size=TINY["hidden_size"],
                                  num_attention_heads=TINY["num_attention_heads"], attention_head_dim=TINY["attention_head_dim"],
                                  ffn_hidden_size=TINY["ffn_hidden_size"], time_embed_dim=TINY["time_embed_dim"],
                                  dtype=model.dtype, operations=comfy.ops.disable_weight_init).requires_grad_(False)
    control.load_state_dict(seeded_weights(control, seed + 1))
    own_patch_lists(control).to(control_latent.device)
    state = {}

    def patch(args, extra):
        i = args["transformer_options"]["block_index"]
        if i == 0:
            state["c"] = control.init_stream(args["img"], control_latent, args["layout"], args["t_emb"])
        state["c"], hint = control.step(i, state["c"], args["t_emb"], args["mod_segments"], args["rope_freqs"],
                                        args["transformer_options"])
        return {"img": extra["original_block"](args)["img"] + strength * hint}
    return {("double_block", i): patch for i in control.injection_layers}


def to_device(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    return obj


def run_case(name, seed=SEED, model=None, transformer_options=None, device="cpu"):
    """[video, audio] of one case through MiniMaxH3Model.forward (model and inputs on `device`)."""
    model_opts, opts = CASES[name]
    if model is None:
        model = build_model(model_opts, seed).to(device)
    x, timestep, context, payload, kwargs, options = to_device(case_inputs(name, model.dtype, seed), device)
    if opts.get("block_patch"):
        options["patches_replace"] = {"dit": half_attention_patches(model)}
    if opts.get("controlnet"):
        options["patches_replace"] = {"dit": controlnet_patches(model, options.pop("control_latent"), seed=seed)}
    options.update(transformer_options or {})
    return model(x, timestep, context, options, minimax_payload=payload, **kwargs)
