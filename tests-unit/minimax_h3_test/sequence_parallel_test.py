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
from comfy.parallel import ParallelCancelled, ParallelGroupError, Timeouts, headless
from h3_cases import tiny_model
from h3_files import INPUT_KINDS, step_inputs, write_h3_file

pytestmark = pytest.mark.comfyui
TOL = 1e-5


def _rel(a, b):
    return max(float((u - v).abs().max() / v.abs().max()) for u, v in zip(a, b))


def _step(model, cfg, opts=None, kind="refs_all", **kw):
    x, t, c, p = step_inputs(cfg, kind, height=5, **kw)
    return model(x, t, c, dict(opts or {}), minimax_payload=p)


@pytest.fixture
def sp_group(comfyui_patched, tmp_path):
    import comfy.sd
    _, cfg = tiny_model(num_layers=3)
    path = write_h3_file(str(tmp_path / "h3_tiny.safetensors"), cfg, seed=4)
    base = comfy.sd.load_diffusion_model(path)
    sp = SequenceParallel(["cpu"] * 3, headless.loader_call(base), headless.execution_settings(),
                          timeouts=Timeouts(startup=120, op=60, cancel=10))
    try:
        sp.ensure_started(base)
        yield sp, base.model.diffusion_model, base, cfg
    finally:
        sp.close()


def test_parity_for_every_input_kind_after_the_snapshot_is_acked(sp_group):
    sp, rank0, base, cfg = sp_group
    opts = {SEQUENCE_PARALLEL_OPTION: sp}
    with pytest.raises(snapshots.SnapshotNotAcked, match="no patch snapshot has been synced"):
        _step(rank0, cfg, opts)
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
    with pytest.raises(snapshots.SnapshotNotAcked):
        _step(rank0, cfg, opts)
    sp.prepare(base)
    assert _rel(_step(rank0, cfg, opts), _step(rank0, cfg)) <= TOL
