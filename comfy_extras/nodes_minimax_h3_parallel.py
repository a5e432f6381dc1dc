"""MiniMax H3 Sequence Parallel: run an H3 model's denoising steps sharded over several GPUs.

The node attaches a SequenceParallel runner to a clone of the model. Its workers start, and load the
checkpoint, while rank 0 loads its own copy (PREPARE_SAMPLING); every rank holds the patch state of the
patcher that samples (any LoRA loaders downstream included) before the first step (ON_PRE_RUN); new
seeds and LoRA edits reuse them. When ComfyUI unloads the model, each worker unloads its own as ComfyUI
does and stays for the next run; the workers end with the model the node returned (when ComfyUI frees
it or runs the node again).
"""

import copy
import logging
import sys

import comfy.ldm.modules.attention
import comfy.model_management
import comfy.patcher_extension
import comfy.sampler_helpers
from comfy.ldm.minimax import vae_parallel
from comfy.ldm.minimax.model import MiniMaxH3Model
from comfy.ldm.minimax.sequence_parallel import SequenceParallel, loader_call
from comfy.ldm.minimax.vae import MiniMaxH3VideoVAE
from comfy_api.latest import ComfyExtension, io

KEY = "minimax_h3_sequence_parallel"


def devices_for(max_gpus, heads):
    """ComfyUI's device first, then the other GPUs ComfyUI sees, at most ``max_gpus`` and one per head."""
    first = comfy.model_management.get_torch_device()
    others = list(comfy.model_management.get_all_torch_devices())
    if first in others:
        others.remove(first)
    return [first] + others[:max(0, min(max_gpus, heads) - 1)]


def refuse_multigpu_clones(model):
    if model.get_additional_models_with_key("multigpu"):
        raise ValueError("MiniMax H3 Sequence Parallel cannot be combined with MultiGPU CFG Split on the same model: "
                         "remove one of the two nodes (sequence parallelism already uses every GPU for each cond and uncond step)")


DEFAULT_ATTENTION = "ComfyUI's default"


def attach(model, max_gpus, fp8_exchange=False, attention=DEFAULT_ATTENTION, allow_custom_loader=False):
    """A clone of ``model`` whose H3 steps run on up to ``max_gpus`` devices (rank 0 = ComfyUI's), or ``model``
    itself where there is one device or the platform has no worker processes. ``attention``: a name registered
    with comfy.ldm.modules.attention, run on every rank. ``allow_custom_loader``: let the workers import and run
    the custom node's loader the model came from (refused otherwise)."""
    diffusion = model.model.diffusion_model
    if not isinstance(diffusion, MiniMaxH3Model):
        raise ValueError(f"MiniMax H3 Sequence Parallel needs a MiniMax H3 model, got {type(diffusion).__name__}")
    devices = devices_for(max_gpus, diffusion.blocks[0].attn.heads)
    if len(devices) < 2 or not sys.platform.startswith("linux"):
        log = logging.info if len(devices) < 2 else logging.warning
        log("MiniMax H3 Sequence Parallel: %d device(s) to use (sharded runs need Linux), running on %s alone", len(devices), devices[0])
        if attention == DEFAULT_ATTENTION:
            return model
        m = model.clone()
        m.set_model_optimized_attention(comfy.ldm.modules.attention.get_attention_function(attention))
        return m
    refuse_multigpu_clones(model)
    sp = SequenceParallel([str(d) for d in devices], loader_call(model, allow_custom_loader), fp8_exchange=fp8_exchange)
    m = model.clone()
    if attention != DEFAULT_ATTENTION:
        sp.use_attention(m, attention)

    def prepare_sampling(executor, patcher, noise_shape, conds, *args, **kwargs):
        refuse_multigpu_clones(patcher)
        # the workers load for what the sampler loads rank 0 for (a rank's share needs less)
        sp.memory_required = comfy.sampler_helpers.estimate_memory(patcher, noise_shape, conds)
        sp.start_workers(patcher)  # they load while rank 0 does, below
        return executor(patcher, noise_shape, conds, *args, **kwargs)

    def on_pre_run(patcher):
        refuse_multigpu_clones(patcher)
        sp.prepare(patcher)

    def on_detach(patcher, unpatch_all):
        # a clone replacing another (new seed, LoRA edit) detaches without unpatch_all; an unload unpatches
        if unpatch_all:
            sp.unload()

    m.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.PREPARE_SAMPLING, KEY, prepare_sampling)
    m.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, KEY, sp)
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
            description="Shard each MiniMax H3 denoising step over several GPUs (Ulysses sequence parallelism; Linux). "
                        "Place it right after the model loader; LoRAs applied downstream are synced to every GPU. "
                        "With one GPU it passes the model through.",
            inputs=[
                io.Model.Input("model"),
                io.Int.Input("max_gpus", default=2, min=1, max=56, step=1,
                             tooltip="GPUs to shard over: the one ComfyUI runs on, then the next ones it sees"),
                io.Boolean.Input("fp8_exchange", default=False,
                                 tooltip="Exchange attention data between GPUs in scaled fp8: half the traffic, "
                                         "slightly different output"),
                io.Combo.Input("attention", options=[DEFAULT_ATTENTION, *sorted(comfy.ldm.modules.attention.REGISTERED_ATTENTION_FUNCTIONS)],
                               default=DEFAULT_ATTENTION, optional=True,
                               tooltip="The attention every GPU runs, by its registered name (ComfyUI's default: as chosen at launch)"),
                io.Boolean.Input("allow_custom_loader", default=False, optional=True,
                                 tooltip="The model comes from a custom node's loader: let every GPU's worker process "
                                         "import that node's file and run its loader (ComfyUI's own loaders need no "
                                         "permission)"),
            ],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def execute(cls, model, max_gpus, fp8_exchange, attention=DEFAULT_ATTENTION, allow_custom_loader=False) -> io.NodeOutput:
        return io.NodeOutput(attach(model, max_gpus, fp8_exchange, attention, allow_custom_loader))


