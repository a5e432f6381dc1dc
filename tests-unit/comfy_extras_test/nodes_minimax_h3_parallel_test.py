"""The "MiniMax H3 Sequence Parallel" node inside a real ComfyUI (CPU worker processes).

ComfyUI's own loader nodes, LoRA loader, ModelPatcher and sampler drive the node as a workflow does;
every result is compared with the same workflow without the node. Workers are headless ComfyUI
processes that rebuild the model with rank 0's loader call and take the patches through ComfyUI's
patch path, so a case passes only if that rebuild matches rank 0 for its weight format. The tests
give the node CPU "GPUs" by replacing comfy.model_management's device list.

Tolerance: max |sharded - native| <= 1e-5 * max |native|. On the CPU every format computes in fp32
(ComfyUI casts bf16 and fp8 weights up), and sharding only changes which rank computes which rows and
heads, so the two runs differ by float reassociation at most; a LoRA or another weight format moves
the output by more than 1e-3 (asserted), so the tolerance separates right from wrong.
"""

import logging
import os
import re
import subprocess
import sys
import time
import weakref

import pytest
import torch
from safetensors.torch import save_file

from comfy.cli_args import args

if not torch.cuda.is_available():
    args.cpu = True

import comfy.model_management  # noqa: E402
import comfy.patcher_extension  # noqa: E402
from h3_files import TINY_CONFIG, lora_state_dict, random_state_dict, step_inputs, write_h3_file  # noqa: E402

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the node's worker processes run on Linux")
SLOW = pytest.mark.skipif(not os.environ.get("COMFY_TEST_SLOW"), reason="set COMFY_TEST_SLOW=1")
TOL = 1e-5
LORA_KEYS = len(lora_state_dict(TINY_CONFIG)) // 3  # up, down, alpha per weight


class Workflow:
    """ComfyUI's nodes on a models folder of tiny H3 files; ``step`` runs one denoising step as the sampler does."""

    def __init__(self, root):
        import nodes
        from comfy_extras import nodes_minimax_h3_parallel, nodes_model_advanced
        self.nodes, self.sp_node, self.advanced = nodes, nodes_minimax_h3_parallel, nodes_model_advanced
        self.root = root

    def unet(self, name, weight_dtype="default"):
        return self.nodes.UNETLoader().load_unet(name, weight_dtype)[0]

    def unet_with(self, name, **model_options):
        """ComfyUI's loader with model_options no loader node offers (bf16 storage on a CPU that would upcast)."""
        import comfy.sd
        import folder_paths
        return comfy.sd.load_diffusion_model(folder_paths.get_full_path_or_raise("diffusion_models", name), model_options=model_options)

    def lora(self, model, strength, name="lora.safetensors"):
        return self.nodes.LoraLoaderModelOnly().load_lora_model_only(model, name, strength)[0]

    def parallel(self, model, gpus, fp8_exchange=False, **kw):
        return self.sp_node.MiniMaxH3SequenceParallel.execute(model, gpus, fp8_exchange, **kw).result[0]

    def vae(self, vae, model, **kw):
        return self.sp_node.MiniMaxH3SequenceParallelVAE.execute(vae, model, **kw).result[0]

    def compute_dtype(self, model, dtype):
        return self.advanced.ModelComputeDtype().patch(model, dtype)[0]

    def attention(self, model, name):
        return self.advanced.ModelAttentionBackend().patch(model, name)[0]

    def sample(self, model, seed=7, steps=3, cfg=2.5):
        """KSampler (euler, cfg > 1) on a small AV latent with fixed random text embeds -> [video, audio] latents."""
        from comfy_extras.nodes_minimax_h3 import EmptyMiniMaxH3LatentAV
        latent = EmptyMiniMaxH3LatentAV.execute(32, 32, 5).result[0]
        g = torch.Generator().manual_seed(3)
        positive = [[torch.randn(1, 7, TINY_CONFIG["text_dim"], generator=g), {}]]
        negative = [[torch.randn(1, 5, TINY_CONFIG["text_dim"], generator=g), {}]]
        out = self.nodes.common_ksampler(model, seed, steps, cfg, "euler", "simple", positive, negative, latent)[0]["samples"]
        return out.unbind() if out.is_nested else [out]

    @staticmethod
    def step(patcher, seed=0, sigma=0.6, layout=None, inputs=None):
        comfy.model_management.load_models_gpu([patcher])
        patcher.pre_run()
        x, t, c, p = inputs or step_inputs(TINY_CONFIG, "keyframes", seed=seed, height=5, sigma=sigma)
        if layout is not None:
            p["layout"] = layout
        c = c.to(patcher.model.get_dtype_inference())
        # as sampling merges them (sampler_helpers.prepare_sampling): the patcher's wrappers in transformer_options
        options = dict(patcher.model_options["transformer_options"], wrappers=patcher.wrappers)
        return patcher.model.diffusion_model(x, t, c, transformer_options=options, minimax_payload=p)


def _rel(a, b):
    return max(float((u - v).abs().max() / v.abs().max()) for u, v in zip(a, b))


def _runner(patcher):
    return patcher.get_wrappers(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, "minimax_h3_sequence_parallel")[0]


