"""All-to-alls ordered on the GPUs' streams: the data path of a ParallelGroup on CUDA, with no host wait.

Every rank enqueues a round as: on its send stream, wait until each peer it writes to has consumed
the round that last used this parity, copy its pieces, write its POSTED flag; on its receive stream,
wait until every peer's POSTED flag reaches this round, copy what it receives, write its CONSUMED flag
(so round k + 1 goes out while round k comes in, on two copy engines). The flags are 32-bit
words in a page of the group's private segment, mapped into every GPU (cuStreamWriteValue32 /
cuStreamWaitValue32, whose write fences like __threadfence_system, so a flag is seen after the copies
before it on x86 and ARM hosts alike). The host never blocks on a peer or a GPU, and there is no
Python thread per round: a collective is a few dozen enqueued calls. Two modes:

* ``device``: each rank's receive buffer is raw ``cudaMalloc`` memory (legacy CUDA IPC handles cannot
  be taken from ``cudaMallocAsync`` memory, ComfyUI's default allocator backend), opened by its peers
  with handles passed as bytes through the segment (no socket, no environment, nothing
  process-wide); a sender's copy engine writes into it (NVLink, PCIe P2P, or the same GPU). Used only
  when every pair passed a write-and-verify test at start (drivers can claim P2P and deliver wrong
  data) and the GPUs share one compute capability.
* ``host``: a sender copies into its own pinned slots of the segment and each receiver copies out.

An abort (a fault, a cancel, a missed deadline) moves every flag far ahead, so that no GPU waits for a
rank that is gone; the next op resets them on every rank.
"""

import ctypes
import logging
import sys
import time

import torch

logger = logging.getLogger(__name__)

ALIGN = 2 << 20  # the CUDA guide asks for 2 MiB-aligned allocations to share
HANDLE = 64
RECORD = HANDLE + 2 + 8  # memory handle, compute capability, nonce
POSTED, CONSUMED = 0, 1
FLAG_STRIDE = 16  # 32-bit flags per rank: a 64-byte line each
RELEASE = 1 << 30
COPY_DEFAULT, LAZY_PEER_ACCESS, HOST_REGISTER = 4, 1, 3  # cudaMemcpyDefault, cudaIpcMemLazyEnablePeerAccess, Portable|Mapped
VP, SZ, U32 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint32


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_byte * HANDLE)]


class CudaError(RuntimeError):
    pass


_LIBS = {}


def _libs():
    """(the CUDA runtime torch loaded, found in /proc/self/maps as vLLM finds it; the driver) -> ctypes."""
    if not _LIBS:
        torch.cuda.init()
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if "libcudart.so" in line})
        rt, drv = ctypes.CDLL(paths[0] if paths else "libcudart.so"), ctypes.CDLL("libcuda.so.1")
        rt.cudaGetErrorString.restype = ctypes.c_char_p
        for lib, name, args in ((rt, "cudaMalloc", [ctypes.POINTER(VP), SZ]), (rt, "cudaFree", [VP]),
                                (rt, "cudaIpcGetMemHandle", [ctypes.POINTER(_Handle), VP]),
                                (rt, "cudaIpcOpenMemHandle", [ctypes.POINTER(VP), _Handle, ctypes.c_uint]),
                                (rt, "cudaIpcCloseMemHandle", [VP]), (rt, "cudaMemcpyAsync", [VP, VP, SZ, ctypes.c_int, VP]),
                                (rt, "cudaHostRegister", [VP, SZ, ctypes.c_uint]), (rt, "cudaHostUnregister", [VP]),
                                (rt, "cudaHostGetDevicePointer", [ctypes.POINTER(VP), VP, ctypes.c_uint]),
                                # the _v2 entry points, as cuda.h (12+) names them: the plain symbols are the v1
                                # API, "operation not supported" unless a driver option enables it
                                (drv, "cuStreamWaitValue32_v2", [VP, ctypes.c_uint64, U32, ctypes.c_uint]),
                                (drv, "cuStreamWriteValue32_v2", [VP, ctypes.c_uint64, U32, ctypes.c_uint])):
            getattr(lib, name).argtypes = args
        _LIBS.update(rt=rt, drv=drv)
    return _LIBS["rt"], _LIBS["drv"]


