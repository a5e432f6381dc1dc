"""MiniMax H3 sequence parallelism on a comfy.parallel group of headless ComfyUI workers.

Workers build rank 0's base model with rank 0's loader call and hold its patch state (patch
snapshots). Each step, rank 0's DIFFUSION_MODEL wrapper sends the step's arguments once; every rank
then runs MiniMaxH3Model._forward on its own rows with a UlyssesParallel in transformer_options,
after a preflight has proven patch version and model set-up equal on every rank.
"""

import hashlib
import json
import logging
import os
import threading
import weakref

import torch

import comfy.model_management
import comfy.patcher_extension
import comfy.sd
from comfy import model_patcher_snapshot as snapshots
from comfy.ldm.minimax.model import PackedLayout
from comfy.parallel import ParallelGroup, register_op

from .ulysses import UlyssesParallel

OP_SETUP = "minimax_h3.setup"
OP_FORWARD = "minimax_h3.forward"
OP_PATCHES = "minimax_h3.patches"
SEQUENCE_PARALLEL = "minimax_h3_sequence_parallel"
# transformer_options that change the numbers and are sent; the rest stays on rank 0
SENT_OPTIONS = ("minimax_h3_sigma_shift_video", "minimax_h3_sigma_shift_audio", "sample_sigmas")
TENSOR = "__tensor__"
DTYPE = "__dtype__"
# ComfyUI loaders whose ModelPatcher records how to rebuild it (cached_patcher_init)
LOADERS = {"load_diffusion_model": comfy.sd.load_diffusion_model, "load_checkpoint_guess_config": comfy.sd.load_checkpoint_guess_config}


def encode_args(obj, path, tensors):
    """A step or loader argument -> JSON tree with its tensors named into `tensors`; refuses anything else by path."""
    if isinstance(obj, torch.Tensor):
        tensors[f"t{len(tensors)}"] = obj
        return {TENSOR: f"t{len(tensors) - 1}"}
    if isinstance(obj, torch.dtype):
        return {DTYPE: str(obj).removeprefix("torch.")}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, (list, tuple)):
        return [encode_args(v, f"{path}[{i}]", tensors) for i, v in enumerate(obj)]
    if isinstance(obj, dict) and all(isinstance(k, str) for k in obj):
        return {k: encode_args(v, f"{path}.{k}", tensors) for k, v in obj.items() if not isinstance(v, PackedLayout)}
    raise ValueError(f"MiniMax H3 sequence parallelism cannot send {path} ({type(obj).__name__}) to the other GPUs: "
                     "remove the node that adds it or run on one GPU")


