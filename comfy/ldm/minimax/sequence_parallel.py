"""MiniMax H3 sequence parallelism on a comfy.parallel group of headless ComfyUI workers.

Workers build rank 0's base model with rank 0's loader call and hold its patch state (patch
snapshots). Each step, rank 0's DIFFUSION_MODEL wrapper (the innermost) sends the step's inputs
through the group's transport, from rank 0's device; a tensor equal to one sent earlier in the
sampling run is not sent again. Every rank then runs MiniMaxH3Model._forward on its own rows with a
UlyssesParallel in transformer_options, after a preflight has proven patch version and model set-up
equal on every rank.
"""

import functools
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import sys
import threading
import weakref

import torch

import comfy.model_management
import comfy.patcher_extension
from comfy import model_patcher_snapshot as snapshots
from comfy.ldm.modules import attention
from comfy.ldm.minimax.model import PackedLayout
from comfy.parallel import ParallelGroup, register_op

from .ulysses import UlyssesParallel

OP_SETUP = "minimax_h3.setup"
OP_FORWARD = "minimax_h3.forward"
OP_PATCHES = "minimax_h3.patches"
OP_UNLOAD = "minimax_h3.unload"
SEQUENCE_PARALLEL = "minimax_h3_sequence_parallel"
TENSOR = "__tensor__"
DTYPE = "__dtype__"
# a worker loads the whole checkpoint in the setup op: as long as that takes while it is alive
SETUP_TIMEOUT = 3600.0
DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
                                                      torch.float8_e5m2, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
                                                      torch.bool)}
CACHED_PER_PATH = 2  # a cond and an uncond input alternate at cfg > 1


class OnRank0:
    """A transformer_options value that is no data (a wrapper's state, the sampler's bookkeeping): it stays
    with the code on rank 0 that owns it. Used on another rank, it says so instead of acting as absent."""

    def __init__(self, key, type_name):
        self._what = f"transformer_options[{key!r}] ({type_name}) exists on rank 0 only"

    def _refuse(self, *args, **kwargs):
        raise RuntimeError(f"{self._what}: the sharded MiniMax H3 forward read it on another rank. Run the model that "
                           "sets it on one GPU, or make it plain data")

    __getattr__ = __call__ = __iter__ = __bool__ = __getitem__ = __len__ = _refuse


def _plain(obj):
    """True for JSON data, tensors and dtypes, nested in lists, tuples and str-keyed dicts."""
    if obj is None or isinstance(obj, (bool, int, float, str, torch.Tensor, torch.dtype)):
        return True
    if isinstance(obj, (list, tuple)):
        return all(_plain(v) for v in obj)
    return isinstance(obj, dict) and all(isinstance(k, str) and _plain(v) for k, v in obj.items())


