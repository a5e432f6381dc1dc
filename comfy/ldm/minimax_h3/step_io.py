"""One step's inputs as named tensors + a JSON tree, so rank 0 can hand them to every rank. Internal.

Only what changes the numerics crosses: the latents, timestep, context, the H3 payload (tags,
keyframes, references, augmentation levels, seed) and the sigma-shift overrides. The prebuilt
layout is dropped (every rank rebuilds it from the same inputs). Anything else in the payload that
is not a tensor, number, string, bool, None, list or dict is refused by name, as are
transformer_options entries that would have to run on every rank but cannot be sent there.
"""

import torch

STEP_IO_VERSION = 1
TENSOR_TAG = "__tensor__"
SHIFT_KEYS = ("minimax_h3_sigma_shift_video", "minimax_h3_sigma_shift_audio")
DROPPED_PAYLOAD_KEYS = ("layout",)


def _encode(obj, path, tensors):
    if isinstance(obj, torch.Tensor):
        name = f"t{len(tensors)}"
        tensors[name] = obj
        return {TENSOR_TAG: name}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, (list, tuple)):
        return [_encode(v, f"{path}[{i}]", tensors) for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        bad = [k for k in obj if not isinstance(k, str)]
        if bad:
            raise TypeError(f"{path} has non-string keys {bad!r}; only string keys can be sent to other ranks")
        if TENSOR_TAG in obj:
            raise TypeError(f"{path} uses the reserved key {TENSOR_TAG!r}")
        return {k: _encode(v, f"{path}.{k}", tensors) for k, v in obj.items()}
    raise TypeError(f"{path} is a {type(obj).__name__}, which cannot be sent to other ranks; "
                    "sequence-parallel H3 only carries tensors, numbers, strings, lists and dicts in minimax_payload")


def _decode(obj, tensors):
    if isinstance(obj, dict):
        if set(obj) == {TENSOR_TAG}:
            return tensors[obj[TENSOR_TAG]]
        return {k: _decode(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    return obj


def check_replicable_options(transformer_options):
    """Refuse options that change every rank's numerics but exist only on rank 0."""
    problems = []
    replaced = sorted(str(k) for k in transformer_options.get("patches_replace", {}).get("dit", {}))
    if replaced:
        problems.append(f"block replacement patches {replaced} (patches_replace['dit'])")
    if problems:
        raise ValueError("MiniMax H3 sequence parallelism cannot run " + " and ".join(problems) +
                         ": they would run on rank 0's rows only. Remove them or run on one GPU.")


def encode_step(x, timestep, context, payload, transformer_options):
    """-> (tensors {name: Tensor}, meta JSON tree)."""
    check_replicable_options(transformer_options)
    tensors = {}
    sent = {k: v for k, v in (payload or {}).items() if k not in DROPPED_PAYLOAD_KEYS}
    meta = {"version": STEP_IO_VERSION,
            "video": _encode(x[0], "x[0]", tensors), "audio": _encode(x[1], "x[1]", tensors),
            "timestep": _encode(timestep, "timestep", tensors), "context": _encode(context, "context", tensors),
            "payload": _encode(sent, "minimax_payload", tensors),
            "options": {k: float(transformer_options[k]) for k in SHIFT_KEYS if k in transformer_options}}
    return tensors, meta


def decode_step(tensors, meta):
    """-> (video, audio, timestep, context, payload, transformer_options)."""
    if meta.get("version") != STEP_IO_VERSION:
        raise ValueError(f"step inputs have version {meta.get('version')!r}, this rank understands {STEP_IO_VERSION}: "
                         "all ranks must run the same ComfyUI code")
    unknown = sorted(set(meta["options"]) - set(SHIFT_KEYS))
    if unknown:
        raise ValueError(f"step inputs carry unknown options {unknown}")
    d = lambda key: _decode(meta[key], tensors)
    return d("video"), d("audio"), d("timestep"), d("context"), d("payload"), dict(meta["options"])
