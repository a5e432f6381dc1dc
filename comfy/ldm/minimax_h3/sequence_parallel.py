"""H3 sequence parallelism on a comfy.parallel group of headless ComfyUI workers. Internal.

Workers build rank 0's base model with rank 0's loader call and hold its patch state (PatchSnapshots).
Each step, rank 0 broadcasts the StepInputs once and the workers rebuild the plan rank 0's model built;
a preflight proves plan, patch version and model set-up equal on every rank before any shard runs.
"""

import contextlib
import dataclasses
import logging
import threading
import types

import torch

import comfy.ldm.modules.attention
import comfy.model_management
import comfy.model_patcher
import comfy.ops
from comfy import model_patcher_snapshot as snapshots
from comfy.parallel import ParallelGroup, headless, register_op

from . import kernels
from .step_io import StepInputs
from .ulysses import DEFAULT_CHUNKS, sharded_forward

OP_FORWARD = "minimax_h3.forward"
OP_PATCHES = "minimax_h3.patches"
# compared when the workers are ready; manual_cast_dtype follows the patch state (ModelComputeDtype)
# and is compared every step instead
SETUP_FIELDS = ("model_dtype", "patcher", "attention", "torch", "code_sha256", "weights_sha256")


def worker_spec(call, settings):
    return {"imports": [__name__], "setup": f"{__name__}:setup_worker", "setup_args": {"call": call}, "comfyui": settings}


def setup_worker(ctx, call):
    """Worker start-up: rank 0's loader call builds the base model, held by a ModelPatcher."""
    base = headless.load(call)
    ctx.state.update(base=base, patcher=base, model=base.model.diffusion_model, snapshot=snapshots.PatchSnapshot.empty(),
                     describe=headless.describe(base))
    return {"setup": ctx.state["describe"]}


@register_op(OP_PATCHES)
def patches_op(ctx, tensors, meta):
    """Bring this rank's ModelPatcher to the snapshot (or delta) sent; answer with an ack."""
    target = meta["target"]
    if ctx.rank == 0:
        # rank 0 samples with the very ModelPatcher the snapshot was captured from
        ctx.state["patch_version"] = (target["lineage"], target["digest"])
        return {}, {"ack": snapshots.SnapshotAck(0, target["lineage"], target["digest"], target["key_count"]).to_json()}
    update = snapshots.decode(tensors["snapshot"].cpu().numpy().tobytes())
    held, ctx.state["snapshot"] = ctx.state["snapshot"], None  # nothing a later delta could build on until this lands
    snap = update if update.kind == "snapshot" else update.apply_to(held)
    # ComfyUI's own merge (or DynamicVRAM's forward-time patches); backups stay on the GPU when it has room
    patcher = snap.load(ctx.state["base"])
    ctx.state.update(patcher=patcher, snapshot=snap, patch_version=snap.version, describe=headless.describe(patcher))
    return {}, {"ack": snapshots.SnapshotAck(ctx.rank, snap.lineage, snap.digest, snap.key_count).to_json()}


def _attention_override(name):
    """The override ModelPatcher.set_model_optimized_attention installs for a registered backend."""
    holder = types.SimpleNamespace(model_options={"transformer_options": {}})
    comfy.model_patcher.ModelPatcher.set_model_optimized_attention(holder, comfy.ldm.modules.attention.get_attention_function(name))
    return holder.model_options["transformer_options"]["optimized_attention_override"]


@register_op(OP_FORWARD)
def forward_op(ctx, tensors, meta):
    """One step's part on this rank; rank 0 gets the full (video, audio) target rows."""
    model = ctx.state["model"]
    inputs = StepInputs.decode(tensors, meta["step"])
    if meta["attention"] is not None:
        inputs.options["optimized_attention_override"] = _attention_override(meta["attention"])
    # rank 0 runs the plan its model built for this step; the workers rebuild it from the same inputs
    plan = ctx.state.pop("plan") if ctx.rank == 0 else model.plan(inputs)
    # same plan, patch state and model set-up on every rank, checked before the first data collective
    ctx.preflight(headless.digest([plan.digest(), list(ctx.state["patch_version"]), ctx.state["describe"]]))
    with torch.no_grad():
        v, a = sharded_forward(model, plan, inputs, ctx.rank, ctx.world_size, group=ctx.data_group, chunks=meta["chunks"])
    return ({"video": v, "audio": a} if ctx.rank == 0 else {}), {}


