"""Newer upstream H3 (comfy/ldm/minimax/model.py after 0f1fa67) run against the pinned base, for parity data.

``load_upstream`` execs a newer upstream model.py with shims for the few core names 0f1fa67 lacks (no
upstream code is kept in this repository); ``run_case`` runs one seeded tiny-model case. Run as a script
with the newer file's path to regenerate ``data/upstream_newer_reference.safetensors``.
"""

import builtins
import hashlib
import importlib.util
import json
import logging
import math
import os
import sys
import types
import zlib

import torch
import torch.nn as nn

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data", "upstream_newer_reference.safetensors")
ENV = "H3_UPSTREAM_NEWER"
# the git-ignored spot a checkout keeps the file in (see /tmp/issue19_facts.md, "Getting the file")
DEFAULT_PATH = os.path.join(HERE, "..", "..", ".comfyui", "upstream-newer", "zoidypuh-ComfyUI-f737b1d5", "model.py")
REFERENCE = {
    "source": "zoidypuh/ComfyUI@f737b1d5fe4f44cb5bc1b9d0414a8c49cf0ed8e8:comfy/ldm/minimax/model.py",
    "sha256": "8e4cdda6ffd6994baa29085fb6d6a826a399ed094f0ec8e85387083877a4d518",
    "chars": 40670,
}
BASE_COMMIT = "0f1fa67ad8a68b62c65ebc97a7bf485df2459c3a"
FORMAT = 1
SEED = 7

TINY = {"hidden_size": 64, "num_layers": 2, "token_refiner_num_layers": 1, "num_attention_heads": 4,
        "attention_head_dim": 16, "ffn_hidden_size": 96, "text_dim": 48, "timestep_input_dim": 32,
        "time_embed_hidden_size": 64, "time_embed_dim": 32, "rope_inv_freq_len": 2}
SHIFTS = (12.0, 3.0)
PDD_HEADS = 16  # with 8 sampler steps every step spans two heads of the bank

# name -> (model options, input options, unchanged); "unchanged" cases exercise nothing the newer file
# changed, so upstream at the pinned base must produce the same numbers
CASES = {
    "t2va": ({}, {}, True),
    "keyframes_tags": ({}, {"keyframes": True, "tags": True}, True),
    "refs_all": ({}, {"refs": True}, True),
    "odd_hw": ({}, {"height": 5, "width": 7}, True),
    "audio_scale": ({}, {"audio_scale": 0.7}, True),
    "curve": ({"curve": 9}, {}, True),
    "bf16": ({"dtype": "bfloat16"}, {}, True),
    "vsa_gate": ({"gate_compress": True}, {"inputs_of": "t2va"}, True),
    "video_mask_binary": ({}, {"video_mask": "binary"}, False),
    "video_mask_levels": ({}, {"video_mask": "levels"}, False),
    "video_mask_uniform": ({}, {"video_mask": "uniform"}, False),
    "video_mask_odd_hw": ({}, {"height": 5, "width": 7, "video_mask": "levels"}, False),
    "audio_mask": ({}, {"audio_mask": True}, False),
    "masks_keyframes_scale": ({}, {"keyframes": True, "tags": True, "audio_scale": 0.7, "video_mask": "levels",
                                   "audio_mask": True}, False),
    "masks_refs_curve": ({"curve": 9}, {"refs": True, "video_mask": "binary", "audio_mask": True}, False),
    "masks_bf16": ({"dtype": "bfloat16"}, {"video_mask": "binary", "audio_mask": True}, False),
    "pdd_first": ({"pdd_heads": PDD_HEADS}, {"step": 0}, False),
    "pdd_mid": ({"pdd_heads": PDD_HEADS}, {"step": 3, "audio_scale": 0.7}, False),
    "pdd_last": ({"pdd_heads": PDD_HEADS}, {"step": 7}, False),
    "pdd_mask": ({"pdd_heads": PDD_HEADS}, {"step": 2, "video_mask": "binary", "audio_mask": True}, False),
    "block_hook": ({}, {"keyframes": True, "hook": True}, False),
}


# -- loading a newer model.py against the pinned base ---------------------------------------------

class ComfyAttention(nn.Module):
    """Stand-in for the per-module attention preference newer cores load from checkpoint metadata.

    Without a stored config it has no state and selects nothing, which is what the newer core's does
    for every checkpoint that carries no ``*.comfy_attention.config`` key (all H3 releases)."""
    function = None
    config = None