@pytest.fixture
def workflow(tmp_path, monkeypatch):
    import folder_paths
    for kind in ("diffusion_models", "loras"):
        (tmp_path / kind).mkdir()
        monkeypatch.setitem(folder_paths.folder_names_and_paths, kind, ([str(tmp_path / kind)], folder_paths.supported_pt_extensions))
    monkeypatch.setattr(folder_paths, "filename_list_cache", {})
    # the node shards over the devices ComfyUI sees: here up to 3 CPU ranks
    cpu = torch.device("cpu")
    monkeypatch.setattr(comfy.model_management, "get_torch_device", lambda: cpu)
    monkeypatch.setattr(comfy.model_management, "get_all_torch_devices", lambda exclude_current=False: [cpu] * 3)
    write_h3_file(str(tmp_path / "diffusion_models" / "h3_fp32.safetensors"), TINY_CONFIG, seed=2)
    save_file(lora_state_dict(TINY_CONFIG), str(tmp_path / "loras" / "lora.safetensors"))
    w = Workflow(tmp_path)
    made = weakref.WeakSet()

    class Recorded(w.sp_node.SequenceParallel):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.add(self)
    monkeypatch.setattr(w.sp_node, "SequenceParallel", Recorded)
    yield w
    comfy.model_management.unload_all_models()
    for sp in list(made):  # a failed test may keep its model (and so its workers) alive in its traceback
        sp.close()


def _formats(w):
    """(name, base model, native-side transform, weight dtype that must be loaded) per weight format."""
    write_h3_file(str(w.root / "diffusion_models" / "h3_bf16.safetensors"), TINY_CONFIG, seed=2, dtype=torch.bfloat16)
    write_h3_file(str(w.root / "diffusion_models" / "h3_scaled_fp8.safetensors"), TINY_CONFIG, seed=2, fmt="scaled_fp8")

    def bf16_fp32_compute(m):
        return w.compute_dtype(m, "fp32")
    return [
        ("fp32", lambda: w.unet("h3_fp32.safetensors"), None, torch.float32),
        ("bf16 weights, fp32 compute", lambda: w.unet_with("h3_bf16.safetensors", dtype=torch.bfloat16), bf16_fp32_compute,
         torch.bfloat16),
        ("fp8_e4m3fn weights", lambda: w.unet("h3_fp32.safetensors", "fp8_e4m3fn"), None, torch.float8_e4m3fn),
        ("scaled fp8 file", lambda: w.unet("h3_scaled_fp8.safetensors"), None, None),
    ]


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=SLOW)])
def test_node_matches_the_workflow_without_it_for_every_weight_format(workflow, world):
    w = workflow
    natives = {}
    for name, load, extra, weight_dtype in _formats(w):
        base = load()
        if weight_dtype is not None:
            assert base.model.diffusion_model.blocks[0].attn.qkv_proj.weight.dtype == weight_dtype, name
        node = w.parallel(base, world)
        if extra is not None:
            base, node = extra(base), extra(node)
        sp = _runner(node)
        try:
            native, native_lora = w.step(base), w.step(w.lora(base, 0.8))
            sharded = w.step(node)
            pids = sp.group.worker_pids()
            assert sp.last_sent["kind"] == "snapshot" and sp.last_sent["keys"] == 0
            sharded_lora = w.step(w.lora(node, 0.8))
            assert sp.last_sent["kind"] == "delta" and sp.last_sent["changed"] == LORA_KEYS
            assert sp.group.worker_pids() == pids and len(pids) == world - 1
        finally:
            sp.close()
            comfy.model_management.unload_all_models()
        assert _rel(sharded, native) <= TOL, name
        assert _rel(sharded_lora, native_lora) <= TOL, name
        assert _rel(native_lora, native) > 1e-3, name  # the LoRA really changes the result
        natives[name] = native
    first = next(iter(natives.values()))
    for name, out in list(natives.items())[1:]:
        assert _rel(out, first) > 1e-4, f"{name} computes exactly what the first format does: the format was not applied"


def test_one_gpu_or_one_allowed_passes_the_model_through(workflow, monkeypatch):
    w = workflow
    base = w.unet("h3_fp32.safetensors")
    assert w.parallel(base, 1) is base
    monkeypatch.setattr(comfy.model_management, "get_all_torch_devices", lambda exclude_current=False: [torch.device("cpu")])
    assert w.parallel(base, 8) is base


def test_the_node_caps_its_ranks_at_max_gpus_and_the_devices_comfyui_sees(workflow):
    w = workflow
    base = w.unet("h3_fp32.safetensors")
    assert _runner(w.parallel(base, 2)).world_size == 2
    assert _runner(w.parallel(base, 8)).world_size == 3  # the fixture's machine has 3 devices


