"""Build an H3 model from a safetensors checkpoint, and the LoaderSpec that lets another process
build the very same base model (path + content hash + config + dtype), as JSON.
"""

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field

import torch
from safetensors import safe_open

from .model import MiniMaxH3Model

KEY_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _count(keys, pattern):
    idx = {int(m.group(1)) for k in keys for m in [re.match(pattern, k)] if m}
    return max(idx) + 1 if idx else 0


def detect_config(shapes):
    """H3 constructor arguments from {key: shape} of a checkpoint (prefix already stripped)."""
    missing = [k for k in ("video_patch_proj.weight", "audio_patch_proj.weight", "blocks.0.attn.q_norm.weight",
                           "blocks.0.attn.qkv_proj.weight", "condition_proj.weight", "rope.inv_freq") if k not in shapes]
    if missing:
        raise ValueError(f"not a MiniMax H3 checkpoint: missing {missing}")
    keys = list(shapes)
    head_dim = shapes["blocks.0.attn.q_norm.weight"][0]
    cfg = {"num_layers": _count(keys, r"blocks\.(\d+)\."),
           "token_refiner_num_layers": _count(keys, r"token_refiner\.blocks\.(\d+)\."),
           "hidden_size": shapes["video_patch_proj.weight"][0],
           "latents_dim": shapes["video_patch_proj.weight"][1] // 4,
           "audio_latents_dim": shapes["audio_patch_proj.weight"][1],
           "attention_head_dim": head_dim,
           "num_attention_heads": shapes["blocks.0.attn.qkv_proj.weight"][0] // (3 * head_dim),
           "ffn_hidden_size": shapes["blocks.0.mlp.fc2.weight"][1],
           "text_dim": shapes["condition_proj.weight"][1],
           "rope_inv_freq_len": shapes["rope.inv_freq"][0]}
    if "adaln_t_table" in shapes:
        cfg["adaln_curve_grid"], cfg["time_embed_dim"] = shapes["adaln_t_table"]
    else:
        cfg["time_embed_hidden_size"], cfg["timestep_input_dim"] = shapes["time_embedder.proj_in.weight"]
        cfg["time_embed_dim"] = shapes["time_embedder.proj_out.weight"][0]
    return cfg


def file_sha256(path, chunk=1 << 24):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _prefix(keys):
    for p in KEY_PREFIXES:
        if p + "video_patch_proj.weight" in keys:
            return p
    raise ValueError("not a MiniMax H3 checkpoint: no video_patch_proj.weight under any of the prefixes "
                     f"{[p for p in KEY_PREFIXES if p]} or at the top level")


def _header(f):
    """(key prefix, {stripped key: shape}) of an open safetensors file, from its header only."""
    prefix = _prefix(set(f.keys()))
    return prefix, {k[len(prefix):]: tuple(f.get_slice(k).get_shape()) for k in f.keys() if k.startswith(prefix)}


def load_checkpoint(path, dtype=torch.bfloat16, device="cpu", operations=None, sha256=None, config=None):
    """A frozen MiniMaxH3Model with every tensor of the checkpoint at `path` loaded strictly."""
    if sha256 is not None:
        found = file_sha256(path)
        if found != sha256:
            raise ValueError(f"checkpoint {path} has sha256 {found}, expected {sha256}: the file changed since the "
                             "LoaderSpec was made; rebuild the spec from the file the main process loaded")
    with safe_open(path, framework="pt", device="cpu") as f:
        prefix, shapes = _header(f)
        cfg = dict(config) if config is not None else detect_config(shapes)
        model = MiniMaxH3Model(**cfg, dtype=dtype, device=device, operations=operations)
        want = model.state_dict()
        missing = sorted(set(want) - set(shapes))
        unexpected = sorted(set(shapes) - set(want))
        if missing or unexpected:
            raise ValueError(f"checkpoint {path} does not match the H3 config {cfg}: missing {missing}, unexpected "
                             f"{unexpected}. Use the checkpoint's own config (leave config=None to detect it).")
        # one tensor at a time: host memory never holds more than the largest tensor
        with torch.no_grad():
            for k, t in want.items():
                src = f.get_tensor(prefix + k)
                if src.shape != t.shape:
                    raise ValueError(f"checkpoint {path}: {k} has shape {tuple(src.shape)}, the config {cfg} needs {tuple(t.shape)}")
                t.copy_(src)
    return model.requires_grad_(False).eval()


@dataclass(frozen=True)
class LoaderSpec:
    """Everything a worker needs to build the same base model; JSON on the wire."""
    path: str
    sha256: str
    config: dict = field(default_factory=dict)
    dtype: str = "bfloat16"

    def __post_init__(self):
        if self.dtype not in _DTYPES:
            raise ValueError(f"LoaderSpec dtype {self.dtype!r} is not one of {sorted(_DTYPES)}")

    @classmethod
    def for_file(cls, path, dtype="bfloat16"):
        with safe_open(path, framework="pt", device="cpu") as f:
            _, shapes = _header(f)
        return cls(path=str(path), sha256=file_sha256(path), config=detect_config(shapes), dtype=dtype)

    def to_json(self):
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text):
        d = json.loads(text)
        extra = sorted(set(d) - {"path", "sha256", "config", "dtype"})
        if extra:
            raise ValueError(f"LoaderSpec has unknown fields {extra}")
        return cls(**d)

    def load(self, device="cpu", operations=None):
        return load_checkpoint(self.path, dtype=_DTYPES[self.dtype], device=device, operations=operations,
                               sha256=self.sha256, config=self.config)
