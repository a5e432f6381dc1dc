"""Sequence-parallel H3 through comfy.parallel on CPU (gloo, real headless ComfyUI worker processes).

Rank 0's model comes from ComfyUI's loader; workers rebuild it with the same loader call. Patch
snapshots are synced and acked before any step, outputs match the same ComfyUI model run natively
(fp32, max |diff| <= 1e-5 relative to max |native|), and the group survives cancellation and a
killed worker.
"""

import os
import signal
import threading
import time

import pytest

from comfy import model_patcher_snapshot as snapshots
from comfy.ldm.minimax_h3.model import SEQUENCE_PARALLEL_OPTION
from comfy.ldm.minimax_h3.sequence_parallel import SequenceParallel
from comfy.parallel import ParallelCancelled, ParallelGroupError, PreflightMismatch, Timeouts, headless
from h3_cases import tiny_model
from h3_files import INPUT_KINDS, step_inputs, write_h3_file

pytestmark = [pytest.mark.comfyui, pytest.mark.usefixtures("linux_workers")]
TOL = 1e-5


def _rel(a, b):
    return max(float((u - v).abs().max() / v.abs().max()) for u, v in zip(a, b))


def _step(model, cfg, opts=None, kind="refs_all", **kw):
    x, t, c, p = step_inputs(cfg, kind, height=5, **kw)
    return model(x, t, c, dict(opts or {}), minimax_payload=p)


@pytest.fixture(scope="module")
def _shared_group(comfyui_patched_module, tmp_path_factory):
    import comfy.sd
    _, cfg = tiny_model(num_layers=3)
    path = write_h3_file(str(tmp_path_factory.mktemp("sp") / "h3_tiny.safetensors"), cfg, seed=4)
    base = comfy.sd.load_diffusion_model(path)
    sp = SequenceParallel(["cpu"] * 3, headless.loader_call(base), headless.execution_settings(),
                          timeouts=Timeouts(startup=120, op=60, cancel=10))
    try:
        sp.ensure_started(base)
        yield sp, base.model.diffusion_model, base, cfg
    finally:
        sp.close()


@pytest.fixture
def sp_group(_shared_group):
    """One group for the module's tests (each leaves it ready; restarted if a failing test broke it)."""
    sp, _, base, _ = _shared_group
    if sp.group.state != "ready":
        sp.ensure_started(base)
    return _shared_group


def test_parity_for_every_input_kind_after_the_snapshot_is_acked(sp_group):
    sp, rank0, base, cfg = sp_group
    opts = {SEQUENCE_PARALLEL_OPTION: sp}
    sp.prepare(base)
    assert sp.synced.key_count == 0
    for kind in INPUT_KINDS:
        assert _rel(_step(rank0, cfg, opts, kind), _step(rank0, cfg, kind=kind)) <= TOL, kind


def test_cancel_mid_sampling_leaves_the_group_reusable(sp_group):
    sp, rank0, base, cfg = sp_group
    sp.prepare(base)
    opts = {SEQUENCE_PARALLEL_OPTION: sp}
    steps, stop = [], threading.Event()

    def sample():
        try:
            for _ in range(200):
                steps.append(_step(rank0, cfg, opts, text_len=64))
        except ParallelCancelled as e:
            stop.set()
            steps.append(e)

    t = threading.Thread(target=sample)
    t.start()
    while len(steps) < 2:
        time.sleep(0.01)
    t0 = time.monotonic()
    # cancel() acts on the step in flight; between two steps it returns False, so retry until it lands
    while not sp.group.cancel() and t.is_alive() and time.monotonic() - t0 < 10:
        time.sleep(0.001)
    t.join(timeout=30)
    assert stop.is_set() and isinstance(steps[-1], ParallelCancelled)
    assert time.monotonic() - t0 < 10
    assert sp.group.state == "ready"
    assert _rel(_step(rank0, cfg, opts), _step(rank0, cfg)) <= TOL