class SequenceParallel:
    """Rank 0's handle on the ranks running one H3 base model; see the module docstring.

    ``call``: ``headless.loader_call`` of the base ModelPatcher; ``settings``: ``headless.execution_settings()``.
    """

    def __init__(self, devices, call, settings, timeouts=None, log_dir=None, name="minimax_h3", chunks=DEFAULT_CHUNKS):
        if len(devices) < 2:
            raise ValueError(f"sequence parallelism needs at least 2 devices, got {devices}; use the model directly on one")
        if not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks (all-to-all pipeline depth) must be an integer >= 1, got {chunks!r}")
        self.chunks = chunks
        self.devices = list(devices)
        self.spec = worker_spec(call, settings)
        self.group = ParallelGroup(name, log_dir=log_dir, timeouts=timeouts)
        self.synced = None  # PatchSnapshot every rank acked
        self.last_sent = None  # describe() of the last update sync() sent; None when the last call sent nothing
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
        headless.weights_fingerprint(patcher)  # read here, not while rank 0's load patches the weights
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
        self._rank0["describe"] = headless.describe(patcher)
        self.sync(snapshots.PatchSnapshot.capture(patcher, previous=self.synced))

    def ensure_started(self, patcher):
        """Start (or restart after a fault) the workers; rank 0 runs ops on ``patcher``'s model."""
        if self.group.state == "ready":
            return
        if self.group.state not in ("idle", "closed"):
            self.group.close()
        model = patcher.model.diffusion_model
        if self.world_size > model.num_heads:
            raise ValueError(f"MiniMax H3 has {model.num_heads} attention heads; sequence parallelism supports at most "
                             f"{model.num_heads} ranks")
        self.synced = None
        self._rank0.update(model=model, patch_version=None)
        self.group.start(self.devices, self.spec, local_state=self._rank0)
        try:
            mine = {k: v for k, v in headless.describe(patcher).items() if k in SETUP_FIELDS}
            theirs = {r: {k: v for k, v in m["setup"].items() if k in SETUP_FIELDS} for r, m in enumerate(self.group.setup_metas) if r}
            headless.check_same(mine, theirs)
        except BaseException:
            self.group.close()
            raise

    def sync(self, snapshot):
        """Make every rank hold ``snapshot`` (a delta when possible) and check their acks.

        Until every ack is in, nothing counts as synced: a failed or cancelled sync is repaired by
        the next one, which sends the full snapshot.
        """
        self.last_sent = None
        if self.synced is not None and self.synced.version == snapshot.version:
            return
        update = snapshot if self.synced is None else snapshot.diff(self.synced)
        self.synced, self.last_sent = None, update.describe()
        blob = torch.frombuffer(bytearray(update.encode()), dtype=torch.uint8)
        target = {"lineage": snapshot.lineage, "digest": snapshot.digest, "key_count": snapshot.key_count}
        result = self.group.run(OP_PATCHES, {"snapshot": blob}, {"target": target})
        snapshots.require_acks(snapshot, [snapshots.SnapshotAck.from_json(m["ack"]) for m in result.metas], self.world_size)
        self.synced = snapshot
        logging.info("MiniMax H3 sequence parallel: %d ranks hold patch snapshot %s (sent %s)", self.world_size,
                     snapshot.describe(), self.last_sent)

    def __call__(self, plan, inputs):
        """The runner MiniMaxH3Model._forward calls with the step's plan and StepInputs: -> full (video,
        audio) fp32 target rows."""
        if self.synced is None:
            raise snapshots.SnapshotNotAcked("no patch snapshot has been synced to the sequence-parallel ranks; "
                                             "call prepare() (the node does this before sampling) before running steps")
        swapped = kernels.optimized_attention
        if swapped is not comfy.ldm.modules.attention.optimized_attention:
            raise ValueError(f"H3's attention function was replaced on rank 0 ({getattr(swapped, '__name__', swapped)!s}, e.g. by "
                             "a custom node setting comfy.ldm.minimax.model.optimized_attention); the sequence-parallel workers "
                             "cannot run it. Select the attention with ModelAttentionBackend or ComfyUI's attention flags, "
                             "or run without the sequence-parallel node")
        options = dict(inputs.options)
        override = options.pop("optimized_attention_override", None)
        tensors, step = dataclasses.replace(inputs, options=options).encode()
        meta = {"step": step, "chunks": self.chunks,
                "attention": headless.attention_name(override) if override is not None else None}
        self._rank0["plan"] = plan
        try:
            with _interrupt_after_step():
                result = self.group.run(OP_FORWARD, tensors, meta)
                self.steps_run += 1
        finally:
            self._rank0.pop("plan", None)
        return result.tensors["video"], result.tensors["audio"]

    def close(self):
        self._join_background()
        self.group.close()
        self.synced = None


@contextlib.contextmanager
def _interrupt_after_step():
    """Rank 0's share of a step runs to its end, then a pending interrupt is raised where ComfyUI expects it.

    ComfyUI checks its interrupt flag in every op (comfy.ops.run_every_op); raised inside rank 0's
    share it would leave the other ranks waiting in a collective rank 0 never joins, and only a
    restart of every worker recovers from that. Deferred to the end of the step, the group stays ready.
    """
    check = comfy.ops.run_every_op
    comfy.ops.run_every_op = _no_check
    try:
        yield
    finally:
        comfy.ops.run_every_op = check
    comfy.model_management.throw_exception_if_processing_interrupted()


def _no_check():
    pass