def test_step_inputs_travel_once_per_sampling_run_and_control_frames_stay_small(workflow, monkeypatch):
    """KSampler at cfg > 1: after the first cond and uncond call, a call sends through the transport only
    what changed since (the latents, the timestep, the sigmas of the step); the context, payload and
    sample sigmas of the run stay on the workers. No tensor crosses a control pipe: each call's frames
    are a few KB of JSON."""
    from comfy.parallel import channel
    w = workflow
    base = w.unet("h3_fp32.safetensors")
    node = w.parallel(base, 2)
    sp = _runner(node)
    frames, calls = [], []
    w.step(node)  # the workers start with the code as imported; the count below replaces a function of it
    write = channel.write
    monkeypatch.setattr(channel, "write", lambda fd, data, timeout: (frames.append(len(data)), write(fd, data, timeout))[1])
    run = sp.group.run

    def recorded(op, meta=None, timeout=None):
        before = len(frames)
        result = run(op, meta, timeout)
        if op.endswith("forward"):
            calls.append((sp.inputs.last_paths, sum(frames[before:])))
        return result
    try:
        sp.group.run = recorded
        sharded = w.sample(node, steps=4)
        native = w.sample(base, steps=4)
    finally:
        sp.close()
    assert len(calls) == 8 and _rel(sharded, native) <= TOL
    first, later = {p for paths, _ in calls[:2] for p in paths}, [set(paths) for paths, _ in calls[2:]]
    assert {"step.context", "options.sample_sigmas"} <= first, first
    per_step = {"step.x[0]", "step.x[1]", "step.timestep", "options.sigmas"}
    assert all(paths <= per_step for paths in later) and any(later)
    assert all(nbytes < 16384 for _, nbytes in calls), [n for _, n in calls]


def test_bad_inputs_fail_as_on_one_process_and_leave_the_group_ready(workflow):
    """What the single-process model refuses is refused alike (same exception type) and the next good
    step runs on the same workers; a NaN timestep runs as on one process; more ranks than packed rows
    are refused on rank 0 before anything is sent."""
    from comfy.ldm.minimax.model import PackedLayout
    w = workflow
    base = w.unet("h3_fp32.safetensors")
    node = w.parallel(base, 3)
    sp = _runner(node)

    def inputs(change):
        x, t, c, p = step_inputs(TINY_CONFIG, "keyframes", seed=0, height=5)
        return change(x, t, c, p) or (x, t, c, p)

    bad = {
        "a video latent with 23 channels": lambda x, t, c, p: ([x[0][:, :23], x[1]], t, c, p),
        "a mono audio latent": lambda x, t, c, p: ([x[0], x[1][:, :, :1]], t, c, p),
        "a batch of 2": lambda x, t, c, p: ([x[0].repeat(2, 1, 1, 1, 1), x[1].repeat(2, 1, 1, 1)], t, c, p),
        "a context of width 7": lambda x, t, c, p: (x, t, c[..., :7], p),
        "a payload seed of 2**70": lambda x, t, c, p: p.update(seed=2 ** 70),
    }
    try:
        good = w.step(node)
        pids = sp.group.worker_pids()
        for what, change in bad.items():
            try:
                w.step(base, inputs=inputs(change))
                native = None
            except Exception as e:
                native = e
            try:
                w.step(node, inputs=inputs(change))
                sharded = None
            except Exception as e:
                sharded = e
            assert type(sharded) is type(native), (what, native, sharded)
            assert sp.group.state == "ready" and sp.group.worker_pids() == pids, what
        native, sharded = w.step(base, sigma=float("nan")), w.step(node, sigma=float("nan"))
        assert all(torch.isnan(s).all() == torch.isnan(n).all() for s, n in zip(sharded, native))
        with pytest.raises(ValueError, match="cannot split 2 packed rows over 3 GPUs: use at most 2 devices"):
            w.step(node, layout=PackedLayout(1, 1, 2, 2, 0))
        assert sp.group.state == "ready" and sp.group.worker_pids() == pids
        assert _rel(w.step(node), w.step(base)) <= TOL and _rel(good, w.step(base)) <= TOL
    finally:
        sp.close()


def test_sampling_again_and_lora_edits_reuse_the_workers_an_unload_keeps_them_and_freeing_the_model_ends_them(workflow):
    w = workflow
    base = w.unet("h3_fp32.safetensors")
    node = w.parallel(base, 3)
    sp = _runner(node)
    lora = w.lora(node, 0.8)
    w.step(lora, seed=0)
    pids = sp.group.worker_pids()
    assert len(pids) == 2 and sp.last_sent["kind"] == "snapshot" and sp.last_sent["tensor_bytes"] > 0
    w.step(lora, seed=1)  # new seed: nothing to send
    assert sp.last_sent is None and sp.group.worker_pids() == pids
    w.step(w.lora(node, 0.5), seed=1)  # strength change: numbers only
    assert sp.last_sent["kind"] == "delta" and sp.last_sent["changed"] == LORA_KEYS and sp.last_sent["tensor_bytes"] == 0
    assert sp.group.worker_pids() == pids
    w.step(node)  # LoRA removed
    assert sp.last_sent["kind"] == "delta" and sp.last_sent["removed"] == LORA_KEYS and sp.group.worker_pids() == pids
    # the node ran once: a rerun of the workflow with another LoRA reuses the same runner
    assert _runner(w.lora(node, 0.3)) is sp
    # ComfyUI's unload: every worker unloads its model as ComfyUI does, and stays
    held = []
    real_run = sp.group.run
    sp.group.run = lambda *a, **kw: held.append(real_run(*a, **kw)) or held[-1]
    comfy.model_management.unload_all_models()
    del sp.group.run
    assert [r.values[1:] for r in held] == [[0, 0]] and sp.group.state == "ready" and sp.group.worker_pids() == pids
    assert _rel(w.step(w.lora(node, 0.8)), w.step(w.lora(base, 0.8))) <= TOL  # loaded again for the next run
    assert sp.group.worker_pids() == pids
    # the model the node returned is freed (ComfyUI's cache drops it): its workers end, on a thread of their own
    group = sp.group
    del node, lora, sp
    end = time.monotonic() + 60
    while group.state != "closed" and time.monotonic() < end:
        time.sleep(0.05)
    assert group.state == "closed" and group.worker_pids() == {}
    for pid in pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_workers_that_would_run_the_model_differently_are_refused_before_any_step(workflow, monkeypatch):
    """Rank 0 reports another torch than the workers import (as a worker on another install would)."""
    monkeypatch.setattr(torch, "__version__", "0.0.0-rank0")
    w = workflow
    node = w.parallel(w.unet("h3_fp32.safetensors"), 2)
    sp = _runner(node)
    with pytest.raises(ValueError, match="rank 1 does not run the model as rank 0 does \\(torch: rank 0 '0.0.0-rank0'"):
        w.step(node)
    assert sp.group.state == "closed" and sp.synced is None


