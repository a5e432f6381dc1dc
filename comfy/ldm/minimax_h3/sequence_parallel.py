"""H3 sequence parallelism on a comfy.parallel group.

Rank 0 (ComfyUI) holds a ``SequenceParallel`` for one model. It starts a ParallelGroup whose
workers build the same base model from a LoaderSpec, keeps every rank on the current
PatchSnapshot (acked before any step may run), and is the runner ``MiniMaxH3Model._forward``
calls through ``transformer_options[SEQUENCE_PARALLEL_OPTION]``: each step's inputs are broadcast
once, every rank rebuilds the same ForwardPlan, proves it with a preflight digest (which also
covers the patch version), runs its shard, and rank 0 receives the full target rows.
"""

import hashlib
import logging
import threading

import torch

from comfy import model_patcher_snapshot as snapshots
from comfy.parallel import ParallelCancelled, ParallelGroup, register_op

from .checkpoint import LoaderSpec
from .step_io import decode_step, encode_step
from .ulysses import DEFAULT_CHUNKS, sharded_forward

OP_FORWARD = "minimax_h3.forward"
OP_PATCHES = "minimax_h3.patches"
KEY_PREFIX = "diffusion_model."  # PatchSnapshot keys are the ModelPatcher's


def worker_spec(loader_spec):
    return {"imports": [__name__], "setup": f"{__name__}:setup_worker", "setup_args": {"loader_spec": loader_spec.to_json()}}


def setup_worker(ctx, loader_spec):
    """Worker start-up: build the base model the LoaderSpec describes on this rank's device."""
    spec = LoaderSpec.from_json(loader_spec)
    ctx.state["model"] = spec.load(device=ctx.device)
    ctx.state["patch_version"] = snapshots.PatchSnapshot.empty().version


def _digest(plan, patch_version):
    return hashlib.sha256(f"{plan.digest()}|{patch_version[0]}|{patch_version[1]}".encode()).hexdigest()


@register_op(OP_PATCHES)
def patches_op(ctx, tensors, meta):
    """Bring this rank's weights to the snapshot (or delta) sent; answer with an ack."""
    target = meta["target"]
    if ctx.rank != 0 or meta["apply_on_rank0"]:
        update = snapshots.decode(tensors["snapshot"].cpu().numpy().tobytes())
        applier = snapshots.apply(update, ctx.state["model"], key_prefix=KEY_PREFIX, backup_device="cpu")
        ack = applier.ack(ctx.rank)
    else:
        # rank 0's weights are the ModelPatcher's own: it holds the captured version by construction
        ack = snapshots.SnapshotAck(0, target["lineage"], target["digest"], target["key_count"])
    ctx.state["patch_version"] = ack.version
    return {}, {"ack": ack.to_json()}


@register_op(OP_FORWARD)
def forward_op(ctx, tensors, meta):
    """One step's part on this rank; rank 0 gets the full (video, audio) target rows."""
    model = ctx.state["model"]
    video, audio, timestep, context, payload, options = decode_step(tensors, meta["step"])
    plan = model.plan(video, tuple(meta["orig_thw"]), audio, timestep, context, options, payload)
    # same plan and same patch version on every rank, checked before the first data collective
    ctx.preflight(_digest(plan, tuple(ctx.state["patch_version"])))
    with torch.no_grad():
        v, a = sharded_forward(model, plan, ctx.rank, ctx.world_size, video, audio, context, payload, options,
                               group=ctx.data_group, chunks=meta["chunks"])
    return ({"video": v, "audio": a} if ctx.rank == 0 else {}), {}


class SequenceParallel:
    """Rank 0's handle on the ranks running one H3 model; see the module docstring."""

    def __init__(self, devices, loader_spec, timeouts=None, log_dir=None, apply_on_rank0=False, name="minimax_h3",
                 chunks=DEFAULT_CHUNKS):
        if len(devices) < 2:
            raise ValueError(f"sequence parallelism needs at least 2 devices, got {devices}; use the model directly on one")
        if not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks (all-to-all pipeline depth) must be an integer >= 1, got {chunks!r}")
        self.chunks = chunks
        self.devices = list(devices)
        self.loader_spec = loader_spec
        self.apply_on_rank0 = apply_on_rank0
        self.group = ParallelGroup(name, log_dir=log_dir, timeouts=timeouts)
        self.synced = None  # PatchSnapshot every rank acked

    @property
    def world_size(self):
        return len(self.devices)

    def ensure_started(self, model):
        """Start (or restart after a fault) the workers; rank 0 runs ops on `model`."""
        if self.group.state == "ready":
            return
        if self.group.state not in ("idle", "closed"):
            self.group.close()
        heads = model.num_heads
        if self.world_size > heads:
            raise ValueError(f"MiniMax H3 has {heads} attention heads; sequence parallelism supports at most {heads} ranks")
        self.synced = None
        self.group.start(self.devices, worker_spec(self.loader_spec), local_state={"model": model})

    def sync(self, snapshot):
        """Make every rank hold `snapshot` (a delta when possible) and check their acks."""
        if self.synced is not None and self.synced.version == snapshot.version:
            return
        update = snapshot if self.synced is None else snapshot.diff(self.synced)
        blob = torch.frombuffer(bytearray(update.encode()), dtype=torch.uint8)
        target = {"lineage": snapshot.lineage, "digest": snapshot.digest, "key_count": snapshot.key_count}
        result = self.group.run(OP_PATCHES, {"snapshot": blob}, {"target": target, "apply_on_rank0": self.apply_on_rank0})
        snapshots.require_acks(snapshot, [snapshots.SnapshotAck.from_json(m["ack"]) for m in result.metas], self.world_size)
        self.synced = snapshot
        logging.info("MiniMax H3 sequence parallel: %d ranks hold patch snapshot %s", self.world_size, snapshot.describe())

    def __call__(self, model, plan, video_x, audio_x, timestep, context, payload, transformer_options):
        """The runner MiniMaxH3Model._forward calls: -> full (video, audio) fp32 target rows."""
        if self.synced is None:
            raise snapshots.SnapshotNotAcked("no patch snapshot has been synced to the sequence-parallel ranks; "
                                             "call sync() (the node does this before sampling) before running steps")
        tensors, step = encode_step([video_x, audio_x], timestep, context, payload, transformer_options)
        meta = {"step": step, "orig_thw": list(plan.orig_thw), "chunks": self.chunks}
        with _cancel_on_interrupt(self.group):
            result = self.group.run(OP_FORWARD, tensors, meta)
        return result.tensors["video"], result.tensors["audio"]

    def close(self):
        self.group.close()
        self.synced = None


class _cancel_on_interrupt:
    """Inside ComfyUI, cancel the group's op as soon as the user interrupts (checked every 100 ms)."""

    def __init__(self, group):
        self.group = group
        self.done = threading.Event()
        self.interrupted = threading.Event()
        self.thread = None

    def __enter__(self):
        try:
            import comfy.model_management as mm
        except ModuleNotFoundError:
            return self

        def watch():
            while not self.done.wait(0.1):
                if mm.processing_interrupted():
                    self.interrupted.set()
                    self.group.cancel()
                    return

        self.thread = threading.Thread(target=watch, name="h3-sp-interrupt", daemon=True)
        self.thread.start()
        return self

    def __exit__(self, exc_type, exc, tb):
        self.done.set()
        if self.thread is not None:
            self.thread.join()
        if isinstance(exc, ParallelCancelled) and self.interrupted.is_set():
            import comfy.model_management as mm
            raise mm.InterruptProcessingException() from exc
        return False
