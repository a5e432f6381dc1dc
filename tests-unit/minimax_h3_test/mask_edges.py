"""Edge denoise masks (all-ones, all-zeros, at the 1 - 1e-3 threshold) on the newer-upstream reference cases.

``edge_inputs`` puts uniform masks on ``upstream_newer.case_inputs``; run as a script with the newer
upstream model.py (as upstream_newer.py) to regenerate ``data/mask_edges_reference.safetensors`` for the
edges whose outputs no hand rule gives.
"""

import json
import logging
import os
import sys

import torch

import upstream_newer as un

DATA = os.path.join(un.HERE, "data", "mask_edges_reference.safetensors")

# name -> (reference case whose model and inputs it reuses, video mask, audio mask); a mask is a value
# for every latent pixel / frame, or "threshold": 0.9995 everywhere but one 2x2 patch at 0.998, which
# puts every row on its own level (0.9995 alone counts as fully generating)
EDGES = {
    "video_ones": ("t2va", 1.0, None),
    "audio_ones": ("t2va", None, 1.0),
    "both_ones": ("t2va", 1.0, 1.0),
    "video_near_one": ("t2va", 0.9995, None),
    "video_zeros": ("t2va", 0.0, None),
    "audio_zeros": ("t2va", None, 0.0),
    "both_zeros_scale": ("audio_scale", 0.0, 0.0),
    "video_threshold": ("t2va", "threshold", None),
}
# outputs taken from the newer upstream file (the others follow from the reference by hand)
GENERATED = ("video_zeros", "audio_zeros", "both_zeros_scale", "video_threshold")

# the reference cases with a denoise mask; the PDD case (pdd_mask) needs the head bank, pdd_heads_test runs it
MASK_CASES = [n for n, (model_opts, opts, _) in un.CASES.items()
              if (opts.get("video_mask") or opts.get("audio_mask")) and not model_opts.get("pdd_heads")]


def edge_inputs(name, dtype=torch.float32):
    """(x, timestep, context, payload, kwargs, transformer_options) of an edge case; kwargs carry the masks."""
    case, video, audio = EDGES[name]
    x, timestep, context, payload, kwargs, options = un.case_inputs(case, dtype)
    _, _, t, h, w = x[0].shape
    if video == "threshold":
        m = torch.full((1, 1, t, h, w), 0.9995)
        m[..., 0, 0:2, 0:2] = 0.998
        kwargs["denoise_mask"] = m.to(dtype)
    elif video is not None:
        kwargs["denoise_mask"] = torch.full((1, 1, t, h, w), float(video), dtype=dtype)
    if audio is not None:
        kwargs["audio_denoise_mask"] = torch.full((1, 1, 2, x[1].shape[-1]), float(audio), dtype=dtype)
    return x, timestep, context, payload, kwargs, options


def check_edge(name, video, audio, tensors, edge_tensors):
    """An edge's outputs against the generated reference, or the unmasked t2va reference by hand."""
    if name in GENERATED:
        un.assert_case_outputs(video, audio, edge_tensors, name)
        return
    # a mask >= 1 - 1e-3 everywhere leaves every row at its stream's timestep; only the velocity is scaled by it
    _, _, _, _, masks, _ = edge_inputs(name)
    want_video, want_audio = tensors["t2va.video"], tensors["t2va.audio"]
    if "denoise_mask" in masks:
        want_video = want_video * masks["denoise_mask"]
    if "audio_denoise_mask" in masks:
        want_audio = want_audio * masks["audio_denoise_mask"]
    un.assert_matches(video, want_video, name)
    un.assert_matches(audio, want_audio, name)


def run_edge(module, name, model=None):
    """(video, audio) of one edge case through `module`'s MiniMaxH3Model.forward."""
    case = EDGES[name][0]
    if model is None:
        model, _ = un.build_model(module, un.CASES[case][0])
    x, timestep, context, payload, kwargs, options = edge_inputs(name, model.dtype)
    return model(x, timestep, context, options, minimax_payload=payload, **kwargs)


def load_reference(path=DATA):
    from safetensors import safe_open
    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, json.loads(f.metadata()["manifest"])


def generate(path, out=DATA):
    from safetensors.torch import save_file
    module = un.load_upstream(path)
    if module.H3_SHA256 != un.REFERENCE["sha256"]:
        raise ValueError(f"{path} has sha256 {module.H3_SHA256}, not {un.REFERENCE['source']}'s {un.REFERENCE['sha256']}")
    tensors = {}
    for name in GENERATED:
        video, audio = run_edge(module, name)
        tensors[f"{name}.video"], tensors[f"{name}.audio"] = video.contiguous(), audio.contiguous()
    manifest = {"reference": un.REFERENCE, "base": un.BASE_COMMIT, "seed": un.SEED, "shims": module.H3_SHIMS,
                "torch": torch.__version__, "edges": {n: list(EDGES[n]) for n in GENERATED},
                "input_digests": {n: un.input_digest(*edge_inputs(n)) for n in GENERATED}}
    save_file(tensors, out, metadata={"manifest": json.dumps(manifest, sort_keys=True)})
    return manifest


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if os.environ.get("COMFYUI_DIR"):
        sys.path.append(os.path.abspath(os.environ["COMFYUI_DIR"]))
    from comfy.cli_args import args as _comfy_args
    _comfy_args.cpu = not torch.cuda.is_available()
    src = sys.argv[1] if len(sys.argv) > 1 else un.upstream_path()
    if not src:
        raise SystemExit(f"usage: mask_edges.py MODEL_PY (or set {un.ENV}); MODEL_PY is {un.REFERENCE['source']}")
    done = generate(src)
    logging.info("wrote %s: %d edge cases from %s", DATA, len(done["edges"]), un.REFERENCE["source"])