def test_ksampler_with_cfg_and_a_lora_downstream_equals_the_workflow_without_the_node(workflow):
    w = workflow
    base = w.unet("h3_fp32.safetensors")
    node = w.parallel(base, 2)
    runs = []
    try:
        for model in (w.lora(base, 0.8), w.lora(node, 0.8)):
            runs.append(w.sample(model))
        assert _runner(node).group.state == "ready"
        assert _runner(node).steps_run == 2 * 3  # cond and uncond of every step ran sharded
    finally:
        _runner(node).close()
    native, sharded = runs
    assert _rel(sharded, native) <= TOL
    assert float(native[0].abs().max()) > 0


def test_interrupt_during_a_sharded_step_stops_sampling_and_keeps_the_workers(workflow, monkeypatch):
    """ComfyUI's interrupt arrives while rank 0 computes its share of step 2 (set from inside rank 0's
    forward, so no timing is guessed): ComfyUI's ops raise InterruptProcessingException mid-step, every
    rank leaves the step, the same workers stay ready, and the next run equals the workflow without the node."""
    from comfy.ldm.minimax.model import MiniMaxH3Model
    w = workflow
    base = w.unet("h3_fp32.safetensors")
    node = w.parallel(base, 2)
    sp = _runner(node)
    forward = MiniMaxH3Model._forward

    def interrupted_on_the_second_step(self, *args, **kwargs):
        if sp.steps_run == 1 and kwargs.get("transformer_options", args[3] if len(args) > 3 else {}).get("minimax_h3_sequence_parallel"):
            comfy.model_management.interrupt_current_processing()
        return forward(self, *args, **kwargs)

    try:
        w.step(node)  # the workers start with the model code as imported, before it is replaced here
        sp.steps_run = 0
        monkeypatch.setattr(MiniMaxH3Model, "_forward", interrupted_on_the_second_step)
        with pytest.raises(comfy.model_management.InterruptProcessingException):
            w.sample(node)
        monkeypatch.setattr(MiniMaxH3Model, "_forward", forward)
        assert sp.steps_run == 1 and sp.group.state == "ready"
        pids = sp.group.worker_pids()
        assert not comfy.model_management.processing_interrupted()
        again, native = w.sample(node), w.sample(base)
        assert sp.group.worker_pids() == pids and sp.steps_run == 1 + 6
    finally:
        comfy.model_management.interrupt_current_processing(False)
        sp.close()
    assert _rel(again, native) <= TOL


def test_a_checkpoint_replaced_on_disk_after_rank0_loaded_it_is_refused_before_any_step(workflow):
    """Same file name, same shapes (so the same safetensors header), other weights: the workers would load
    the new file, rank 0 holds the old one. The file's identity (size, mtime, inode) refuses it."""
    from comfy.parallel import ParallelOpError
    w = workflow
    base = w.unet("h3_fp32.safetensors")
    node = w.parallel(base, 2)
    path = str(w.root / "diffusion_models" / "h3_fp32.safetensors")
    write_h3_file(path + ".new", TINY_CONFIG, seed=5)
    os.replace(path + ".new", path)
    sp = _runner(node)
    try:
        with pytest.raises(ParallelOpError, match="h3_fp32.safetensors changed on disk since rank 0 loaded it; load the model again"):
            w.step(node)
        assert sp.group.state == "closed" and sp.group.worker_pids() == {}
    finally:
        sp.close()


