"""StepInputs: one step's inputs, and their wire form (named tensors + a JSON tree) for other ranks.

The wire form is internal. Only what changes the numerics crosses: latents, timestep, context, denoise
masks, the H3 payload minus its prebuilt layout (every rank rebuilds it) and the sigma shifts and schedule;
what cannot be sent, and options that would run on rank 0's rows only, are refused by name.
"""

from dataclasses import dataclass, field

import torch

STEP_IO_VERSION = 4
TENSOR_TAG = "__tensor__"
SHIFT_KEYS = ("minimax_h3_sigma_shift_video", "minimax_h3_sigma_shift_audio")
SAMPLE_SIGMAS = "sample_sigmas"  # the sampler's schedule: PDD head banks pick their heads by it
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


def _sent_options(options):
    sent = {k: float(options[k]) for k in SHIFT_KEYS if k in options}
    if options.get(SAMPLE_SIGMAS) is not None:
        sent[SAMPLE_SIGMAS] = options[SAMPLE_SIGMAS]
    return sent


@dataclass
class StepInputs:
    """One step's inputs, as ``MiniMaxH3Model.forward`` takes them (the audio stream un-carried).

    video [1, C, T, H, W] (not yet padded to the patch size), audio [1, C, 2, T], timestep [1]
    (sigma * 1000), context [1, L, text_dim or hidden], payload (``minimax_payload``), options
    (``transformer_options``), denoise masks (1 = generate) video [1, 1, T, H, W] and audio
    [1, 1, 2, T] or None.
    """
    video: torch.Tensor
    audio: torch.Tensor
    timestep: torch.Tensor
    context: torch.Tensor
    payload: dict = field(default_factory=dict)
    options: dict = field(default_factory=dict)
    denoise_mask: torch.Tensor = None
    audio_denoise_mask: torch.Tensor = None

    def encode(self):
        """-> (tensors {name: Tensor}, meta JSON tree) for ``decode`` on another rank."""
        check_replicable_options(self.options)
        tensors = {}
        sent = {k: v for k, v in self.payload.items() if k not in DROPPED_PAYLOAD_KEYS}
        meta = {"version": STEP_IO_VERSION,
                "video": _encode(self.video, "x[0]", tensors), "audio": _encode(self.audio, "x[1]", tensors),
                "timestep": _encode(self.timestep, "timestep", tensors), "context": _encode(self.context, "context", tensors),
                "payload": _encode(sent, "minimax_payload", tensors),
                "denoise_mask": _encode(self.denoise_mask, "denoise_mask", tensors),
                "audio_denoise_mask": _encode(self.audio_denoise_mask, "audio_denoise_mask", tensors),
                "options": _encode(_sent_options(self.options), "transformer_options", tensors)}
        return tensors, meta

    @classmethod
    def decode(cls, tensors, meta):
        if meta.get("version") != STEP_IO_VERSION:
            raise ValueError(f"step inputs have version {meta.get('version')!r}, this rank understands {STEP_IO_VERSION}: "
                             "all ranks must run the same ComfyUI code")
        unknown = sorted(set(meta["options"]) - {*SHIFT_KEYS, SAMPLE_SIGMAS})
        if unknown:
            raise ValueError(f"step inputs carry unknown options {unknown}")
        d = lambda key: _decode(meta[key], tensors)
        return cls(d("video"), d("audio"), d("timestep"), d("context"), d("payload"), d("options"),
                   d("denoise_mask"), d("audio_denoise_mask"))