def _check(code, what):
    if code != 0:
        rt, _ = _libs()
        rt.cudaGetLastError()  # not a sticky error: clear it so that torch does not raise it later
        raise CudaError(f"{what} failed (CUDA error {code}: {rt.cudaGetErrorString(code).decode()})")


def verdict(records, passed):
    """Whether the group may copy device to device -> (bool, reason). ``records``: every rank's handshake
    record; ``passed[r][i]``: rank r received rank i's test pattern intact (r == i: True)."""
    capabilities = {bytes(r[HANDLE:HANDLE + 2]) for r in records}
    if len(capabilities) > 1:
        return False, f"the GPUs differ in compute capability ({sorted(tuple(c) for c in capabilities)})"
    bad = sorted((i, r) for r, row in enumerate(passed) for i, ok in enumerate(row) if not ok)
    if bad:
        return False, "the write-and-verify test failed from rank -> to rank " + ", ".join(f"{i}->{r}" for i, r in bad)
    return True, ""


class StreamWork:
    def __init__(self, done, device):
        self.done, self.device = done, device

    def wait(self):
        """The caller's stream waits (on the GPU) until this rank's receive tensors hold the data."""
        torch.cuda.current_stream(self.device).wait_event(self.done)


class StreamPath:
    """One rank's end in ``mode`` "host" or "device", on ``host`` (its HostTransport: the segment, aborts)."""

    def __init__(self, host, mode):
        self.host, self.mode, self.device = host, mode, host.device
        self.rt, self.drv = _libs()
        n, self.round, self.peers, self.failed, self.buffer = host.world_size, 0, {}, None, VP()
        self.flags = host.flags  # int32 view of the flag page
        self._flags_registered, self._unpin = False, None
        with torch.cuda.device(self.device):
            # sends on one stream and receives on another: a round's copies in overlap the next round's copies out
            self.streams = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device))
            _check(self.rt.cudaHostRegister(self.flags.data_ptr(), self.flags.numel() * 4, HOST_REGISTER), "cudaHostRegister of the flag page")
            self._flags_registered = True
            try:
                self._start(n, mode)
            except CudaError:
                self.close()  # nothing stays registered or allocated for the next attempt
                raise

    def _start(self, n, mode):
        flags_dev = VP()
        _check(self.rt.cudaHostGetDevicePointer(ctypes.byref(flags_dev), self.flags.data_ptr(), 0), "cudaHostGetDevicePointer")
        self.flags_dev = flags_dev.value
        # a wait on a flag that is already there: the stream memory operations work on this device
        for s in self.streams:
            self._wait_flag(s, self.host.rank, POSTED, 0)
            s.synchronize()
        if mode == "device":
            self.lane = max(ALIGN, self.host.slot_bytes // n // ALIGN * ALIGN)
            _check(self.rt.cudaMalloc(ctypes.byref(self.buffer), 2 * n * self.lane), f"cudaMalloc of {2 * n * self.lane >> 20} MiB")
        else:
            self.lane = self.host.lane
            self._pin(self.host._data)

    def _pin(self, data):
        """The slots pinned, so that copies to and from them run at the link's speed: within ComfyUI's pinned memory
        budget where ComfyUI runs in this process (it may evict its own pins to make room, or refuse), else here."""
        mm = sys.modules.get("comfy.model_management")
        if mm is not None:
            if not mm.pin_memory(data):
                raise CudaError(f"ComfyUI's pinned memory budget refused the {data.nbytes >> 20} MiB of the slots "
                                "(--disable-pinned-memory, or the budget is full)")
            self._unpin = lambda: mm.unpin_memory(data)
        else:
            _check(self.rt.cudaHostRegister(data.data_ptr(), data.nbytes, 0), f"cudaHostRegister of {data.nbytes >> 20} MiB")
            self._unpin = lambda: self.rt.cudaHostUnregister(data.data_ptr())

    def _flag(self, rank, which):
        return self.flags_dev + (rank * FLAG_STRIDE + which) * 4

    def _wait_flag(self, stream, rank, which, value):
        _check(self.drv.cuStreamWaitValue32_v2(stream.cuda_stream, self._flag(rank, which), value & 0xFFFFFFFF, 0), "cuStreamWaitValue32")

    def _write_flag(self, stream, which, value):
        _check(self.drv.cuStreamWriteValue32_v2(stream.cuda_stream, self._flag(self.host.rank, which), value & 0xFFFFFFFF, 0),
               "cuStreamWriteValue32")

    def _copy(self, stream, dst, src, size):
        code = self.rt.cudaMemcpyAsync(dst, src, size, COPY_DEFAULT, stream.cuda_stream)
        if code != 0 and self.failed is None:  # raised after the round's flags are enqueued: no peer waits for it
            self.failed = CudaError(f"cudaMemcpyAsync failed (CUDA error {code})")
            self.rt.cudaGetLastError()

    def record(self, nonce):
        handle = _Handle()
        _check(self.rt.cudaIpcGetMemHandle(ctypes.byref(handle), self.buffer), "cudaIpcGetMemHandle")
        props = torch.cuda.get_device_properties(self.device)
        return bytes(handle.reserved) + bytes((props.major, props.minor)) + nonce

    def open(self, records):
        """Open every peer's receive buffer; CudaError where one cannot be opened."""
        with torch.cuda.device(self.device):
            for j, rec in enumerate(records):
                if j != self.host.rank:
                    ptr = VP()
                    _check(self.rt.cudaIpcOpenMemHandle(ctypes.byref(ptr), _Handle.from_buffer_copy(rec[:HANDLE]), LAZY_PEER_ACCESS),
                           f"cudaIpcOpenMemHandle of rank {j}'s buffer")
                    self.peers[j] = ptr.value

    def _targets(self, p):
        """-> ({peer j: where this rank's piece for j goes}, {peer i: where i's piece for this rank is}) in parity p."""
        h, r, n = self.host, self.host.rank, self.host.world_size
        if self.mode == "device":
            return ({j: ptr + (p * n + r) * self.lane for j, ptr in self.peers.items()},
                    {i: self.buffer.value + (p * n + i) * self.lane for i in range(n) if i != r})
        slot = h.slot_address
        return ({j: slot(r, p) + j * self.lane for j in range(n) if j != r}, {i: slot(i, p) + r * self.lane for i in range(n) if i != r})

    def all_to_all(self, sends, recvs, sizes):
        """As HostTransport.all_to_all (byte views of CUDA tensors on this rank's device) -> StreamWork."""
        from .transport import OpAborted
        h, n, r = self.host, self.host.world_size, self.host.rank
        if h.aborted():
            raise OpAborted(f"op {h.op_id} was aborted")
        rounds = max(-(-sizes[i][j] // self.lane) for i in range(n) for j in range(n) if i != j)
        (out, into), start = self.streams, torch.cuda.Event()
        start.record(torch.cuda.current_stream(self.device))
        for s in self.streams:
            s.wait_event(start)
            for t in (*sends, *recvs):
                if t is not None:
                    t.record_stream(s)  # the caller may drop them before the copies ran
        if sizes[r][r]:
            self._copy(into, recvs[r].data_ptr(), sends[r].data_ptr(), sizes[r][r])
        for k in range(rounds):
            g = self.round + k
            outgoing, incoming = self._targets(g % 2)
            for j, dst in outgoing.items():
                a, b = k * self.lane, min(sizes[r][j], (k + 1) * self.lane)
                if a < b:
                    if g >= 2:
                        self._wait_flag(out, j, CONSUMED, g - 1)  # j copied out round g - 2, which used this parity
                    self._copy(out, dst, sends[j].data_ptr() + a, b - a)
            self._write_flag(out, POSTED, g + 1)
            for i, src in incoming.items():
                a, b = k * self.lane, min(sizes[i][r], (k + 1) * self.lane)
                if a < b:
                    self._wait_flag(into, i, POSTED, g + 1)
                    self._copy(into, recvs[i].data_ptr() + a, src, b - a)
            self._write_flag(into, CONSUMED, g + 1)
        self.round += rounds
        if self.failed is not None:
            err, self.failed = self.failed, None
            raise err
        sent, done = torch.cuda.Event(), torch.cuda.Event()
        sent.record(out)
        into.wait_event(sent)
        done.record(into)
        return StreamWork(done, self.device)

    def release(self):
        """Let every GPU wait on the flags pass (after an abort: a rank may never write its flags again). Idempotent;
        every rank's round is within 2**30 of this one's, and a flag that reads (round + 2**30) passes any wait."""
        self.flags.view(-1, FLAG_STRIDE)[:, :2] = (self.round + RELEASE) & 0x7FFFFFFF

    def drain(self, timeout=10.0):
        """Release the flags until this rank's stream is idle (a peer's late flag write may hold it again)."""
        end = time.monotonic() + timeout
        while not all(s.query() for s in self.streams):
            self.release()
            if time.monotonic() > end:
                logger.error("parallel group rank %d: the GPU stream of its collectives did not drain in %gs", self.host.rank, timeout)
                return
            time.sleep(0.001)

    def reset(self):
        """After an aborted op (every rank, between two barriers of the host path): this rank's flags zero."""
        self.flags.view(-1, FLAG_STRIDE)[self.host.rank, :2] = 0
        self.round = 0

    def close(self):
        with torch.cuda.device(self.device):
            self.drain()
            self.reset()  # a path attached next (the host path after a failed test) starts from round 0 too
            for ptr in self.peers.values():
                self.rt.cudaIpcCloseMemHandle(ptr)
            self.peers = {}
            if self.buffer.value:
                self.rt.cudaFree(self.buffer)
                self.buffer = VP()
            if self._unpin is not None:
                self._unpin()
                self._unpin = None
            if self._flags_registered:
                self.rt.cudaHostUnregister(self.flags.data_ptr())
                self._flags_registered, self._unpin = False, None


def attach(host, device_path=True):
    """On every rank of ``host``'s group (inside an op): the stream path, device to device where every pair
    passes the test (and ``device_path``), else through host memory -> StreamPath, or None after one log
    line (the host path then stages CUDA tensors in CPU memory, blocking)."""
    path, error, ok, reason = None, None, False, "not asked for"
    if device_path:
        try:
            path = StreamPath(host, "device")
            records = host.all_gather_bytes(path.record(host.nonce()), RECORD)
            if all(any(rec) for rec in records):
                path.open(records)
        except (CudaError, OSError) as e:
            error = e
            if path is None:
                records = host.all_gather_bytes(b"", RECORD)  # the gather the other ranks are in
        opened = host.all_gather_bytes(bytes((error is None and all(any(rec) for rec in records),)), 1)
        reason = f"rank {host.rank}: {error}" if error is not None else "a rank could not open its peers' memory"
        if all(f[0] for f in opened):
            # every rank opened every peer: the copies cannot hang; the test says whether they arrive intact
            passed = _write_and_verify(path, int.from_bytes(records[0][-8:], "little"))
            rows = host.all_gather_bytes(bytes(passed), host.world_size)
            ok, reason = verdict(records, [list(row[:host.world_size]) for row in rows])
        if ok:
            return path
        if path is not None:
            path.close()
        if host.rank == 0 or error is not None:
            logger.info("parallel group: device-to-device copies are off, data goes through host memory (%s)", reason)
    try:
        path, error = StreamPath(host, "host"), None
    except (CudaError, OSError) as e:
        path, error = None, e
    able = host.all_gather_bytes(bytes((error is None,)), 1)
    if all(a[0] for a in able):
        return path
    if path is not None:
        path.close()
    logger.warning("parallel group: the GPUs' stream path is unavailable (%s); data is staged in CPU memory",
                   error or "on another rank")
    return None


def _pattern(src, dst, nonce, size, device):
    x = torch.arange(size, dtype=torch.int32, device=device)
    return ((x * (2 * src + 3) + 31 * dst + nonce) % 251).to(torch.uint8)


def _write_and_verify(path, nonce):
    """Rank i sends rank j a pattern of (i, j, the group's nonce) device to device -> per source: intact."""
    n, r, device = path.host.world_size, path.host.rank, path.device
    size = path.lane + 4093  # two rounds (both parities), an odd tail
    nonce %= 997
    recvs = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(n)]
    try:
        path.all_to_all([_pattern(r, j, nonce, size, device) for j in range(n)], recvs, [[size] * n for _ in range(n)]).wait()
        torch.cuda.synchronize(device)
        return [i == r or torch.equal(recvs[i], _pattern(i, r, nonce, size, device)) for i in range(n)]
    except (CudaError, RuntimeError) as e:
        logger.info("parallel group rank %d: a test copy device to device failed: %s", r, e)
        return [i == r for i in range(n)]