def test_a_worker_that_reports_another_patch_state_stops_the_run_and_the_next_run_resends(workflow):
    """LoRA 0.8 runs; a worker then reports another version for the sync of LoRA 0.5: sampling is refused
    and nothing counts as synced. Going back to 0.8 must resend the full snapshot (a runner that still
    recorded 0.8 as synced would skip it and run on 0.5)."""
    import dataclasses
    from comfy.model_patcher_snapshot import SnapshotNotAcked
    w = workflow
    base = w.unet("h3_fp32.safetensors")
    node = w.parallel(base, 2)
    sp = _runner(node)
    run = sp.group.run

    def forged(op, meta=None, timeout=None):
        result = run(op, meta, timeout)
        if op.endswith("patches"):
            result = dataclasses.replace(result, values=[None, {"version": [result.values[1]["version"][0], "0" * 64]}])
        return result

    try:
        w.sample(w.lora(node, 0.8), steps=1)
        sp.group.run = forged
        with pytest.raises(SnapshotNotAcked, match="ranks \\[1\\] do not hold patch version"):
            w.sample(w.lora(node, 0.5), steps=1)
        assert sp.synced is None and sp.steps_run == 2
        del sp.group.run
        again, native = w.sample(w.lora(node, 0.8), steps=1), w.sample(w.lora(base, 0.8), steps=1)
        assert sp.last_sent["kind"] == "snapshot" and sp.last_sent["tensor_bytes"] > 0
    finally:
        sp.close()
    assert _rel(again, native) <= TOL


def test_multigpu_cfg_split_on_the_same_model_is_refused_before_or_after_the_node(workflow):
    """MultiGPU CFG Split marks its model with 'multigpu' additional models (one full copy per extra GPU);
    the node refuses such a model as input, and at sampling time when the split was added downstream."""
    w = workflow
    base = w.unet("h3_fp32.safetensors")
    split = base.clone()
    split.set_additional_models("multigpu", [base.clone()])
    with pytest.raises(ValueError, match="cannot be combined with MultiGPU CFG Split"):
        w.parallel(split, 2)
    node = w.parallel(base, 2)
    downstream = node.clone()
    downstream.set_additional_models("multigpu", [base.clone()])
    try:
        with pytest.raises(ValueError, match="cannot be combined with MultiGPU CFG Split"):
            downstream.pre_run()
        assert _runner(node).group.state == "idle"
    finally:
        _runner(node).close()


def test_workers_start_and_load_while_rank0_loads_its_model(workflow, monkeypatch):
    """The workers' start and checkpoint load begin before rank 0's own load_models_gpu, so a cold start
    costs the larger of the two, not their sum. Here rank 0's load waits until the workers' setup op has
    begun: were it started only after that load, it never would, and the wait would run out."""
    import threading
    w = workflow
    base = w.unet("h3_fp32.safetensors")
    node = w.parallel(base, 2)
    sp = _runner(node)
    started, waited = threading.Event(), []
    run, load = sp.group.run, comfy.model_management.load_models_gpu

    def watched_run(op, meta=None, timeout=None):
        if op.endswith("setup"):
            started.set()
        return run(op, meta, timeout)

    def rank0_load(models, *args, **kwargs):
        if any(getattr(m, "model", None) is base.model for m in models):
            waited.append(started.wait(timeout=120))
        return load(models, *args, **kwargs)

    try:
        sp.group.run = watched_run
        monkeypatch.setattr(comfy.model_management, "load_models_gpu", rank0_load)
        sharded = w.sample(w.lora(node, 0.8), steps=2)
        assert waited and all(waited) and sp.steps_run == 2 * 2
        del sp.group.run
        monkeypatch.setattr(comfy.model_management, "load_models_gpu", load)
        native = w.sample(w.lora(base, 0.8), steps=2)
    finally:
        sp.close()
    assert _rel(sharded, native) <= TOL


def test_easycache_before_or_after_the_node_skips_the_same_steps_and_sends_nothing_for_them(workflow):
    """EasyCache (ComfyUI's node) wraps the diffusion model too; placed before or after this node it runs on
    rank 0 around the sharded step: the output equals EasyCache without the node, and only the model calls
    it does not skip run sharded (a skipped step sends nothing to the workers)."""
    from comfy_extras.nodes_easycache import EasyCacheNode
    w = workflow
    base = w.unet("h3_fp32.safetensors")

    def easycache(m):
        return EasyCacheNode.execute(m, 0.2, 0.15, 0.95, False).result[0]
    calls = []
    counted = easycache(base).clone()
    counted.add_wrapper(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, lambda executor, *a, **k: (calls.append(1), executor(*a, **k))[1])
    native = w.sample(counted, steps=10, cfg=1.0)
    assert 0 < len(calls) < 10  # EasyCache skipped some
    for order, model in (("after", lambda: easycache(w.parallel(base, 2))), ("before", lambda: w.parallel(easycache(base), 2))):
        m = model()
        sp = _runner(m)
        before = sp.steps_run
        try:
            sharded = w.sample(m, steps=10, cfg=1.0)
            assert sp.steps_run - before == len(calls), order
        finally:
            sp.close()
        assert _rel(sharded, native) <= TOL, order


