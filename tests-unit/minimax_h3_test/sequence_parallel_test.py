"""Sequence-parallel H3 through comfy.parallel on CPU (gloo, real worker processes).

Workers build the model from a LoaderSpec (safetensors + sha256), patch snapshots are synced and
acked before any step, outputs match the single-process model (fp32, max |diff| <= 1e-5 relative
to max |native|), and the group survives cancellation and a killed worker.
"""

import os
import signal
import threading
import time

import pytest
from safetensors.torch import save_file

from comfy import model_patcher_snapshot as snapshots
from comfy.ldm.minimax_h3.checkpoint import LoaderSpec
from comfy.ldm.minimax_h3.model import SEQUENCE_PARALLEL_OPTION
from comfy.ldm.minimax_h3.sequence_parallel import SequenceParallel
from comfy.ldm.minimax_h3.synthetic import SyntheticPatcher, step_inputs
from comfy.parallel import ParallelCancelled, ParallelGroupError, Timeouts
from h3_cases import tiny_model

TOL = 1e-5


@pytest.fixture
def checkpoint(tmp_path):
    model, cfg = tiny_model(num_layers=3)
    path = str(tmp_path / "h3_tiny.safetensors")
    save_file({"model.diffusion_model." + k: v.contiguous() for k, v in model.state_dict().items()}, path)
    return LoaderSpec.for_file(path, dtype="float32"), cfg


def _rel(a, b):
    return max(float((u - v).abs().max() / v.abs().max()) for u, v in zip(a, b))


def _step(model, cfg, opts=None, kind="refs_all", **kw):
    x, t, c, p = step_inputs(cfg, kind, height=5, **kw)
    return model(x, t, c, dict(opts or {}), minimax_payload=p)


@pytest.fixture
def sp_group(checkpoint):
    spec, cfg = checkpoint
    rank0 = spec.load()
    sp = SequenceParallel(["cpu"] * 3, spec, apply_on_rank0=True,
                          timeouts=Timeouts(startup=120, op=60, cancel=10))
    try:
        sp.ensure_started(rank0)
        yield sp, rank0, spec, cfg
    finally:
        sp.close()


def test_parity_snapshot_sync_and_changes(sp_group):
    sp, rank0, spec, cfg = sp_group
    opts = {SEQUENCE_PARALLEL_OPTION: sp}
    reference = spec.load()
    with pytest.raises(snapshots.SnapshotNotAcked, match="no patch snapshot has been synced"):
        _step(rank0, cfg, opts)
    sp.sync(snapshots.PatchSnapshot.empty())
    for kind in ("t2va", "tags", "keyframes", "refs_all"):
        assert _rel(_step(rank0, cfg, opts, kind), _step(reference, cfg, kind=kind)) <= TOL

    # a LoRA on every block linear, applied on every rank (rank 0 included: apply_on_rank0)
    patcher = SyntheticPatcher(reference).add_lora(reference, rank=4, seed=1)
    lora = snapshots.PatchSnapshot.capture(patcher)
    sp.sync(lora)
    snapshots.apply(lora, reference, key_prefix="diffusion_model.", arithmetic="builtin")
    with_lora = _step(reference, cfg)
    assert _rel(_step(rank0, cfg, opts), with_lora) <= TOL
    assert _rel(with_lora, _step(spec.load(), cfg)) > 1e-3  # the LoRA really changes the output

    # a strength change travels as a delta; every rank acks the new version
    stronger = snapshots.PatchSnapshot.capture(patcher.set_strength(0.5), previous=lora)
    assert stronger.version != lora.version
    sp.sync(stronger)
    assert sp.synced.version == stronger.version
    snapshots.apply(stronger, reference, key_prefix="diffusion_model.", arithmetic="builtin")
    assert _rel(_step(rank0, cfg, opts), _step(reference, cfg)) <= TOL

    # clearing to the base model is a valid snapshot too
    sp.sync(snapshots.PatchSnapshot.empty(lineage=stronger.lineage + 1))
    assert _rel(_step(rank0, cfg, opts), _step(spec.load(), cfg)) <= TOL


def test_cancel_mid_sampling_leaves_the_group_reusable(sp_group):
    sp, rank0, spec, cfg = sp_group
    sp.sync(snapshots.PatchSnapshot.empty())
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
    assert _rel(_step(rank0, cfg, opts), _step(spec.load(), cfg)) <= TOL


def test_killed_worker_gives_a_clear_error_and_recovers(sp_group):
    sp, rank0, spec, cfg = sp_group
    sp.sync(snapshots.PatchSnapshot.empty())
    opts = {SEQUENCE_PARALLEL_OPTION: sp}
    victim = sp.group.worker_pids()[2]
    killer = threading.Timer(0.3, os.kill, (victim, signal.SIGKILL))
    killer.start()
    with pytest.raises(ParallelGroupError) as ei:
        for _ in range(500):
            _step(rank0, cfg, opts, text_len=64)
    killer.join()
    assert ei.value.rank == 2 and "rank 2" in str(ei.value)
    sp.ensure_started(rank0)  # rebuilds the broken group; patches must be re-synced first
    with pytest.raises(snapshots.SnapshotNotAcked):
        _step(rank0, cfg, opts)
    sp.sync(snapshots.PatchSnapshot.empty())
    assert _rel(_step(rank0, cfg, opts), _step(spec.load(), cfg)) <= TOL
