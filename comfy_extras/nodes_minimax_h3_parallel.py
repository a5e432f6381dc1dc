"""MiniMax H3 Sequence Parallel: run an H3 model's denoising steps sharded over several GPUs.

The node attaches a SequenceParallel runner to a clone of the model. Before every sampling run
(ON_PRE_RUN, on the patcher that actually samples, i.e. after any LoRA loaders downstream) the
worker processes are started if needed and brought to that patcher's PatchSnapshot; every step
then runs sharded, rank 0 being this process. ComfyUI's interrupt cancels the step in flight; the
workers are shut down when the model is unloaded and restarted on next use.
"""

import logging
import weakref

import torch

import comfy.model_management
import comfy.patcher_extension
import comfy.sd
from comfy import model_patcher_snapshot as snapshots
from comfy.ldm.minimax_h3.checkpoint import LoaderSpec
from comfy.ldm.minimax_h3.model import SEQUENCE_PARALLEL_OPTION, MiniMaxH3Model
from comfy.ldm.minimax_h3.sequence_parallel import SequenceParallel
from comfy_api.latest import ComfyExtension, io

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def parse_devices(text):
    """'auto' -> every visible CUDA device; else a comma list such as 'cuda:0,cuda:1' or 'cpu,cpu'."""
    text = text.strip()
    if text == "auto":
        n = torch.cuda.device_count()
        if n < 2:
            raise ValueError(f"'auto' found {n} CUDA device(s); sequence parallelism needs at least 2. "
                             "List devices explicitly, e.g. 'cuda:0,cuda:1'")
        return [f"cuda:{i}" for i in range(n)]
    devices = [d.strip() for d in text.split(",") if d.strip()]
    if len(devices) < 2:
        raise ValueError(f"devices {text!r} names {len(devices)} device(s); give at least 2, e.g. 'cuda:0,cuda:1'")
    return devices


def loader_spec_for(patcher):
    """The LoaderSpec of the checkpoint a core loader built this model from."""
    init = getattr(patcher, "cached_patcher_init", None)
    loaders = (comfy.sd.load_diffusion_model, comfy.sd.load_checkpoint_guess_config)
    if init is None or init[0] not in loaders:
        raise ValueError("MiniMax H3 Sequence Parallel needs a model loaded by 'Load Diffusion Model' or 'Load Checkpoint': "
                         "worker processes rebuild the base model from that file")
    diffusion = patcher.model.diffusion_model
    dtype = next(iter(diffusion.parameters())).dtype if diffusion.dtype is None else diffusion.dtype
    quantized = sorted({str(p.dtype) for p in diffusion.parameters() if p.dtype not in _DTYPE_NAMES})
    if dtype not in _DTYPE_NAMES or quantized:
        raise ValueError(f"MiniMax H3 Sequence Parallel supports bf16/fp16/fp32 weights; this model has {quantized or dtype}. "
                         "Load the bf16 checkpoint (quantized workers are not supported yet)")
    return LoaderSpec.for_file(init[1][0], dtype=_DTYPE_NAMES[dtype])


def attach(model, devices):
    """A clone of `model` whose H3 steps run on `devices` (rank 0 = this process, devices[0])."""
    diffusion = model.model.diffusion_model
    if not isinstance(diffusion, MiniMaxH3Model):
        raise ValueError(f"MiniMax H3 Sequence Parallel needs a MiniMax H3 model, got {type(diffusion).__name__}")
    if torch.device(devices[0]) != comfy.model_management.get_torch_device():
        raise ValueError(f"the first device must be the one ComfyUI runs on ({comfy.model_management.get_torch_device()}), "
                         f"got {devices[0]}")
    # dynamic VRAM merges LoRAs at forward time in the compute dtype; workers merge like patch_model()
    m = model.clone(disable_dynamic=True)
    sp = SequenceParallel(devices, loader_spec_for(m))
    weakref.finalize(sp, sp.group.close)

    def on_pre_run(patcher):
        sp.ensure_started(patcher.model.diffusion_model)
        sp.sync(snapshots.PatchSnapshot.capture(patcher, previous=sp.synced))

    def on_detach(patcher, unpatch_all):
        logging.info("MiniMax H3 sequence parallel: model unloaded, closing %d worker(s)", len(devices) - 1)
        sp.close()

    m.add_callback(comfy.patcher_extension.CallbacksMP.ON_PRE_RUN, on_pre_run)
    m.add_callback(comfy.patcher_extension.CallbacksMP.ON_DETACH, on_detach)
    to = m.model_options["transformer_options"] = m.model_options.get("transformer_options", {}).copy()
    to[SEQUENCE_PARALLEL_OPTION] = sp
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
                                tooltip="'auto' for every visible GPU, or a list such as 'cuda:0,cuda:1'; "
                                        "the first is the GPU ComfyUI runs on"),
            ],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def execute(cls, model, devices) -> io.NodeOutput:
        return io.NodeOutput(attach(model, parse_devices(devices)))


class MiniMaxH3ParallelExtension(ComfyExtension):
    async def get_node_list(self):
        return [MiniMaxH3SequenceParallel]


async def comfy_entrypoint() -> MiniMaxH3ParallelExtension:
    return MiniMaxH3ParallelExtension()