def test_the_node_s_attention_runs_on_every_rank_by_its_registered_name(workflow):
    """The node's `attention` input: the function registered under that name with comfy.ldm.modules.attention
    (here by a test module, which the workers import as they would need a custom node's) runs on every rank:
    its effect is in the sharded output exactly as natively. An attention patched onto the model outside the
    node (core's ModelAttentionBackend after it) is refused before anything is sent."""
    from comfy_extras_test import h3_attention_for_tests
    from comfy.ldm.modules import attention
    w = workflow
    base = w.unet("h3_fp32.safetensors")
    with_attention = base.clone()
    with_attention.set_model_optimized_attention(attention.get_attention_function(h3_attention_for_tests.NAME))
    plain, native = w.step(base), w.step(with_attention)
    node = w.parallel(base, 2, attention=h3_attention_for_tests.NAME)
    sp = _runner(node)
    sp.imports.append(h3_attention_for_tests.__name__)
    try:
        sharded = w.step(node)
        pids = sp.group.worker_pids()
        with pytest.raises(ValueError, match="choose it in the node's 'attention' input"):
            w.step(w.attention(node, "pytorch attention"))
        assert sp.group.worker_pids() == pids and sp.steps_run == 1
    finally:
        sp.close()
    assert _rel(sharded, native) <= TOL and _rel(native, plain) > 1e-3


def test_the_node_offers_comfyuis_default_and_every_registered_attention_name():
    from comfy.ldm.modules import attention
    from comfy_extras.nodes_minimax_h3_parallel import DEFAULT_ATTENTION, MiniMaxH3SequenceParallel
    spec = MiniMaxH3SequenceParallel.INPUT_TYPES()["optional"]["attention"][1]
    assert spec["default"] == DEFAULT_ATTENTION == spec["options"][0]
    assert sorted(spec["options"][1:]) == sorted(attention.REGISTERED_ATTENTION_FUNCTIONS) and "pytorch" in spec["options"]


@pytest.mark.parametrize("world,feeds_block", [(2, False), (3, False), (2, True)])
def test_a_fun_controlnet_patch_runs_on_rank0_and_equals_the_workflow_without_the_node(workflow, world, feeds_block):
    """The Fun ControlNet-Union tower (comfy/ldm/minimax/controlnet.py) joins the model as double-block
    patches, as its apply node does. Under sharding the model's own block runs sharded on every rank, its
    input and output rows are gathered on rank 0, the patch (control tower included) runs there as on one
    GPU, then every rank gets its rows back: KSampler with the patch equals the same workflow without the
    node. ``feeds_block``: the patch calls the model's block on other input (hint added before it), which
    rank 0 then runs on the whole sequence."""
    import comfy.ops
    from comfy.ldm.minimax.controlnet import MiniMaxH3FunControl
    c = TINY_CONFIG
    control = MiniMaxH3FunControl(control_in_dim=4, injection_layers=(0, 1), hidden_size=c["hidden_size"],
                                  num_attention_heads=c["num_attention_heads"], attention_head_dim=c["attention_head_dim"],
                                  ffn_hidden_size=c["ffn_hidden_size"], time_embed_dim=c["time_embed_dim"], dtype=torch.float32,
                                  operations=comfy.ops.disable_weight_init).requires_grad_(False)
    control.load_state_dict(random_state_dict(control, seed=5))
    for module in control.modules():  # its own (empty) patch lists, not comfy.ops' class-level ones
        if hasattr(module, "weight_function"):
            module.weight_function, module.bias_function = [], []
    control_latent = torch.randn(1, 4, 2, 2, 2, generator=torch.Generator().manual_seed(6))
    state = {}

    def patch(args, extra):
        i = args["transformer_options"]["block_index"]
        if i == 0:
            state["c"] = control.init_stream(args["img"], control_latent, args["layout"], args["t_emb"])
        state["c"], hint = control.step(i, state["c"], args["t_emb"], args["mod_segments"], args["rope_freqs"], args["transformer_options"])
        if feeds_block:
            return extra["original_block"](dict(args, img=args["img"] + 0.7 * hint))
        out = extra["original_block"](args)["img"]
        state.setdefault("aliased", set()).add(out is args["img"])  # the block adds into its input, sharded or not
        return {"img": out + 0.7 * hint}

    def with_control(m):
        m = m.clone()
        for i in control.injection_layers:
            m.set_model_patch_replace(patch, "dit", "double_block", i)
        return m
    w = workflow
    base = w.unet("h3_fp32.safetensors")
    rows = []  # rows of the model's own blocks run in this process (the tower's blocks are not these modules)
    hooks = [b.register_forward_pre_hook(lambda m, a: rows.append(a[0].shape[0])) for b in base.model.diffusion_model.blocks]
    plain, native = w.sample(base), w.sample(with_control(base))
    wholes = set(rows)
    node = w.parallel(base, world)
    sp = _runner(node)
    try:
        rows.clear()
        sharded = w.sample(with_control(node))
        assert sp.steps_run == 2 * 3
    finally:
        for h in hooks:
            h.remove()
        sp.close()
    assert _rel(sharded, native) <= TOL and _rel(native, plain) > 1e-3
    # the model's blocks ran on rank 0's rows, sharded; a patch feeding its block other input gets it on the whole sequence
    whole = [r for r in rows if r in wholes]  # blocks run on a whole sequence (cond or uncond)
    assert len(whole) == (len(control.injection_layers) * 2 * 3 if feeds_block else 0)
    assert state.get("aliased", {True}) == {True}