def _prefetch_shim(real):
    """comfy.model_prefetch as the newer file calls it. 0f1fa67 has no model compiler: malloc graphs are
    never enabled (newer cores also disable them off CUDA), so malloc scopes have nothing to scope."""
    def malloc_graph_enabled(device):
        return False

    def unreachable(*args, **kwargs):
        raise RuntimeError("malloc graphs are never enabled on the pinned base")

    def prefetch_queue_pop(queue, device, module, *args, malloc_scope=None, **kwargs):
        return real.prefetch_queue_pop(queue, device, module, *args, **kwargs)

    shim = types.ModuleType("comfy.model_prefetch")
    shim.__dict__.update({k: v for k, v in vars(real).items() if not k.startswith("__")})
    if not hasattr(real, "malloc_graph_enabled"):
        shim.malloc_graph_enabled = malloc_graph_enabled
        shim.malloc_graph_begin = shim.malloc_graph_end = unreachable
        shim.prefetch_queue_pop = prefetch_queue_pop
    return shim


class _Proxy(types.ModuleType):
    """A module whose own attributes win and the rest come from the real module."""

    def __init__(self, real, **overrides):
        super().__init__(real.__name__)
        self._real = real
        self.__dict__.update(overrides)

    def __getattr__(self, name):
        return getattr(self._real, name)


def load_upstream(path):
    """Exec an upstream H3 model.py against the ComfyUI on sys.path; shims fill only names it lacks.

    Returns the module; ``module.H3_SHIMS`` lists the shims that were needed. Nothing global is patched:
    the shims live in the module's own import function.
    """
    import comfy
    import comfy.ldm.modules.attention as attention
    import comfy.model_prefetch

    shims = []
    attention_names = {}
    if not hasattr(attention, "ComfyAttention"):
        attention_names["ComfyAttention"] = ComfyAttention
        shims.append("comfy.ldm.modules.attention.ComfyAttention")
    prefetch = _prefetch_shim(comfy.model_prefetch)
    if prefetch.prefetch_queue_pop is not comfy.model_prefetch.prefetch_queue_pop:
        shims += ["comfy.model_prefetch.malloc_graph_enabled/begin/end", "comfy.model_prefetch.prefetch_queue_pop(malloc_scope=)"]
    comfy_proxy = _Proxy(comfy, model_prefetch=prefetch)
    attention_proxy = _Proxy(attention, **attention_names)

    def _import(name, globals=None, locals=None, fromlist=(), level=0):
        module = builtins.__import__(name, globals, locals, fromlist, level)
        if level == 0 and name == "comfy.ldm.modules.attention" and fromlist:
            return attention_proxy
        if level == 0 and (name == "comfy" or name.startswith("comfy.")) and not fromlist:
            return comfy_proxy
        return module

    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    spec = importlib.util.spec_from_file_location(f"h3_upstream_{digest[:12]}", path)
    module = importlib.util.module_from_spec(spec)
    module.__dict__["__builtins__"] = dict(vars(builtins), __import__=_import)
    spec.loader.exec_module(module)
    module.H3_SHIMS = shims
    module.H3_SHA256 = digest
    return module


# -- seeded tiny models and inputs ------------------------------------------------------------------

def weights_from_spec(spec, seed=SEED):
    """Seeded weights for [(name, shape, dtype)], each key from its own generator (order-independent,
    so any implementation with these key names gets the same numbers)."""
    out = {}
    for name, shape, dtype in spec:
        gen = torch.Generator("cpu").manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        module = name.split(".")[-2] if "." in name else ""
        if name.endswith("rope.inv_freq"):
            n = shape[0]
            v = 1.0 / (10000.0 ** (torch.arange(n, dtype=torch.float64) / n))
        elif "norm" in module:
            v = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif len(shape) == 2 and not name.endswith("adaln_t_table"):
            v = torch.randn(shape, generator=gen) / math.sqrt(shape[1])
        else:
            v = 0.1 * torch.randn(shape, generator=gen)
        out[name] = v.to(getattr(torch, dtype))
    return out


