"""The stream path of comfy.parallel: the device path's verdict from a handshake (CPU), and on a CUDA
machine N ranks sharing cuda:0 (same-device IPC for the device path): exact bytes through either mode,
the fallback on a failed write-and-verify test, a rank killed mid-copy, a cancel, and no device memory
left after close()."""

import os
import threading

import pytest
import torch
from parallel_helpers import IMPORTS, wait_until

from comfy.parallel import ParallelCancelled, ParallelGroup, ParallelGroupError, ParallelOpError, ops, stream_path
from comfy.parallel.group import OWN_MODULES

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CAP = stream_path.HANDLE


def record(major, minor):
    rec = bytearray(stream_path.RECORD)
    rec[CAP:CAP + 2] = bytes((major, minor))
    return bytes(rec)


def test_the_verdict_needs_every_pair_intact_and_one_architecture():
    same = [record(9, 0)] * 3
    assert stream_path.verdict(same, [[True] * 3] * 3) == (True, "")
    ok, reason = stream_path.verdict(same, [[True, True, True], [True, True, True], [True, False, True]])
    assert not ok and reason.endswith("from rank -> to rank 1->2")
    ok, reason = stream_path.verdict(same[:2], [[True, False], [False, True]])  # named by source, then destination
    assert not ok and reason.endswith("0->1, 1->0")
    ok, reason = stream_path.verdict([record(9, 0), record(8, 9)], [[True] * 2] * 2)
    assert not ok and "compute capability" in reason and "(8, 9)" in reason


def test_a_cpu_group_uses_the_host_path():
    with ParallelGroup("cpu-path") as g:
        g.start(["cpu"] * 2, IMPORTS)
        assert g.data_path == "host, on the calling thread"
        assert g.run("test.exchange", {"sizes": [[8, 4000], [12, 4]], "broadcast": 10}).values == [True, True]


@cuda
@pytest.mark.parametrize("ranks,path", [(2, "device"), (3, "device"), (3, "host")])
def test_ranks_sharing_a_gpu_move_exact_bytes_on_the_streams(ranks, path):
    free = []
    for _ in range(2):  # the first group also loads the kernels rank 0 runs (lazily, once per process)
        with ParallelGroup("stream-path", slot_bytes=4 << 20, device_path=path == "device") as g:
            g.start(["cuda:0"] * ranks, IMPORTS)
            assert g.data_path == path
            # lanes of 2 MiB: several rounds, both parities, zero-size and odd pieces
            sizes = [[(4 << 20) + 4 * (i + 3 * j) if (i + j) % 3 else 0 for j in range(ranks)] for i in range(ranks)]
            assert g.run("test.exchange", {"sizes": sizes, "broadcast": 1000}).values == [True] * ranks
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free.append(torch.cuda.mem_get_info()[0])
    # cudaFree and every IPC mapping closed: the second group gives back what it took (its buffers alone are
    # 8 MiB per rank; the driver frees an exited worker's context soon after its exit, hence the wait)
    assert wait_until(lambda: torch.cuda.mem_get_info()[0] >= free[0] - (4 << 20), 20) is not None, \
        f"{(free[0] - torch.cuda.mem_get_info()[0]) >> 20} MiB of GPU memory not given back"


@cuda
def test_a_failed_write_and_verify_test_falls_back_to_the_host_path(monkeypatch, caplog):
    # each of the two ranks gets bytes other than it expects, as from a driver that claims P2P and lies
    real, fingerprints = stream_path._pattern, ops.code_fingerprints([*OWN_MODULES, *IMPORTS])
    monkeypatch.setattr(stream_path, "_pattern", lambda *a: real(*a) + 1)  # rank 0 only: its bytes are not what rank 1 expects
    # the workers run the module as it is on disk: rank 0 vouches for the code it had before the patch
    monkeypatch.setattr(ops, "code_fingerprints", lambda names: {m: fingerprints[m] for m in names})
    with caplog.at_level("INFO", logger="comfy.parallel.stream_path"), ParallelGroup("fallback") as g:
        g.start(["cuda:0"] * 2, IMPORTS)
        assert g.data_path == "host"
        assert g.run("test.exchange", {"sizes": [[8, 4000], [12, 4]], "broadcast": 10}).values == [True, True]
    lines = [r.message for r in caplog.records if "device-to-device copies are off" in r.message]
    assert len(lines) == 1 and "0->1, 1->0" in lines[0]