def decode_args(obj, tensors):
    if isinstance(obj, dict):
        if set(obj) == {TENSOR}:
            return tensors[obj[TENSOR]]
        if set(obj) == {DTYPE}:
            return getattr(torch, obj[DTYPE])
        return {k: decode_args(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_args(v, tensors) for v in obj]
    return obj


def file_identity(path):
    """Size, mtime, inode and safetensors header hash: a changed file changes it, without a full read."""
    st = os.stat(path)
    with open(path, "rb") as f:
        head = f.read(8)
        header = f.read(min(int.from_bytes(head, "little") if len(head) == 8 else 0, 100 * 1024 * 1024))
    return [st.st_size, st.st_mtime_ns, st.st_ino, hashlib.sha256(head + header).hexdigest()]


def loader_call(patcher):
    """Rank 0's base ModelPatcher -> the JSON call that builds the same base model in a worker."""
    init = patcher.cached_patcher_init
    name = next((n for n, fn in LOADERS.items() if init is not None and init[0] is fn), None)
    if name is None:
        raise ValueError("MiniMax H3 Sequence Parallel needs a model from 'Load Diffusion Model' or 'Load Checkpoint', "
                         "which workers can load again; place the node right after one")
    tensors = {}
    args = encode_args(list(init[1]), "loader arguments", tensors)
    if tensors:
        raise ValueError("the model's loader arguments hold tensors, which workers cannot load again: load it with a core loader")
    return {"loader": name, "args": args, "index": init[2] if len(init) > 2 else None, "file": file_identity(init[1][0])}


def weights_fingerprint(patcher, samples=64):
    """sha256 over an evenly strided sample of every base weight (a LoRA merged in place is read from its
    backup), kept per base model: a checkpoint changed on disk after rank 0 loaded it is found."""
    found = _fingerprints.get(patcher.model)
    if found is None:
        code = hashlib.sha256()
        for key, weight in sorted(patcher.model.diffusion_model.state_dict(keep_vars=True).items()):
            # get_key_patches() would give the backups too, but cannot read quantized layers' extra state
            backup = patcher.backup.get("diffusion_model." + key)
            weight = backup.weight if backup is not None else weight
            code.update(f"{key}|{tuple(weight.shape)}|{weight.dtype}".encode())
            for inner in _plain_tensors(weight.detach()):
                flat = inner.reshape(-1)
                code.update(flat[::max(1, flat.numel() // samples)][:samples].cpu().contiguous().view(torch.uint8).numpy().tobytes())
        found = _fingerprints[patcher.model] = code.hexdigest()
    return found


_fingerprints = weakref.WeakKeyDictionary()


def _plain_tensors(tensor):
    # quantized weights are sampled through their inner tensors
    if type(tensor) in (torch.Tensor, torch.nn.Parameter) or not hasattr(tensor, "__tensor_flatten__"):
        return [tensor]
    return [t for name in tensor.__tensor_flatten__()[0] for t in _plain_tensors(getattr(tensor, name))]


def describe(patcher):
    """What every rank must agree on once its model is built."""
    return {"model_dtype": str(patcher.model_dtype()), "manual_cast_dtype": str(patcher.model.manual_cast_dtype),
            "patcher": type(patcher).__name__, "torch": torch.__version__, "weights_sha256": weights_fingerprint(patcher)}


@register_op(OP_SETUP)
def setup_op(ctx, tensors, meta):
    """Workers build rank 0's base model with rank 0's loader call; every rank answers with describe()."""
    if ctx.rank:
        call = meta["call"]
        path = call["args"][0]
        if file_identity(path) != call["file"]:
            raise ValueError(f"checkpoint {path} changed on disk since rank 0 loaded it; load the model again in ComfyUI")
        out = LOADERS[call["loader"]](*decode_args(call["args"], {}))
        base = out if call["index"] is None else out[call["index"]]
        ctx.state.update(base=base, patcher=base, snapshot=snapshots.PatchSnapshot.empty(), describe=describe(base))
        ctx.state["patch_version"] = ctx.state["snapshot"].version
    return {}, {"setup": ctx.state["describe"]}


@register_op(OP_PATCHES)
def patches_op(ctx, tensors, meta):
    """Bring this rank's ModelPatcher to the snapshot (or delta) sent, checked before anything is written."""
    target = meta["target"]
    if ctx.rank == 0:
        # rank 0 samples with the very ModelPatcher the snapshot was captured from
        ctx.state["patch_version"] = (target["lineage"], target["digest"])
        return {}, {"ack": snapshots.SnapshotAck(0, target["lineage"], target["digest"]).to_json()}
    held = ctx.state["snapshot"]
    try:
        snap = snapshots.read(meta["manifest"], tensors).apply_to(held)
        patcher = snap.to_patcher(ctx.state["base"], target["digest"])
    except snapshots.SnapshotRefused as e:
        logging.warning("MiniMax H3 sequence parallel rank %d: %s", ctx.rank, e)
        return {}, {"ack": snapshots.SnapshotAck(ctx.rank, held.lineage, held.digest, refused=str(e)).to_json()}
    comfy.model_management.load_models_gpu([patcher])
    ctx.state.update(patcher=patcher, snapshot=snap, patch_version=snap.version, describe=describe(patcher))
    return {}, {"ack": snapshots.SnapshotAck(ctx.rank, snap.lineage, snap.digest).to_json()}


@register_op(OP_FORWARD)
def forward_op(ctx, tensors, meta):
    """This rank's rows of one step; every rank ends with the full output, rank 0 returns it."""
    if ctx.rank:
        # loaded before the preflight, so that no rank waits in a collective while another loads
        comfy.model_management.load_models_gpu([ctx.state["patcher"]])
    ctx.preflight(hashlib.sha256(json.dumps([list(ctx.state["patch_version"]), ctx.state["describe"]], sort_keys=True).encode()).hexdigest())
    if ctx.rank == 0:
        run, model = ctx.state.pop("step"), ctx.state["model"]
    else:
        model = ctx.state["patcher"].model.diffusion_model
        args = decode_args(meta["args"], tensors)

        def run(options):
            return model._forward(args["x"], args["timestep"], args["context"], options, **args["kwargs"])
    sp = UlyssesParallel(ctx.rank, ctx.world_size, model.blocks[0].attn.heads, group=ctx.data_group)
    options = dict(decode_args(meta["options"], tensors) if ctx.rank else ctx.state["options"], **{SEQUENCE_PARALLEL: sp})
    video, audio = run(options)
    return ({"video": video, "audio": audio} if ctx.rank == 0 else {}), {}


class SequenceParallel:
    """Rank 0's handle on the ranks running one H3 base model; see the module docstring.

    ``call``: ``loader_call`` of the base ModelPatcher. Workers start with rank 0's ComfyUI arguments.
    """

    def __init__(self, devices, call, timeouts=None, name="minimax_h3"):
        if len(devices) < 2:
            raise ValueError(f"sequence parallelism needs at least 2 devices, got {devices}; use the model directly on one")
        self.devices = list(devices)
        self.call = call
        self.group = ParallelGroup(name, timeouts=timeouts)
        self.synced = None  # the PatchSnapshot every rank acked
        self.last_sent = None  # describe() of the last update sync() sent; None when it sent nothing
        self.steps_run = 0
        self._rank0 = {}  # rank 0's ctx.state: no reference to a ModelPatcher, which would keep the base model alive
        self._background = None  # (patcher, thread, outcome) of prepare_in_background until prepare joins it

    @property
    def world_size(self):
        return len(self.devices)

    def prepare_in_background(self, patcher):
        """Start ``prepare(patcher)`` on a thread: the workers start and take the patch state while rank 0
        loads and patches its own copy. ``prepare`` of the same patcher then waits for it."""
        self._join_background()
        weights_fingerprint(patcher)  # read here, not while rank 0's load patches the weights
        outcome = {}

        def run():
            try:
                self._prepare(patcher)
            except BaseException as e:
                outcome["error"] = e
        thread = threading.Thread(target=run, name=f"{self.group.name}-prepare", daemon=True)
        self._background = (patcher, thread, outcome)
        thread.start()

    def prepare(self, patcher):
        """Before sampling with ``patcher`` (ON_PRE_RUN): workers started, every rank on its patch state."""
        pending = self._join_background()
        if pending is not None and pending[0] is patcher:
            if "error" in pending[2]:
                raise pending[2]["error"]
            return
        self._prepare(patcher)

    def _join_background(self):
        pending, self._background = self._background, None
        if pending is not None:
            pending[1].join()
        return pending

    def _prepare(self, patcher):
        self.ensure_started(patcher)
        self._rank0["describe"] = describe(patcher)
        self.sync(snapshots.PatchSnapshot.capture(patcher, previous=self.synced))

    def ensure_started(self, patcher):
        """Start (or restart after a fault) the workers; rank 0 runs ops on ``patcher``'s model."""
        if self.group.state == "ready":
            return
        if self.group.state not in ("idle", "closed"):
            self.group.close()
        model = patcher.model.diffusion_model
        heads = model.blocks[0].attn.heads
        if self.world_size > heads:
            raise ValueError(f"MiniMax H3 has {heads} attention heads; sequence parallelism supports at most {heads} ranks")
        self.synced = None
        # manual_cast_dtype follows the patch state (ModelComputeDtype): it is compared every step instead
        self._rank0.update(model=model, patch_version=None, describe=dict(describe(patcher), manual_cast_dtype=None))
        self.group.start(self.devices, [__name__], local_state=self._rank0)
        try:
            setups = [dict(m["setup"], manual_cast_dtype=None) for m in self.group.run(OP_SETUP, {}, {"call": self.call}).metas]
            for rank, setup in enumerate(setups[1:], 1):
                diff = sorted(k for k in setup if setup[k] != setups[0].get(k))
                if diff:
                    fix = ("the checkpoint changed on disk since rank 0 loaded it: load the model again in ComfyUI"
                           if "weights_sha256" in diff else "every rank needs the same kind of device and ComfyUI start-up flags")
                    raise ValueError(f"rank {rank} does not run the model as rank 0 does ("
                                     + "; ".join(f"{k}: rank 0 {setups[0].get(k)!r}, rank {rank} {setup[k]!r}" for k in diff) + f"); {fix}")
        except BaseException:
            self.group.close()
            raise

    def sync(self, snapshot):
        """Make every rank hold ``snapshot`` (a delta when possible) and check their acks.

        Until every ack is in, nothing counts as synced: a failed or refused sync is repaired by the
        next one, which sends the full snapshot.
        """
        self.last_sent = None
        if self.synced is not None and self.synced.version == snapshot.version:
            return
        update = snapshot if self.synced is None else snapshot.diff(self.synced)
        self.synced, self.last_sent = None, dict(update.describe(), kind=update.kind)
        target = {"lineage": snapshot.lineage, "digest": snapshot.digest}
        result = self.group.run(OP_PATCHES, update.tensors, {"manifest": update.manifest, "target": target})
        snapshots.require_acks(snapshot, [snapshots.SnapshotAck.from_json(m["ack"]) for m in result.metas], self.world_size)
        self.synced = snapshot
        logging.info("MiniMax H3 sequence parallel: %d ranks hold patch snapshot %s (sent %s)", self.world_size,
                     snapshot.describe(), self.last_sent)

    def check(self, transformer_options, payload):
        """Refuse, before anything is sent, what would run on rank 0's rows only or cannot be split."""
        blocks = sorted(str(k) for k in transformer_options.get("patches_replace", {}).get("dit", {}))
        wrappers = comfy.patcher_extension.get_all_wrappers(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, transformer_options)
        problems = [f"block patches {blocks}"] if blocks else []
        if len(wrappers) > 1:
            problems.append(f"{len(wrappers) - 1} other diffusion model wrapper(s)")
        if "optimized_attention_override" in transformer_options:
            problems.append("a per-model attention override (select the attention with ComfyUI's launch flags instead)")
        if problems:
            raise ValueError("MiniMax H3 sequence parallelism cannot run " + " and ".join(problems) +
                             ": they would run on rank 0 only. Remove them or run on one GPU.")
        layout = payload.get("layout")
        if layout is not None and self.world_size > layout.seq_len:
            raise ValueError(f"MiniMax H3 cannot split {layout.seq_len} packed rows over {self.world_size} GPUs: "
                             f"use at most {layout.seq_len} devices")

    def __call__(self, executor, x, timestep, context, transformer_options, **kwargs):
        """The DIFFUSION_MODEL wrapper: one step on every rank -> rank 0's [video, audio] output."""
        if self.synced is None:
            raise snapshots.SnapshotNotAcked("no patch snapshot has been synced to the sequence-parallel ranks; "
                                             "call prepare() (the node does this before sampling) before running steps")
        self.check(transformer_options, kwargs.get("minimax_payload") or {})
        tensors = {}
        args = encode_args({"x": list(x), "timestep": timestep, "context": context, "kwargs": kwargs}, "step", tensors)
        options = encode_args({k: transformer_options[k] for k in SENT_OPTIONS if transformer_options.get(k) is not None},
                              "transformer_options", tensors)
        self._rank0["step"] = lambda options: executor(x, timestep, context, options, **kwargs)
        self._rank0["options"] = transformer_options
        try:
            # rank 0's share runs to its end: an interrupt raised inside it would leave the other ranks in a collective
            with comfy.model_management.defer_interrupt():
                result = self.group.run(OP_FORWARD, tensors, {"args": args, "options": options})
                self.steps_run += 1
        finally:
            self._rank0.pop("step", None)
            self._rank0.pop("options", None)
        return [result.tensors["video"], result.tensors["audio"]]

    def close(self):
        self._join_background()
        self.group.close()
        self.synced = None