def test_killed_worker_gives_a_clear_error_and_recovers(sp_group):
    sp, rank0, base, cfg = sp_group
    sp.prepare(base)
    opts = {SEQUENCE_PARALLEL_OPTION: sp}
    victim = sp.group.worker_pids()[2]
    killer = threading.Timer(0.3, os.kill, (victim, signal.SIGKILL))
    killer.start()
    with pytest.raises(ParallelGroupError) as ei:
        for _ in range(500):
            _step(rank0, cfg, opts, text_len=64)
    killer.join()
    assert ei.value.rank == 2 and "rank 2" in str(ei.value)
    sp.ensure_started(base)  # rebuilds the broken group; patches must be re-synced first
    with pytest.raises(snapshots.SnapshotNotAcked, match="no patch snapshot has been synced"):
        _step(rank0, cfg, opts)
    sp.prepare(base)
    assert _rel(_step(rank0, cfg, opts), _step(rank0, cfg)) <= TOL


def test_bad_inputs_are_refused_on_rank0_and_the_same_workers_run_the_next_step(sp_group, monkeypatch):
    # everything input-derived that could fail inside the step is checked while rank 0 builds the plan,
    # before anything is sent: one rank failing inside a step would break the group and restart every worker
    from comfy.ldm.minimax_h3 import kernels
    sp, rank0, base, cfg = sp_group
    sp.prepare(base)
    opts = {SEQUENCE_PARALLEL_OPTION: sp}
    pids, steps = sp.group.worker_pids(), sp.steps_run
    x, t, c, p = step_inputs(cfg, "keyframes", height=5)
    audio_conds = p["cond_audio_latents"]
    bad = [
        (dict(p, seed=2**70), {}, r"minimax_payload\['seed'\] 1180591620717411303424 is out of range for the video"),
        # the audio condition noise is seeded with seed + 1: a valid 64-bit seed can still overflow it
        (dict(p, seed=2**64 - 1), {}, r"out of range for the audio condition noise \(it seeds a torch.Generator with 18446744073709551616\)"),
        (dict(p, cond_video_latents=p["cond_video_latents"][:1]), {}, "layout expects .* video condition rows but the conditioning latents give"),
        (dict(p, cond_audio_latents=[z[:, :16] for z in audio_conds]), {}, r"\['cond_audio_latents'\]\[0\] must be a 4-d latent with 32"),
        (p, {"patches_replace": {"dit": {("double_block", 0): lambda args, extra: args}}}, "cannot run block replacement patches"),
    ]
    for payload, extra, message in bad:
        with pytest.raises(ValueError, match=message):
            rank0(x, t, c, dict(opts, **extra), minimax_payload=payload)
        assert sp.group.state == "ready" and sp.group.worker_pids() == pids, message
    # an attention function swapped on rank 0 only (the re-export's optimized_attention) is refused the same way
    monkeypatch.setattr(kernels, "optimized_attention", lambda *args, **kwargs: None)
    with pytest.raises(ValueError, match="attention function was replaced on rank 0"):
        rank0(x, t, c, dict(opts), minimax_payload=p)
    monkeypatch.undo()
    assert sp.steps_run == steps and sp.group.worker_pids() == pids
    assert _rel(rank0(x, t, c, dict(opts), minimax_payload=p), rank0(x, t, c, {}, minimax_payload=p)) <= TOL
    assert sp.steps_run == steps + 1 and sp.group.worker_pids() == pids


def test_a_rank_on_another_patch_version_refuses_the_step_before_its_shard_runs(sp_group):
    # the forward's preflight covers the patch version every rank holds: rank 0 is made to believe it
    # holds another one than the snapshot the workers acked (as if a sync had not landed)
    sp, rank0, base, cfg = sp_group
    sp.prepare(base)
    opts = {SEQUENCE_PARALLEL_OPTION: sp}
    pids = sp.group.worker_pids()
    held = sp._rank0["patch_version"]
    sp._rank0["patch_version"] = ("another lineage", held[1])
    try:
        with pytest.raises(PreflightMismatch, match=r"ranks \[1, 2\] computed a different preflight digest"):
            _step(rank0, cfg, opts)
    finally:
        sp._rank0["patch_version"] = held
    assert sp.group.state == "ready" and sp.group.worker_pids() == pids
    assert _rel(_step(rank0, cfg, opts), _step(rank0, cfg)) <= TOL