class StepInputs:
    """Rank 0's side of the inputs workers hold for the sampling run: JSON trees whose tensors are ids into a
    cache both sides keep in step (at most CACHED_PER_PATH tensors per path, compared by value)."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.cache, self.next_id, self.fresh_run, self.last_paths = {}, 0, True, []

    def encode(self, obj, path, send):
        """``obj`` -> a JSON tree; tensors not held by the workers yet go into ``send`` [(id, tensor)]."""
        if isinstance(obj, torch.Tensor):
            entries = self.cache.setdefault(path, [])
            for i, (held, tid) in enumerate(entries):
                if held.shape == obj.shape and held.dtype == obj.dtype and held.device == obj.device and torch.equal(held, obj):
                    entries.insert(0, entries.pop(i))
                    return {TENSOR: tid}
            tid, self.next_id = self.next_id, self.next_id + 1
            entries.insert(0, (obj.detach().clone(), tid))
            del entries[CACHED_PER_PATH:]
            send.append((tid, obj))
            self.last_paths.append(path)
            return {TENSOR: tid}
        if isinstance(obj, torch.dtype):
            return {DTYPE: str(obj).removeprefix("torch.")}
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        if isinstance(obj, (list, tuple)):
            return [self.encode(v, f"{path}[{i}]", send) for i, v in enumerate(obj)]
        if isinstance(obj, dict) and all(isinstance(k, str) for k in obj):
            return {k: self.encode(v, f"{path}.{k}", send) for k, v in obj.items()}
        raise ValueError(f"MiniMax H3 sequence parallelism cannot send {path} ({type(obj).__name__}) to the other GPUs: "
                         "remove the node that adds it or run on one GPU")

    def held(self):
        return sorted(tid for entries in self.cache.values() for _, tid in entries)


def decode(obj, tensors):
    if isinstance(obj, dict):
        if set(obj) == {TENSOR}:
            return tensors[obj[TENSOR]]
        if set(obj) == {DTYPE}:
            return DTYPES[obj[DTYPE]]
        if set(obj) == {"__rank0__"}:
            return OnRank0(*obj["__rank0__"])
        return {k: decode(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode(v, tensors) for v in obj]
    return obj


def file_identity(path):
    """Size, mtime, inode and safetensors header hash: a changed file changes it, without a full read."""
    st = os.stat(path)
    with open(path, "rb") as f:
        head = f.read(8)
        header = f.read(min(int.from_bytes(head, "little") if len(head) == 8 else 0, 100 * 1024 * 1024))
    return [st.st_size, st.st_mtime_ns, st.st_ino, hashlib.sha256(head + header).hexdigest()]


# ComfyUI's own packages: a loader from one of them runs in the workers as it does in ComfyUI (ComfyUI names a
# custom node's module by its file's path, which is none of these)
COMFYUI_PACKAGES = ("comfy", "comfy_extras", "comfy_api", "nodes")


def loader_call(patcher, allow_custom_loader=False):
    """Rank 0's base ModelPatcher -> the JSON call that builds the same base model in a worker: the factory it
    recorded (cached_patcher_init: ComfyUI's loaders record one, and so can a custom node's) and its arguments,
    with the identity of every file among them. A factory outside ComfyUI's own code (a custom node's) would be
    imported and run by every worker process: refused unless ``allow_custom_loader``."""
    init = patcher.cached_patcher_init
    if init is None:
        raise ValueError("MiniMax H3 Sequence Parallel needs a model whose loader records how to load it again "
                         "(cached_patcher_init): ComfyUI's loaders do; a custom loader must register a cached_patcher_init factory")
    factory, args = init[0], list(init[1])
    module = sys.modules.get(factory.__module__)
    if "<locals>" in factory.__qualname__ or module is None or not getattr(module, "__file__", None):
        raise ValueError(f"the model's loader factory {factory.__qualname__} is not a function of a module the workers can "
                         "import: register a module-level function as cached_patcher_init")
    if not _plain(args) or any(isinstance(a, torch.Tensor) for a in args):
        raise ValueError("the model's loader arguments are not plain data, so workers cannot load it again")
    if factory.__module__.split(".")[0] not in COMFYUI_PACKAGES and not allow_custom_loader:
        raise ValueError(f"the model was loaded by {factory.__qualname__} of {module.__file__}, not by ComfyUI's own loaders; "
                         "every GPU worker would import that file and run it to load the model again. Turn on "
                         "allow_custom_loader on the MiniMax H3 Sequence Parallel node to allow it, or load the model "
                         "with ComfyUI's loader nodes")
    return {"module": factory.__module__, "qualname": factory.__qualname__, "file": module.__file__,
            "args": StepInputs().encode(args, "loader", []), "index": init[2] if len(init) > 2 else None,
            "files": {a: file_identity(a) for a in args if isinstance(a, str) and os.path.isfile(a)}}


def loader(call):
    """The factory of ``loader_call``, imported as rank 0 did (a custom node's module from its file)."""
    module = sys.modules.get(call["module"])
    if module is None:
        try:
            module = importlib.import_module(call["module"])
        except ModuleNotFoundError:
            # a custom node: ComfyUI loads it from its file under a name that is no import path
            spec = importlib.util.spec_from_file_location(call["module"], call["file"])
            module = sys.modules[call["module"]] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
    return functools.reduce(getattr, call["qualname"].split("."), module)


def build(call):
    """A worker's copy of the ModelPatcher whose ``loader_call`` rank 0 sent."""
    for path, identity in call["files"].items():
        if file_identity(path) != identity:
            raise ValueError(f"{path} changed on disk since rank 0 loaded it; load the model again in ComfyUI")
    out = loader(call)(*decode(call["args"], {}))
    return out if call["index"] is None else out[call["index"]]


def describe(patcher):
    """What every rank must agree on once its model is built."""
    return {"model_dtype": str(patcher.model_dtype()), "manual_cast_dtype": str(patcher.model.manual_cast_dtype),
            "patcher": type(patcher).__name__, "torch": torch.__version__}


def load(patcher, memory_required):
    """ComfyUI's own load of a worker's model, leaving room for what rank 0's sampler estimated a step needs
    (rank 0's whole sequence: more than a rank's share of it)."""
    required, minimum = memory_required or (0, None)
    comfy.model_management.load_models_gpu([patcher], memory_required=required, minimum_memory_required=minimum)


@register_op(OP_SETUP)
def setup_op(ctx, meta):
    """Workers build rank 0's base model with rank 0's loader call; every rank answers with describe()."""
    if ctx.rank:
        base = build(meta["call"])
        ctx.state.update(base=base, patcher=base, snapshot=snapshots.PatchSnapshot.empty(), describe=describe(base), inputs={})
        ctx.state["patch_version"] = list(ctx.state["snapshot"].version)
    return ctx.state["describe"]


@register_op(OP_PATCHES)
def patches_op(ctx, meta):
    """Bring this rank's ModelPatcher to the snapshot (or delta) sent, checked before anything is written."""
    target = meta["target"]
    if ctx.rank == 0:
        tensors = ctx.state.pop("patch_tensors")
    else:
        tensors = {name: torch.empty(shape, dtype=DTYPES[dtype]) for name, dtype, shape in meta["tensors"]}
    ctx.transport.broadcast(list(tensors.values()))
    if ctx.rank == 0:
        ctx.state["patch_version"] = target
        return None
    snap = snapshots.read(meta["manifest"], tensors).apply_to(ctx.state["snapshot"])
    patcher = snap.to_patcher(ctx.state["base"], target[1])
    load(patcher, meta["memory_required"])
    ctx.state.update(patcher=patcher, snapshot=snap, patch_version=list(snap.version), describe=describe(patcher))
    return {"version": ctx.state["patch_version"]}


@register_op(OP_UNLOAD)
def unload_op(ctx, meta):
    """Rank 0's model was unloaded: each worker unloads its own as ComfyUI does -> bytes it still holds on its device."""
    if ctx.rank:
        comfy.model_management.unload_all_models()
        return ctx.state["patcher"].loaded_size()


@register_op(OP_FORWARD)
def forward_op(ctx, meta):
    """This rank's rows of one step; every rank ends with the full output, rank 0 returns it."""
    if ctx.rank and meta["fresh_run"]:
        load(ctx.state["patcher"], meta["memory_required"])  # once per sampling run, as rank 0's sampler does
    ctx.preflight(hashlib.sha256(json.dumps([ctx.state["patch_version"], ctx.state["describe"]], sort_keys=True).encode()).hexdigest())
    if ctx.rank == 0:
        ctx.transport.broadcast([t for _, t in ctx.state.pop("send")])
        run, model = ctx.state.pop("step"), ctx.state["model"]
        options = ctx.state.pop("options")
    else:
        inputs = ctx.state["inputs"]
        if meta["fresh_run"]:
            inputs.clear()
        received = {tid: torch.empty(shape, dtype=DTYPES[dtype], device=ctx.device) for tid, dtype, shape in meta["send"]}
        ctx.transport.broadcast(list(received.values()))
        inputs.update(received)
        for tid in set(inputs) - set(meta["held"]):
            del inputs[tid]
        if len(inputs) != len(meta["held"]):
            raise RuntimeError(f"rank {ctx.rank} lacks step inputs {sorted(set(meta['held']) - set(inputs))} rank 0 counts as sent")
        patcher = ctx.state["patcher"]
        model = patcher.model.diffusion_model
        args = decode(meta["args"], inputs)
        options = decode(meta["options"], inputs)
        if meta["attention"] is not None:
            # the override as rank 0's ModelPatcher made it, from the function registered under that name here
            function = attention.get_attention_function(meta["attention"], None)
            if function is None:
                raise RuntimeError(f"attention {meta['attention']!r} is not registered in the worker processes: "
                                   "only the attention functions ComfyUI registers itself run on every GPU")
            with_attention = patcher.clone()
            with_attention.set_model_optimized_attention(function)
            options["optimized_attention_override"] = with_attention.model_options["transformer_options"]["optimized_attention_override"]

        def run(options):
            return model._forward(args["x"], args["timestep"], args["context"], options, **args["kwargs"])
    sp = UlyssesParallel(ctx.rank, ctx.world_size, model.blocks[0].attn.heads, ctx.transport,
                         chunks=meta["chunks"], fp8=meta["fp8_exchange"])
    options = dict(options, **{SEQUENCE_PARALLEL: sp})
    if meta["patched_blocks"]:
        options["patches_replace"] = patched_blocks(sp, options.get("patches_replace", {}), meta["patched_blocks"])
    video, audio = run(options)
    return [video, audio] if ctx.rank == 0 else None


def patched_blocks(sp, replace, blocks):
    """Block patches (a Fun ControlNet tower, say) run on rank 0, as on one GPU, around a sharded block: every
    rank runs the model's own block on its rows (its attention through the hook), then the block's input and
    output rows are gathered on rank 0, the patch runs there on the whole sequence with ``original_block``
    answering from the gathered output, and each rank gets its rows back. A patch that calls
    ``original_block`` with other inputs, or twice, gets it run on rank 0 on the whole sequence (exact, not
    sharded). -> patches_replace for this rank (the other ranks take part in the block and the gathers only)."""
    def patched(patch):
        def block(args, extra):
            shard, mine = args["shard"], args["img"]
            img, rope = sp.gather_rows(shard, mine), sp.gather_rows(shard, args["rope_freqs"], dim=1)
            out = extra["original_block"](args)["img"]  # the block adds to its input in place: gathered before
            rows = sp.gather_rows(shard, out)
            if sp.rank == 0:
                whole = shard.plan.shard()
                ready = [rows]

                def original_block(a):
                    if ready and a["img"] is img:  # into its input, as the block itself adds in place
                        return {"img": img.copy_(ready.pop())}
                    return extra["original_block"](a)
                full = dict(args, img=img, rope_freqs=rope, mod_segments=whole.mod_segments, shard=whole, attention=None)
                rows = patch(full, dict(extra, original_block=original_block))["img"]
            return {"img": sp.scatter_rows(shard, rows, mine)}
        return block
    dit = replace.get("dit", {}) if sp.rank == 0 else {("double_block", i): None for i in blocks}
    return dict(replace, dit={key: patched(patch) for key, patch in dit.items()})


def _close_soon(group):
    if group.state not in ("idle", "closed"):
        threading.Thread(target=group.close, name=f"{group.name}-close", daemon=True).start()


class SequenceParallel:
    """Rank 0's handle on the ranks running one H3 base model; see the module docstring.

    ``call``: ``loader_call`` of the base ModelPatcher. ``chunks``: head groups per attention whose exchange
    overlaps the others' attention. ``fp8_exchange``: send q|k|v and attention outputs as scaled fp8 (half
    the bytes, not exact). ``imports``: more modules the workers import (where the caller's own hooks
    live); ``env``: added to the workers' environment.
    """

    def __init__(self, devices, call, timeouts=None, name="minimax_h3", chunks=2, fp8_exchange=False, imports=(), env=None):
        if len(devices) < 2:
            raise ValueError(f"sequence parallelism needs at least 2 devices, got {devices}; use the model directly on one")
        self.devices = list(devices)
        self.call = call
        self.chunks, self.fp8_exchange = chunks, fp8_exchange
        # these two modules register the ops; the others are the code every rank runs for a sharded step
        self.imports, self.env = [__name__, "comfy.ldm.minimax.vae_parallel", "comfy.ldm.minimax.ulysses", "comfy.ldm.minimax.plan", "comfy.ldm.minimax.model", *imports], env
        self.group = ParallelGroup(name, timeouts=timeouts)
        self.synced = None  # the PatchSnapshot every rank holds
        self.last_sent = None  # describe() of the last update sync() sent; None when it sent nothing
        self.steps_run = 0
        self.memory_required = None  # (memory_required, minimum) the sampler loads rank 0 for; the workers load for it too
        self.inputs = StepInputs()
        self._rank0 = {}  # rank 0's ctx.state: no reference to a ModelPatcher, which would keep the base model alive
        self._starting = None  # (thread, outcome) of start_workers() until prepare() joins it
        self._attention = weakref.WeakKeyDictionary()  # the overrides use_attention set -> their registered name
        # the workers end with this runner (the model the node returned, and its clones), on whichever thread drops
        # it, without blocking that thread; nothing runs at interpreter exit (workers exit with rank 0)
        weakref.finalize(self, _close_soon, self.group).atexit = False

    @property
    def world_size(self):
        return len(self.devices)

    def start_workers(self, patcher):
        """Start the workers and their checkpoint load on a thread, while this one loads rank 0's model
        (touches no ModelPatcher: the thread runs the group and the setup op only)."""
        self._join()
        if self.group.state == "ready":
            return
        self._rank0_setup(patcher)
        outcome = {}

        def run():
            try:
                self._start_group()
            except BaseException as e:
                outcome["error"] = e
        thread = threading.Thread(target=run, name=f"{self.group.name}-start", daemon=True)
        self._starting = (thread, outcome)
        thread.start()

    def _join(self):
        starting, self._starting = self._starting, None
        if starting is not None:
            starting[0].join()
            if "error" in starting[1]:
                raise starting[1]["error"]

    def prepare(self, patcher):
        """Before sampling with ``patcher`` (ON_PRE_RUN): workers started, every rank on its patch state."""
        self._join()
        if self.group.state != "ready":
            self._rank0_setup(patcher)
            self._start_group()
        self._rank0["describe"] = describe(patcher)
        self.inputs.reset()
        self.sync(snapshots.PatchSnapshot.capture(patcher, previous=self.synced))

    def use_attention(self, patcher, name):
        """Make ``patcher`` (rank 0's clone) run the attention function registered as ``name``
        (comfy.ldm.modules.attention), and every other rank the one registered under that name there."""
        patcher.set_model_optimized_attention(attention.get_attention_function(name))
        self._attention[patcher.model_options["transformer_options"]["optimized_attention_override"]] = name

    def attention_name(self, transformer_options):
        """The name every rank runs the attention by: None for ComfyUI's default, else the one use_attention
        set. Any other per-model attention override cannot reach the other ranks and is refused."""
        override = transformer_options.get("optimized_attention_override")
        if override is None:
            return None
        name = self._attention.get(override)
        if name is None:
            raise ValueError("MiniMax H3 sequence parallelism runs the same attention on every GPU, and this model's attention "
                             "was patched before or after the node: choose it in the node's 'attention' input instead, or "
                             "with ComfyUI's launch flags (e.g. --use-sage-attention)")
        return name

    def _rank0_setup(self, patcher):
        model = patcher.model.diffusion_model
        heads = model.blocks[0].attn.heads
        if self.world_size > heads:
            raise ValueError(f"MiniMax H3 has {heads} attention heads; sequence parallelism supports at most {heads} ranks")
        # manual_cast_dtype follows the patch state (ModelComputeDtype): it is compared every step instead
        self._rank0.update(model=model, patch_version=None, describe=dict(describe(patcher), manual_cast_dtype=None))

    def _start_group(self):
        if self.group.state not in ("idle", "closed"):
            self.group.close()
        self.synced = None
        c = self.call
        logging.info("MiniMax H3 sequence parallel: %d worker process(es) import %s and load the model with %s.%s (%s)",
                    self.world_size - 1, ", ".join(self.imports), c["module"], c["qualname"], c["file"])
        self.group.start(self.devices, self.imports, comfyui=True, local_state=self._rank0, env=self.env)
        try:
            setups = [dict(s, manual_cast_dtype=None) for s in self.group.run(OP_SETUP, {"call": self.call}, timeout=SETUP_TIMEOUT).values]
            for rank, setup in enumerate(setups[1:], 1):
                diff = sorted(k for k in setup if setup[k] != setups[0].get(k))
                if diff:
                    raise ValueError(f"rank {rank} does not run the model as rank 0 does ("
                                     + "; ".join(f"{k}: rank 0 {setups[0].get(k)!r}, rank {rank} {setup[k]!r}" for k in diff)
                                     + "); every rank needs the same ComfyUI install, kind of device and start-up flags")
        except BaseException:
            self.group.close()
            raise

    def sync(self, snapshot):
        """Make every rank hold ``snapshot`` (a delta when possible). Until every rank reports it, nothing counts
        as synced: a failed or refused sync is repaired by the next one, which sends the full snapshot."""
        self.last_sent = None
        if self.synced is not None and self.synced.version == snapshot.version:
            return
        update = snapshot if self.synced is None else snapshot.diff(self.synced)
        self.synced, self.last_sent = None, dict(update.describe(), kind=update.kind)
        target = list(snapshot.version)
        self._rank0["patch_tensors"] = tensors = {n: t.contiguous() for n, t in sorted(update.tensors.items())}
        result = self.group.run(OP_PATCHES, {"manifest": update.manifest, "target": target, "memory_required": self.memory_required,
                                             "tensors": [[n, str(t.dtype).removeprefix("torch."), list(t.shape)] for n, t in tensors.items()]})
        odd = {r: v["version"] for r, v in enumerate(result.values[1:], 1) if v["version"] != target}
        if odd:
            raise snapshots.SnapshotNotAcked(f"ranks {sorted(odd)} do not hold patch version {target[0]}/{target[1][:12]}: {odd}")
        self.synced = snapshot
        logging.info("MiniMax H3 sequence parallel: %d ranks hold patch snapshot %s (sent %s)", self.world_size,
                     snapshot.describe(), self.last_sent)

    def check(self, transformer_options, payload, x, context):
        """Refuse, before anything is sent, what would run on rank 0's rows only or cannot be split."""
        replace = transformer_options.get("patches_replace", {})
        odd = sorted(str(k) for k in replace if k != "dit") + sorted(str(k) for k in replace.get("dit", {}) if k[0] != "double_block")
        if odd:
            raise ValueError(f"MiniMax H3 sequence parallelism cannot run the block patches {odd} (H3 runs dit double_block "
                             "patches only). Remove them or run on one GPU.")
        self.attention_name(transformer_options)
        video, audio = x
        layout = payload.get("layout")
        if layout is None:
            lat = [-(-n // p) * p for n, p in zip(video.shape[2:], self._rank0["model"].patch_size)]
            layout = PackedLayout(context.shape[1], *lat, audio.shape[-1], keyframes=payload.get("keyframes"), refs=payload.get("refs"))
        if self.world_size > layout.seq_len:
            raise ValueError(f"MiniMax H3 cannot split {layout.seq_len} packed rows over {self.world_size} GPUs: "
                             f"use at most {layout.seq_len} devices")

    def _options(self, transformer_options, send):
        """The options every rank's forward gets: data is sent; anything else stays on rank 0 (OnRank0)."""
        out = {}
        for key, value in transformer_options.items():
            if key in (SEQUENCE_PARALLEL, "patches_replace", "optimized_attention_override"):
                continue  # the runner's own; run on rank 0 (patched_blocks); sent by name
            out[key] = (self.inputs.encode(value, f"options.{key}", send) if _plain(value)
                        else {"__rank0__": [key, type(value).__name__]})
        return out

    def __call__(self, executor, x, timestep, context, transformer_options, **kwargs):
        """The DIFFUSION_MODEL wrapper: one step on every rank -> rank 0's [video, audio] output. Wrappers added
        after this one (EasyCache, say) run around the sharded step on rank 0, as if added before it: a step
        they skip sends nothing."""
        inner = executor.wrappers[executor.idx + 1:]
        step = functools.partial(self._step, executor.original)
        if inner:
            return comfy.patcher_extension.WrapperExecutor.new_class_executor(step, executor.class_obj, inner).execute(
                x, timestep, context, transformer_options, **kwargs)
        return step(x, timestep, context, transformer_options, **kwargs)

    def _step(self, forward, x, timestep, context, transformer_options, **kwargs):
        if self.synced is None:
            raise snapshots.SnapshotNotAcked("no patch snapshot has been synced to the sequence-parallel ranks; "
                                             "call prepare() (the node does this before sampling) before running steps")
        payload = kwargs.get("minimax_payload") or {}
        self.check(transformer_options, payload, x, context)
        # the packed layout is rebuilt from the shapes on every rank, as the forward does without one
        kwargs = dict(kwargs, minimax_payload={k: v for k, v in payload.items() if not isinstance(v, PackedLayout)})
        send, self.inputs.last_paths = [], []
        args = self.inputs.encode({"x": list(x), "timestep": timestep, "context": context, "kwargs": kwargs}, "step", send)
        options = self._options(transformer_options, send)
        meta = {"args": args, "options": options, "send": [[tid, str(t.dtype).removeprefix("torch."), list(t.shape)] for tid, t in send],
                "held": self.inputs.held(), "fresh_run": self.inputs.fresh_run, "chunks": self.chunks, "memory_required": self.memory_required,
                "fp8_exchange": self.fp8_exchange, "attention": self.attention_name(transformer_options),
                "patched_blocks": sorted(i for _, i in transformer_options.get("patches_replace", {}).get("dit", {}))}
        self.inputs.fresh_run = False
        self._rank0.update(send=[(tid, t.contiguous()) for tid, t in send], options=transformer_options,
                           step=lambda options: forward(x, timestep, context, options, **kwargs))
        try:
            result = self.group.run(OP_FORWARD, meta)
        except BaseException:
            self.inputs.reset()  # the workers may not hold what this step sent
            raise
        finally:
            for key in ("send", "step", "options"):
                self._rank0.pop(key, None)
        self.steps_run += 1
        return result.values[0]

    def unload(self):
        """ComfyUI unloaded rank 0's model: the workers unload theirs (to ComfyUI's offload device) and stay; the next
        sampling run loads them again, as it does rank 0's. A broken group is closed instead."""
        if self.group.state == "broken":
            self.close()
        elif self.group.state == "ready":
            held = self.group.run(OP_UNLOAD).values[1:]
            logging.info("MiniMax H3 sequence parallel: model unloaded; %d worker(s) unloaded theirs (%s bytes left on their "
                         "devices) and stay", len(held), held)

    def close(self):
        try:
            self._join()
        except BaseException:
            pass  # a failed start left nothing running
        self.group.close()
        self.synced = None
