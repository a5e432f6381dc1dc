"""MiniMax H3 Sequence Parallel: run an H3 model's denoising steps sharded over several GPUs.

The node attaches a SequenceParallel runner to a clone of the model. Workers belong to the base
model and the device list: they start, and take the patch state of the patcher that samples (any
LoRA loaders downstream included), while rank 0 loads that patcher (PREPARE_SAMPLING), and every
rank has acked it before the first step (ON_PRE_RUN); new seeds and LoRA edits reuse them. They end
when ComfyUI unloads the model or frees it.
"""

import logging
import sys
import weakref

import torch

import comfy.model_management
import comfy.patcher_extension
from comfy.ldm.minimax.model import MiniMaxH3Model
from comfy.ldm.minimax_h3.sequence_parallel import SequenceParallel, loader_call
from comfy_api.latest import ComfyExtension, io

# base model (shared by every clone of it) -> {devices: SequenceParallel}
_RUNNERS = weakref.WeakKeyDictionary()


def devices_from_text(text):
    """'auto' -> every device ComfyUI sees; else a comma list such as 'cuda:0,cuda:1' (or 'cpu,cpu' on a CPU run)."""
    text = text.strip()
    if text == "auto":
        devices = [str(d) for d in comfy.model_management.get_all_torch_devices()]
        if len(devices) < 2:
            raise ValueError(f"'auto' found {len(devices)} device(s) ({', '.join(devices) or 'none'}); sequence "
                             "parallelism needs at least 2 GPUs. List devices explicitly, e.g. 'cuda:0,cuda:1'")
        return devices
    devices = [torch.device(d.strip()) for d in text.split(",") if d.strip()]
    if len(devices) < 2:
        raise ValueError(f"devices {text!r} names {len(devices)} device(s); give at least 2, e.g. 'cuda:0,cuda:1'")
    found = torch.cuda.device_count()
    missing = [str(d) for d in devices if d.type == "cuda" and (d.index or 0) >= found]
    if missing:
        raise ValueError(f"devices {', '.join(missing)} do not exist: this machine has {found} CUDA GPU(s)"
                         + (f" (cuda:0 to cuda:{found - 1})" if found else "") + "; list only GPUs it has")
    return [str(d) for d in devices]


def runner_for(model, devices):
    """The SequenceParallel of ``model``'s base model on ``devices``, made on first use."""
    base = model.model
    runners = _RUNNERS.setdefault(base, {})
    key = tuple(devices)
    if key not in runners:
        sp = runners[key] = SequenceParallel(devices, loader_call(model))
        weakref.finalize(base, sp.close)
    return runners[key]


def refuse_multigpu_clones(model):
    # MultiGPU CFG Split runs cond units in threads on full model copies; those would share this
    # process's one torch.distributed group with the sharded steps
    if model.get_additional_models_with_key("multigpu"):
        raise ValueError("MiniMax H3 Sequence Parallel cannot be combined with MultiGPU CFG Split on the same model: "
                         "remove one of the two nodes (sequence parallelism already uses every listed GPU for each "
                         "cond and uncond step)")


def attach(model, devices):
    """A clone of ``model`` whose H3 steps run on ``devices`` (rank 0 = this process, devices[0])."""
    if not sys.platform.startswith("linux"):
        raise RuntimeError(f"MiniMax H3 Sequence Parallel runs on Linux only (this is {sys.platform}): its workers "
                           "inherit private pipes and use NCCL")
    diffusion = model.model.diffusion_model
    if not isinstance(diffusion, MiniMaxH3Model):
        raise ValueError(f"MiniMax H3 Sequence Parallel needs a MiniMax H3 model, got {type(diffusion).__name__}")
    if torch.device(devices[0]) != torch.device(comfy.model_management.get_torch_device()):
        raise ValueError(f"the first device must be the one ComfyUI runs on ({comfy.model_management.get_torch_device()}), "
                         f"got {devices[0]}")
    refuse_multigpu_clones(model)
    sp = runner_for(model, devices)
    m = model.clone()

    def prepare_sampling(executor, patcher, *args, **kwargs):
        # the workers start and take the patch state while rank 0 loads and patches its own copy
        refuse_multigpu_clones(patcher)
        sp.prepare_in_background(patcher)
        return executor(patcher, *args, **kwargs)

    def on_pre_run(patcher):
        refuse_multigpu_clones(patcher)
        sp.prepare(patcher)

    def on_detach(patcher, unpatch_all):
        # a clone replacing another (new seed, LoRA edit) detaches without unpatch_all; an unload unpatches
        if unpatch_all and sp.group.state != "idle":
            logging.info("MiniMax H3 sequence parallel: model unloaded, closing %d worker(s)", len(devices) - 1)
            sp.close()

    m.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.PREPARE_SAMPLING, "minimax_h3_sequence_parallel", prepare_sampling)
    m.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, "minimax_h3_sequence_parallel", sp)
    m.add_callback(comfy.patcher_extension.CallbacksMP.ON_PRE_RUN, on_pre_run)
    m.add_callback(comfy.patcher_extension.CallbacksMP.ON_DETACH, on_detach)
    return m


class MiniMaxH3SequenceParallel(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="MiniMaxH3SequenceParallel",
            display_name="MiniMax H3 Sequence Parallel",
            category="model/patch/minimax",
            description="Shard each MiniMax H3 denoising step over several GPUs (Ulysses sequence parallelism). "
                        "Place it right after the model loader; LoRAs applied downstream are synced to every GPU.",
            inputs=[
                io.Model.Input("model"),
                io.String.Input("devices", default="auto",
                                tooltip="'auto' for every GPU ComfyUI sees, or a list such as 'cuda:0,cuda:1'; "
                                        "the first is the GPU ComfyUI runs on"),
            ],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def execute(cls, model, devices) -> io.NodeOutput:
        return io.NodeOutput(attach(model, devices_from_text(devices)))


class MiniMaxH3ParallelExtension(ComfyExtension):
    async def get_node_list(self):
        return [MiniMaxH3SequenceParallel]


async def comfy_entrypoint() -> MiniMaxH3ParallelExtension:
    return MiniMaxH3ParallelExtension()