CUSTOM_LOADER = """
import comfy.sd
import safetensors.torch


def load(path):
    # its own way: the file read here, the model built from the state dict; then how to do it again
    model = comfy.sd.load_diffusion_model_state_dict(safetensors.torch.load_file(path))
    model.cached_patcher_init = (load, (path,))
    return model


class H3TestLoader:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"path": ("STRING", {})}}
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "go"
    CATEGORY = "testing"

    def go(self, path):
        return (load(path),)


class H3TestLoaderWithoutRecord(H3TestLoader):
    def go(self, path):
        return (comfy.sd.load_diffusion_model_state_dict(safetensors.torch.load_file(path)),)


NODE_CLASS_MAPPINGS = {"H3TestLoader": H3TestLoader, "H3TestLoaderWithoutRecord": H3TestLoaderWithoutRecord}
"""


def test_a_model_from_a_custom_node_loader_shards_with_a_lora_once_allowed(workflow, tmp_path, caplog):
    """A loader node of a custom node (loaded from a custom_nodes folder as ComfyUI loads one) that registers
    a cached_patcher_init factory: refused by default, naming its file and the node's allow_custom_loader;
    allowed, the workers import its module from its file and call the factory (logged on start), so the
    model shards, LoRA included, with the output of the workflow without the node. One that records nothing
    is refused by name before any worker starts."""
    import asyncio
    import nodes
    folder = tmp_path / "custom_nodes" / "h3_test_loader"
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text(CUSTOM_LOADER)
    assert asyncio.run(nodes.load_custom_node(str(folder)))
    path = str(workflow.root / "diffusion_models" / "h3_fp32.safetensors")
    loaded = nodes.NODE_CLASS_MAPPINGS["H3TestLoader"]().go(path)[0]
    w = workflow
    native = w.sample(w.lora(loaded, 0.8))
    init = str(folder / "__init__.py")
    with pytest.raises(ValueError, match=f"loaded by load of {re.escape(init)}, not by ComfyUI's own loaders.*allow_custom_loader"):
        w.parallel(loaded, 2)
    node = w.parallel(loaded, 2, allow_custom_loader=True)
    sp = _runner(node)
    try:
        with caplog.at_level(logging.INFO):
            sharded = w.sample(w.lora(node, 0.8))
        assert sp.call["qualname"] == "load" and sp.steps_run == 2 * 3
        assert any(f"load the model with {sp.call['module']}.load ({init})" in r.getMessage() for r in caplog.records)
    finally:
        sp.close()
    assert _rel(sharded, native) <= TOL
    bare = nodes.NODE_CLASS_MAPPINGS["H3TestLoaderWithoutRecord"]().go(path)[0]
    with pytest.raises(ValueError, match="a custom loader must register a cached_patcher_init factory"):
        w.parallel(bare, 2)


def test_workers_that_load_and_merge_longer_than_any_fixed_bound_are_waited_for_and_a_stopped_one_is_named(workflow):
    """Each worker's checkpoint load and its LoRA merge take 8 s more (longer than Timeouts.stopped and
    than the 7 s bound an earlier version killed such workers at): with the node's default timeouts the
    start, the sync and the step succeed and equal the workflow without the node. Then, with 3 ranks, a
    worker stopped (SIGSTOP) while the other still loads is named within Timeouts.stopped plus margin."""
    import signal
    import threading
    import time
    from comfy.parallel import ParallelGroupError
    w = workflow
    base = w.unet("h3_fp32.safetensors")
    native = w.step(w.lora(base, 0.8))
    node = w.parallel(base, 2)
    sp = _runner(node)
    sp.imports.append("comfy_extras_test.h3_slow_worker_for_tests")
    sp.env = {"H3SP_TEST_SLOW_S": "8"}
    t0 = time.monotonic()
    try:
        sharded = w.step(w.lora(node, 0.8))
        assert time.monotonic() - t0 >= 16 and sp.group.state == "ready"
    finally:
        sp.close()
    assert _rel(sharded, native) <= TOL

    node = w.parallel(base, 3)
    sp = _runner(node)
    sp.imports.append("comfy_extras_test.h3_slow_worker_for_tests")
    sp.env = {"H3SP_TEST_SLOW_S": "30"}
    stopped = []

    def stop_rank1_once_loading():
        while not (sp.group.worker_pids() and sp.group._op is not None and sp.group._op.name.endswith("setup")):
            time.sleep(0.05)
        stopped.append(time.monotonic())
        os.kill(sp.group.worker_pids()[1], signal.SIGSTOP)
    threading.Thread(target=stop_rank1_once_loading, daemon=True).start()
    try:
        with pytest.raises(ParallelGroupError, match="worker rank 1 .* stayed stopped"):
            w.step(node)
        assert time.monotonic() - stopped[0] < 5 + 10
    finally:
        sp.close()