def state_spec(model):
    return [(k, list(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in model.state_dict().items()]


def install_pdd_bank(model, heads):
    """Give the final layer a bank of `heads` output heads, [heads*out, in], as a PDD LoRA's set_weight /
    set_bias of another shape leaves it after ComfyUI's patcher applies it."""
    for lin in (model.final_layer.video_out, model.final_layer.audio_out):
        out_f, in_f = lin.weight.shape
        lin.weight = nn.Parameter(torch.empty(heads * out_f, in_f, dtype=lin.weight.dtype), requires_grad=False)
        lin.bias = nn.Parameter(torch.empty(heads * out_f, dtype=lin.bias.dtype), requires_grad=False)


def build_model(module, model_opts, seed=SEED, drop=()):
    """(model, weights) of `module`'s MiniMaxH3Model at the tiny config with seeded weights."""
    import comfy.ops
    cfg = dict(TINY, adaln_curve_grid=model_opts.get("curve"))
    if model_opts.get("gate_compress"):
        cfg["gate_compress"] = True
    dtype = getattr(torch, model_opts.get("dtype", "float32"))
    model = module.MiniMaxH3Model(**cfg, dtype=dtype, operations=comfy.ops.disable_weight_init).requires_grad_(False)
    if model_opts.get("pdd_heads"):
        install_pdd_bank(model, model_opts["pdd_heads"])
    weights = weights_from_spec([s for s in state_spec(model) if s[0] not in drop], seed)
    model.load_state_dict(weights)
    return model, weights


def ours():
    """This package's model, as ``build_model`` / ``run_case`` take a model module."""
    from comfy.ldm.minimax_h3.model import MiniMaxH3Model
    return types.SimpleNamespace(MiniMaxH3Model=MiniMaxH3Model)


def sample_sigmas(steps=8, shift=SHIFTS[0]):
    """ComfyUI's `simple` schedule for a flow model with this shift: shift-mapped linspace(1, 0)."""
    t = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
    return (shift * t / (1.0 + (shift - 1.0) * t)).to(torch.float32)


def _video_mask(kind, frames, height, width):
    """[1, 1, T, H, W] denoise mask (1 = generate) at the latent grid, as model_base hands it over."""
    t, h, w = torch.meshgrid(torch.arange(frames), torch.arange(height), torch.arange(width), indexing="ij")
    if kind == "binary":  # whole 2x2 patches at 0: preserved rows
        m = torch.ones(frames, height, width)
        m[0, 0:2, 0:4] = 0.0
        m[-1, 2:4, 2:6] = 0.0
    elif kind == "levels":  # 3x3 blocks straddle the 2x2 patches, so pooling takes the block maxima
        levels = torch.tensor([0.0, 0.25, 0.5, 1.0])
        m = levels[(t + h // 3 + w // 3) % 4]
    elif kind == "uniform":
        m = torch.full((frames, height, width), 0.5)
    else:
        raise ValueError(f"unknown video mask kind {kind!r}")
    return m[None, None].float()


def _audio_mask(audio_t):
    """[1, 1, 2, T]: the first two latent frames preserved, channel 0 of frame 2 half-strength."""
    m = torch.ones(1, 1, 2, audio_t)
    m[..., 0:2] = 0.0
    m[0, 0, 0, 2] = 0.5
    return m


def case_inputs(name, dtype=torch.float32, seed=SEED):
    """(x, timestep, context, payload, kwargs, transformer_options) of one case; kwargs carry the masks."""
    _, opts, _ = CASES[name]
    frames, height, width = 2, opts.get("height", 4), opts.get("width", 6)
    audio_t, text_len = 5, 7
    gen = torch.Generator("cpu").manual_seed(seed + zlib.crc32(opts.get("inputs_of", name).encode()))
    c, ca = 24, 32
    video = torch.randn(1, c, frames, height, width, generator=gen)
    audio = torch.randn(1, ca, 2, audio_t, generator=gen)
    context = torch.randn(1, text_len, TINY["text_dim"], generator=gen).to(dtype)
    options = {}
    if "step" in opts:
        sigmas = sample_sigmas()
        sigma = float(sigmas[opts["step"]])
        options["sample_sigmas"] = sigmas
    else:
        sigma = 0.6
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
    # _apply_model's convert_tensor casts float extra conds, the masks included, to the model dtype
    if opts.get("video_mask"):
        kwargs["denoise_mask"] = _video_mask(opts["video_mask"], frames, height, width).to(dtype)
    if opts.get("audio_mask"):
        kwargs["audio_denoise_mask"] = _audio_mask(audio_t).to(dtype)
    timestep = torch.tensor([sigma * 1000.0])
    # _apply_model hands the model its latents at the compute dtype; the payload skips that cast
    return [video.to(dtype), audio.to(dtype)], timestep, context, payload, kwargs, options


def input_digest(x, timestep, context, payload, kwargs, options):
    h = hashlib.sha256()

    def add(v):
        if torch.is_tensor(v):
            h.update(repr((tuple(v.shape), str(v.dtype))).encode())
            h.update(v.detach().float().contiguous().numpy().tobytes())
        elif isinstance(v, dict):
            for k in sorted(v):
                h.update(k.encode())
                add(v[k])
        elif isinstance(v, (list, tuple)):
            for item in v:
                add(item)
        else:
            h.update(repr(v).encode())
    for part in (x, timestep, context, payload, kwargs, options):
        add(part)
    return h.hexdigest()


def weights_digest(weights):
    h = hashlib.sha256()
    for k in sorted(weights):
        h.update(k.encode() + repr(tuple(weights[k].shape)).encode())
        h.update(weights[k].float().contiguous().numpy().tobytes())
    return h.hexdigest()


def _attention_hook(model, seen):
    """A block patch using the newer hooks: it reads args["layout"] / block_index / minimax_h3_layout
    and runs the original block with an `attention=` that halves the block's own attention output."""
    def patch(args, extra):
        opts = args["transformer_options"]
        seen.append({"block_index": opts["block_index"], "arg_keys": sorted(args),
                     "layout_segments": [list(s) for s in args["layout"].segments],
                     "options_layout_is_args_layout": opts.get("minimax_h3_layout") is args["layout"]})
        attn = model.blocks[opts["block_index"]].attn

        def half(h, rope_freqs=None, transformer_options={}):
            return attn(h, rope_freqs=rope_freqs, transformer_options=transformer_options) * 0.5
        return extra["original_block"](dict(args, attention=half))
    return {"patches_replace": {"dit": {("double_block", i): patch for i in range(TINY["num_layers"])}}}


def run_case(module, name, seed=SEED, model=None):
    """(video, audio, observations) of one case through `module`'s MiniMaxH3Model.forward."""
    model_opts, opts, _ = CASES[name]
    if model is None:
        model, _ = build_model(module, model_opts, seed)
    x, timestep, context, payload, kwargs, options = case_inputs(name, model.dtype, seed)
    seen = []
    if opts.get("hook"):
        options.update(_attention_hook(model, seen))
    video, audio = model(x, timestep, context, options, minimax_payload=payload, **kwargs)
    return video, audio, {"hook_calls": seen} if seen else {}


# -- the stored reference ---------------------------------------------------------------------------

def model_key(model_opts):
    return json.dumps(model_opts, sort_keys=True)


def load_reference(path=DATA):
    """(tensors, manifest) of the committed reference outputs."""
    from safetensors import safe_open
    with safe_open(path, "pt") as f:
        manifest = json.loads(f.metadata()["manifest"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return tensors, manifest


def upstream_path():
    """The newer upstream model.py to check against, or None: $H3_UPSTREAM_NEWER, else DEFAULT_PATH."""
    path = os.environ.get(ENV) or DEFAULT_PATH
    return os.path.abspath(path) if os.path.isfile(path) else None


def upstream_or_skip():
    """The newer upstream module (``load_upstream`` of ``upstream_path()``), checked to be the reference's
    file; skips the calling test, naming where to put that file, when there is none."""
    import pytest
    path = upstream_path()
    if path is None:
        pytest.skip(f"no newer upstream model.py: set {ENV} to {REFERENCE['source']} "
                    f"(or put it at {os.path.normpath(DEFAULT_PATH)}) to re-run it against the reference")
    module = load_upstream(path)
    assert module.H3_SHA256 == REFERENCE["sha256"], (
        f"{path} is not {REFERENCE['source']} (sha256 {module.H3_SHA256}); point {ENV} at that file, "
        "or regenerate the data with upstream_newer.py after updating REFERENCE")
    return module


def generate(path, out=DATA):
    """Run every case through the upstream file at `path` and write the reference file."""
    from safetensors.torch import save_file
    module = load_upstream(path)
    if module.H3_SHA256 != REFERENCE["sha256"]:
        raise ValueError(f"{path} has sha256 {module.H3_SHA256}, not the reference's {REFERENCE['sha256']} "
                         f"({REFERENCE['source']}); update REFERENCE when moving to another upstream version")
    tensors, cases, models = {}, {}, {}
    for name, (model_opts, opts, unchanged) in CASES.items():
        model, weights = build_model(module, model_opts)
        video, audio, seen = run_case(module, name, model=model)
        tensors[f"{name}.video"] = video.contiguous()
        tensors[f"{name}.audio"] = audio.contiguous()
        key = model_key(model_opts)
        models[key] = {"options": model_opts, "spec": state_spec(model), "weights_digest": weights_digest(weights)}
        cases[name] = {"model": key, "inputs": opts, "unchanged": unchanged,
                       "input_digest": input_digest(*case_inputs(name, model.dtype)), **seen}
    manifest = {"format": FORMAT, "reference": REFERENCE, "base": BASE_COMMIT, "seed": SEED, "config": TINY,
                "shifts": list(SHIFTS), "pdd_heads": PDD_HEADS, "shims": module.H3_SHIMS, "torch": torch.__version__,
                "models": models, "cases": cases}
    save_file(tensors, out, metadata={"manifest": json.dumps(manifest, sort_keys=True)})
    return manifest


def assert_matches(got, want, name):
    """One output against the stored reference: fp32 to 1e-5 (bit-equal on one machine; another CPU's
    BLAS may reorder sums), bf16 to its rounding."""
    tol = {"atol": 1e-2, "rtol": 1.6e-2} if want.dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 0.0}
    assert got.shape == want.shape and got.dtype == want.dtype, f"{name}: {got.shape}/{got.dtype} vs {want.shape}/{want.dtype}"
    torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{name}: {m}")


def assert_case_outputs(video, audio, tensors, name):
    """A case's video and audio outputs against ``tensors[f"{name}.video"]`` / ``[f"{name}.audio"]``."""
    assert_matches(video, tensors[f"{name}.video"], name)
    assert_matches(audio, tensors[f"{name}.audio"], name)


def assert_ranks_match(results, tensors, names):
    """Per-rank results of ``rank_steps.run_cases``: rank 0's outputs equal the reference and every rank
    built the same plan (equal digests)."""
    for name in names:
        assert_case_outputs(results[0][f"{name}.video"], results[0][f"{name}.audio"], tensors, name)
        assert len({r["digests"][name] for r in results}) == 1, f"{name}: ranks planned differently"


# -- fp16 trouble spots (the fp32 residual under fp16 compute) ----------------------------------------

# weight scales that give the tiny model the full-size model's fp16 trouble spots (measured in fp32 on
# t2va: residual peak ~1.1e6, attention out_proj ~9e4, fc2 ~3.7e5; fp16 ends at 65504)
LOUD = {"patch_proj": 3e5, "attn.out_proj.weight": 6e4, "mlp.fc2.weight": 1e5}


def loud_weights():
    """Tiny-model weights with the full-size model's fp16 trouble spots (``LOUD``)."""
    _, weights = build_model(ours(), {})
    for key in weights:
        for part, scale in LOUD.items():
            # the DiT blocks' branches only: the token refiner keeps an fp16 residual
            if part in key and (part == "patch_proj" or key.startswith("blocks.")):
                weights[key] = weights[key] * scale
    return weights


def loud_model(module, dtype):
    """`module`'s MiniMaxH3Model computing in `dtype` on ``loud_weights``."""
    import comfy.ops
    model = module.MiniMaxH3Model(**TINY, dtype=dtype, operations=comfy.ops.disable_weight_init).requires_grad_(False)
    model.load_state_dict(loud_weights())
    return model


def half(x, context):
    """(x, context) of a case in fp16."""
    return [x[0].half(), x[1].half()], context.half()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    comfyui = os.environ.get("COMFYUI_DIR")
    if comfyui:
        sys.path.append(os.path.abspath(comfyui))
    from comfy.cli_args import args as _comfy_args
    _comfy_args.cpu = not torch.cuda.is_available()
    src = sys.argv[1] if len(sys.argv) > 1 else upstream_path()
    if not src:
        raise SystemExit(f"usage: upstream_newer.py MODEL_PY (or set {ENV}); MODEL_PY is {REFERENCE['source']}")
    done = generate(src)
    logging.info("wrote %s: %d cases from %s (shims: %s)", DATA, len(done["cases"]), REFERENCE["source"], done["shims"])