@cuda
def test_without_stream_memory_operations_cuda_tensors_are_staged_in_cpu_memory(monkeypatch, caplog):
    fingerprints = ops.code_fingerprints([*OWN_MODULES, *IMPORTS])
    monkeypatch.setattr(ops, "code_fingerprints", lambda names: {m: fingerprints[m] for m in names})

    def unavailable(host, mode):  # rank 0 only, as a GPU whose driver refuses cuStreamWaitValue32
        raise stream_path.CudaError("cuStreamWaitValue32 failed (CUDA error 801: operation not supported)")
    monkeypatch.setattr(stream_path, "StreamPath", unavailable)
    with caplog.at_level("WARNING", logger="comfy.parallel.stream_path"), ParallelGroup("staged", device_path=False) as g:
        g.start(["cuda:0"] * 2, IMPORTS)
        assert g.data_path == "host, on the calling thread"
        assert g.run("test.exchange", {"sizes": [[8, 6 << 20], [12 << 20, 4]], "broadcast": 10}).values == [True, True]
    # one line per rank: rank 0's own, and rank 1's forwarded to rank 0's log
    assert sorted(r.name for r in caplog.records if "staged in CPU memory" in r.getMessage()) == ["comfy.parallel.group", "comfy.parallel.stream_path"]


@cuda
def test_the_host_path_pins_its_slots_within_comfyui_s_pinned_budget(monkeypatch):
    import comfy.model_management as mm
    before = mm.TOTAL_PINNED_MEMORY
    with ParallelGroup("pinned", device_path=False) as g:
        g.start(["cuda:0"] * 2, IMPORTS)
        assert g.data_path == "host"
        assert mm.TOTAL_PINNED_MEMORY - before == g._transport._data.nbytes  # the slots of every rank, once
        assert g.run("test.exchange", {"sizes": [[8, 6 << 20], [12 << 20, 4]], "broadcast": 10}).values == [True, True]
    assert mm.TOTAL_PINNED_MEMORY == before
    monkeypatch.setattr(mm, "MAX_PINNED_MEMORY", 0)  # as --disable-pinned-memory: ComfyUI pins nothing
    with ParallelGroup("refused", device_path=False) as g:
        g.start(["cuda:0"] * 2, IMPORTS)
        assert g.data_path == "host, on the calling thread"
        assert g.run("test.exchange", {"sizes": [[8, 6 << 20], [12 << 20, 4]], "broadcast": 10}).values == [True, True]


@cuda
@pytest.mark.parametrize("path", ["device", "host"])
def test_a_rank_killed_mid_copy_is_named_and_rank0_s_gpu_stays_usable(path):
    with ParallelGroup("killed", device_path=path == "device") as g:
        g.start(["cuda:0"] * 2, IMPORTS)
        assert g.data_path == path
        pid = g.worker_pids()[1]
        threading.Timer(2.0, os.kill, (pid, 9)).start()
        with pytest.raises(ParallelGroupError, match="worker rank 1 .* was killed by SIGKILL during op 'test.stream'"):
            g.run("test.stream", {"mb": 64, "seconds": 30})
    done = threading.Event()
    threading.Thread(target=lambda: (torch.cuda.synchronize(), done.set()), daemon=True).start()
    assert wait_until(done.is_set, 20) is not None, "rank 0's GPU work did not finish after its peer died"
    x = torch.arange(10, device="cuda")
    assert int(x.sum()) == 45


@cuda
def test_a_cancelled_op_leaves_the_streams_drained_and_the_next_op_exact():
    with ParallelGroup("cancel") as g:
        g.start(["cuda:0"] * 2, IMPORTS)
        threading.Timer(1.0, g.cancel).start()
        with pytest.raises(ParallelCancelled):
            g.run("test.stream", {"mb": 64, "seconds": 30})
        assert g.run("test.exchange", {"sizes": [[8, 6 << 20], [12 << 20, 4]], "broadcast": 10}).values == [True, True]


@cuda
@pytest.mark.parametrize("path", ["device", "host"])
def test_a_group_started_in_inference_mode_survives_a_worker_s_error_and_a_cancel(path):
    # ComfyUI runs nodes in inference mode, so the node starts its group there; the monitor thread, which aborts
    # the op when a worker raises, and a cancel from another thread run outside it
    with torch.inference_mode(), ParallelGroup("inference", device_path=path == "device") as g:
        g.start(["cuda:0"] * 2, IMPORTS)
        assert g.data_path == path
        with pytest.raises(ParallelOpError, match="raised ValueError on worker rank 1"):
            g.run("test.fail", {"rank": 1})
        threading.Timer(1.0, g.cancel).start()
        with pytest.raises(ParallelCancelled):
            g.run("test.stream", {"mb": 64, "seconds": 30})
        assert g.state == "ready"
        assert g.run("test.exchange", {"sizes": [[8, 6 << 20], [12 << 20, 4]], "broadcast": 10}).values == [True, True]