class DecodeOverGroup:
    """The ``first_stage_model`` of the VAE MiniMaxH3SequenceParallelVAE returns: ``decode`` over the ranks of a
    sequence-parallel model while they run (comfy.ldm.minimax.vae_parallel), everything else H3's VAE itself."""

    def __init__(self, vae, sp, call):
        self._vae, self._model, self._sp, self._call = vae, vae.first_stage_model, sp, call

    def __getattr__(self, name):
        return getattr(self._model, name)

    def decode(self, z, output_buffer=None):
        if self._sp.group.state != "ready":
            logging.info("MiniMax H3 sequence-parallel VAE: the model's GPU workers are %s (they start when the model "
                         "samples), decoding on one GPU", self._sp.group.state)
            return self._model.decode(z, output_buffer=output_buffer)
        return vae_parallel.decode(self._sp, self._call, self._model, z, output_buffer,
                                   self._vae.memory_used_decode(z.shape, z.dtype))


class MiniMaxH3SequenceParallelVAE(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="MiniMaxH3SequenceParallelVAE",
            display_name="MiniMax H3 Sequence Parallel VAE",
            category="model/patch/minimax",
            description="Decode MiniMax H3 video on every GPU of a MiniMax H3 Sequence Parallel model: its tiles and "
                        "temporal chunks are shared out, the result is ComfyUI's decode. Place it in front of VAE Decode.",
            inputs=[
                io.Vae.Input("vae"),
                io.Model.Input("model", tooltip="The MODEL output of MiniMax H3 Sequence Parallel: its GPUs decode"),
                io.Boolean.Input("allow_custom_loader", default=False, optional=True,
                                 tooltip="The VAE comes from a custom node's loader: let every GPU's worker process "
                                         "import that node's file and run its loader"),
            ],
            outputs=[io.Vae.Output()],
        )

    @classmethod
    def execute(cls, vae, model, allow_custom_loader=False) -> io.NodeOutput:
        if not isinstance(vae.first_stage_model, MiniMaxH3VideoVAE):
            raise ValueError(f"MiniMax H3 Sequence Parallel VAE needs MiniMax H3's video VAE, got {type(vae.first_stage_model).__name__}")
        runners = model.get_wrappers(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, KEY)  # [] where it runs on one GPU
        if not runners:
            logging.info("MiniMax H3 Sequence Parallel VAE: the model runs on one GPU, so does the decode")
            return io.NodeOutput(vae)
        out = copy.copy(vae)
        out.first_stage_model = DecodeOverGroup(vae, runners[0], loader_call(vae.patcher, allow_custom_loader))
        return io.NodeOutput(out)


class MiniMaxH3ParallelExtension(ComfyExtension):
    async def get_node_list(self):
        return [MiniMaxH3SequenceParallel, MiniMaxH3SequenceParallelVAE]


async def comfy_entrypoint() -> MiniMaxH3ParallelExtension:
    return MiniMaxH3ParallelExtension()