@pytest.mark.parametrize("world", [2, 3])
def test_the_vae_decode_shared_out_over_the_ranks_equals_comfyuis_decode(workflow, world, tmp_path, caplog):
    """ComfyUI's VAE decode (a small H3 video VAE: 2 temporal chunks of 2 x 2 tiles) against the node's VAE, whose
    tiles the sequence-parallel model's ranks decode, in inference mode as ComfyUI runs nodes: bit-identical on
    CPU ranks. Refused first (the VAE comes from a test module's loader), then allowed."""
    from comfy_extras_test import h3_vae_for_tests as small_vae
    w = workflow
    path = str(tmp_path / "h3_vae.safetensors")
    small_vae.write_file(path)
    vae = small_vae.load(path)
    z = torch.randn(1, 24, 12, 20, 20, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():  # as ComfyUI runs its nodes
        want = vae.decode(z)
    node = w.parallel(w.unet("h3_fp32.safetensors"), world)
    sp = _runner(node)
    with pytest.raises(ValueError, match="allow_custom_loader"):
        w.vae(vae, node)
    sharded = w.vae(vae, node, allow_custom_loader=True)
    with caplog.at_level(logging.INFO), torch.inference_mode():
        assert torch.equal(sharded.decode(z), want)  # the workers are not up yet: rank 0 decodes alone
    assert "decoding on one GPU" in caplog.text
    w.step(node)
    runs = []
    real_run = sp.group.run
    sp.group.run = lambda *a, **kw: runs.append(real_run(*a, **kw)) or runs[-1]
    with torch.inference_mode():
        got = sharded.decode(z)
    del sp.group.run
    tiles = runs[0].values[1:]
    assert tiles == [len(range(r, 8, world)) for r in range(1, world)]  # of the 8 tiles, call k on rank k % world
    assert torch.equal(got, want)  # the same decoder calls on the same inputs, blended by the same code
    assert _rel(w.step(node), w.step(w.unet("h3_fp32.safetensors"))) <= TOL  # the DiT after the decode


def test_a_worker_killed_during_the_vae_decode_is_named_and_the_next_decode_runs_on_rank0(workflow, tmp_path, monkeypatch, caplog):
    import signal

    from comfy.ldm.minimax.vae import MiniMaxH3VideoVAE
    from comfy.parallel import ParallelGroupError
    from comfy_extras_test import h3_vae_for_tests as small_vae
    w = workflow
    path = str(tmp_path / "h3_vae.safetensors")
    small_vae.write_file(path)
    vae = small_vae.load(path)
    z = torch.randn(1, 24, 12, 20, 20, generator=torch.Generator().manual_seed(4))
    node = w.parallel(w.unet("h3_fp32.safetensors"), 2)
    sp = _runner(node)
    sharded = w.vae(vae, node, allow_custom_loader=True)
    w.step(node)
    pid = sp.group.worker_pids()[1]
    real = MiniMaxH3VideoVAE._decode_pixels

    def kill_then_decode(self, tile):  # rank 0's first tile: its peer dies before sending its own
        os.kill(pid, signal.SIGKILL)
        monkeypatch.setattr(MiniMaxH3VideoVAE, "_decode_pixels", real)
        return real(self, tile)
    monkeypatch.setattr(MiniMaxH3VideoVAE, "_decode_pixels", kill_then_decode)
    with torch.inference_mode():
        with pytest.raises(ParallelGroupError, match=f"worker rank 1 \\(pid {pid}, cpu\\) was killed by SIGKILL during op 'minimax_h3.vae_decode'"):
            sharded.decode(z)
        assert sp.group.state == "broken"
        with caplog.at_level(logging.INFO):
            assert torch.equal(sharded.decode(z), vae.decode(z))
    assert "decoding on one GPU" in caplog.text


SIMULATED = """
import os, sys, asyncio, logging
sys.path.insert(0, os.getcwd())
from comfy.cli_args import args
args.cpu = True
# what picks a native backend by platform at import is imported for real first, as on that platform
import torch, comfy.model_management, comfy.sd, folder_paths, subprocess, multiprocessing, tempfile, shutil, nodes
for kind in ("input", "output", "temp"):  # extra nodes make folders there at load
    getattr(folder_paths, "set_" + kind + "_directory")(os.path.join({scratch!r}, kind))
sys.modules["resource"] = None
for name in ("memfd_create", "eventfd", "pidfd_open", "fork", "killpg", "setsid"):
    if hasattr(os, name):
        delattr(os, name)
sys.platform = {platform!r}
failed = []
logging.warning = lambda msg, *a: failed.append(msg % a if a else msg)
asyncio.run(nodes.init_extra_nodes(init_custom_nodes=False, init_api_nodes=False))
import comfy.parallel, comfy.ldm.minimax.sequence_parallel
print("ours:", "MiniMaxH3SequenceParallel" in nodes.NODE_CLASS_MAPPINGS)
print("failed:", [m for m in failed if "minimax_h3_parallel" in m])
try:
    comfy.parallel.ParallelGroup().start(["cpu", "cpu"])
except comfy.parallel.ParallelError as e:
    print("start:", e)
"""


@pytest.mark.parametrize("platform", ["win32", "darwin"])
def test_the_node_and_comfyuis_extra_nodes_load_on_other_platforms(platform, tmp_path):
    """Simulated (no `resource` module, no Linux-only os functions, sys.platform): the series' modules import
    and register the node; only a group start says it needs Linux."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(comfy.model_management.__file__)))
    out = subprocess.run([sys.executable, "-c", SIMULATED.format(platform=platform, scratch=str(tmp_path))], cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ours: True" in out.stdout and "failed: []" in out.stdout, out.stdout + out.stderr[-2000:]
    assert f"start: parallel worker groups run on Linux only (this is {platform})" in out.stdout
