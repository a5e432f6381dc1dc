"""The data path of a ParallelGroup: host memory shared by the group's processes and nobody else.

Rank 0 creates one anonymous shared memory file (memfd) and one eventfd "bell" per rank; the
workers inherit them. Nothing listens on a socket, so no other process can reach the data or end a
rank. Each rank owns two slots of the segment. A collective is cut into rounds: in round k every
rank copies what it sends into its slot k % 2 (device -> pinned host), publishes the round, copies
what it receives out of its peers' slots (host -> device) and publishes that it has read them. A
slot is written again only once every rank has read it. The next round's sends are copied while
this round's receives are (the two directions of the link run together).

Collectives run in order on one thread per rank, so a caller can keep computing while they move
(``Work.wait()`` when it needs the data). Every wait blocks on the rank's bell and ends when the
op is aborted (any rank failed, or rank 0 cancelled or found a dead or hung rank) or its deadline
passes: a slow peer is waited for as long as it is alive.
"""

import mmap
import os
import queue
import select
import threading
import time

import torch

HEADER = 4096
ABORT = 0  # the highest aborted op id; any rank may write it
RANK_WORDS = 8  # a cache line per rank: heartbeat, posted, consumed
HEARTBEAT, POSTED, CONSUMED = 0, 1, 2
MAX_RANKS = HEADER // (8 * RANK_WORDS) - 1
ALIGN = 64


class OpAborted(Exception):
    """The op was aborted by another rank's failure, a cancel or a fault; leave it."""


def _align(n):
    return -(-n // ALIGN) * ALIGN


def as_bytes(t):
    """A contiguous tensor's bytes as a flat uint8 view (no copy)."""
    return t.reshape(-1).view(torch.uint8)


class Work:
    """One collective, queued on the transport's thread."""

    def __init__(self, kind, sends, recvs, sizes, event):
        self.kind, self.sends, self.recvs, self.sizes, self.event = kind, sends, recvs, sizes, event
        self.done = threading.Event()
        self.error = None

    def wait(self):
        self.done.wait()
        if self.error is not None:
            raise self.error


class HostTransport:
    """One rank's end. ``create`` (rank 0) makes the segment and bells; ``fds()`` lists what workers inherit."""

    def __init__(self, rank, world_size, device, slot_bytes, fd=None, bells=None):
        if not 1 <= world_size <= MAX_RANKS:
            raise ValueError(f"a parallel group has at most {MAX_RANKS} ranks, got {world_size}")
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        self.slot_bytes = _align(slot_bytes)
        self.lane = self.slot_bytes // world_size // ALIGN * ALIGN
        size = HEADER + 2 * world_size * self.slot_bytes
        if fd is None:
            fd = os.memfd_create("comfy-parallel", os.MFD_CLOEXEC)
            os.ftruncate(fd, size)
            bells = [os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC) for _ in range(world_size)]
        self.fd, self.bells = fd, bells
        self._map = mmap.mmap(fd, size)
        self._words = memoryview(self._map)[:HEADER].cast("q")
        self._data = torch.frombuffer(self._map, dtype=torch.uint8, offset=HEADER)
        self._pinned = False
        if self.device.type == "cuda":
            # copies from and to this memory run asynchronously at the link's full speed
            if torch.cuda.cudart().cudaHostRegister(self._data.data_ptr(), self._data.numel(), 0) != 0:
                raise RuntimeError(f"cannot pin {self._data.numel() >> 20} MiB of shared host memory for the parallel group")
            self._pinned = True
            self._streams = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device))
        self.op_id, self.deadline, self.seq = 0, float("inf"), 0
        self._queue, self._thread, self._poll = queue.SimpleQueue(), None, None
        self._idle = threading.Event()
        self._idle.set()

    def fds(self):
        return [self.fd, *self.bells]

    # -- the header, read and written by every rank ------------------------------------------------

    def _word(self, rank, which):
        return 8 + rank * RANK_WORDS + which

    def heartbeat(self):
        i = self._word(self.rank, HEARTBEAT)
        self._words[i] = self._words[i] + 1

    def heartbeats(self):
        return [self._words[self._word(r, HEARTBEAT)] for r in range(self.world_size)]

    def abort(self, op_id):
        """Make every rank leave op ``op_id`` (a no-op for an op already left)."""
        if self._words[ABORT] < op_id:
            self._words[ABORT] = op_id
        self._ring(range(self.world_size))

    def aborted(self):
        return self._words[ABORT] >= self.op_id

    def _ring(self, ranks):
        for r in ranks:
            try:
                os.eventfd_write(self.bells[r], 1)
            except BlockingIOError:
                pass  # the counter is full: the bell already rings

    def _publish(self, which, value):
        self._words[self._word(self.rank, which)] = value
        self._ring(r for r in range(self.world_size) if r != self.rank)

    def _wait(self, ready):
        bell = self.bells[self.rank]
        if self._poll is None:
            self._poll = select.poll()
            self._poll.register(bell, select.POLLIN)
        while not ready():
            if self.aborted():
                raise OpAborted(f"op {self.op_id} was aborted")
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"rank {self.rank}: a collective of op {self.op_id} passed the op's deadline")
            self._poll.poll(min(left, 0.5) * 1000)
            try:
                os.eventfd_read(bell)
            except BlockingIOError:
                pass

    # -- ops ---------------------------------------------------------------------------------------

    def begin_op(self, op_id, deadline):
        self.op_id, self.deadline, self.seq = op_id, deadline, 0

    def end_op(self):
        """Once the op's collectives are done or failed (call on the op's thread when it leaves the op)."""
        self._idle.wait()

    # -- collectives (the op's thread) -------------------------------------------------------------

    def all_to_all(self, sends, recvs, sizes):
        """``sends[j]`` -> rank j's ``recvs[rank]``. ``sizes[i][j]``: bytes from rank i to rank j, the same
        matrix on every rank; tensors contiguous (None where the size is 0). -> Work."""
        return self._submit("all_to_all", sends, recvs, sizes)

    def broadcast(self, tensors):
        """Rank 0's ``tensors`` into every other rank's (same shapes and dtypes, contiguous); blocks."""
        sizes = [t.numel() * t.element_size() for t in tensors]
        self._submit("broadcast", tensors, tensors, sizes).wait()

    def gather(self, send, recvs, sizes):
        """Every rank's ``send`` into rank 0's ``recvs[i]``; ``sizes[i]``: rank i's bytes. -> Work."""
        matrix = [[sizes[i] if j == 0 else 0 for j in range(self.world_size)] for i in range(self.world_size)]
        return self._submit("all_to_all", [send if j == 0 else None for j in range(self.world_size)],
                            recvs if self.rank == 0 else [None] * self.world_size, matrix)

    def all_gather_bytes(self, data, size=64):
        """Every rank's ``data`` (at most ``size`` bytes) -> the list of all ranks' (zero-padded); blocks."""
        if len(data) > size:
            raise ValueError(f"all_gather_bytes takes at most {size} bytes, got {len(data)}")
        mine = torch.frombuffer(bytearray(data.ljust(size, b"\0")), dtype=torch.uint8)
        out = [torch.empty(size, dtype=torch.uint8) for _ in range(self.world_size)]
        sends = [mine.to(self.device)] * self.world_size
        recvs = [t.to(self.device) for t in out]
        self._submit("all_to_all", sends, recvs, [[size] * self.world_size] * self.world_size).wait()
        return [bytes(t.cpu().tolist()) for t in recvs]

    def _submit(self, kind, sends, recvs, sizes):
        event = None
        if self.device.type == "cuda":
            # the copy streams start once what the op's stream queued so far (the sends, the allocations) is done
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        work = Work(kind, [None if t is None else as_bytes(t) for t in sends],
                    [None if t is None else as_bytes(t) for t in recvs], sizes, event)
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=f"parallel-transport-rank{self.rank}", daemon=True)
            self._thread.start()
        self._idle.clear()
        self._queue.put(work)
        return work

    # -- the transport's thread --------------------------------------------------------------------

    def _serve(self):
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while True:
            work = self._queue.get()
            if work is None:
                return
            try:
                if self.aborted():
                    raise OpAborted(f"op {self.op_id} was aborted")
                self._run(work)
            except BaseException as e:
                work.error = e
                self._sync()  # no copy of a failed collective is left in flight
            finally:
                work.sends = work.recvs = None
                work.done.set()
                if self._queue.empty():
                    self._idle.set()

    def _sync(self):
        if self.device.type == "cuda":
            for s in self._streams:
                s.synchronize()

    def _slot(self, rank, seq):
        start = (rank * 2 + seq % 2) * self.slot_bytes
        return self._data[start:start + self.slot_bytes]

    def _pieces(self, work, k):
        """Round k of an all-to-all: [(src, dst, lane offset, start, stop)] of the bytes that cross ranks."""
        n, cap, out = self.world_size, self.lane, []
        for i in range(n):
            for j in range(n):
                a, b = k * cap, min((k + 1) * cap, work.sizes[i][j])
                if i != j and a < b:
                    out.append((i, j, j * cap, a, b))
        return out

    def _rounds(self, work):
        if work.kind == "broadcast":
            return -(-sum(work.sizes) // self.slot_bytes) if self.world_size > 1 else 0
        n = self.world_size
        return max([-(-work.sizes[i][j] // self.lane) for i in range(n) for j in range(n) if i != j] + [0])

    def _broadcast_pieces(self, work, k):
        """Round k of a broadcast: [(tensor index, slot offset, start, stop)] of rank 0's concatenated bytes."""
        lo, hi, out, offset = k * self.slot_bytes, (k + 1) * self.slot_bytes, [], 0
        for i, size in enumerate(work.sizes):
            a, b = max(lo, offset), min(hi, offset + size)
            if a < b:
                out.append((i, a - lo, a - offset, b - offset))
            offset += size
        return out

    def _run(self, work):
        if work.kind == "all_to_all" and work.sizes[self.rank][self.rank]:
            with self._on(1, work.event):
                work.recvs[self.rank].copy_(work.sends[self.rank], non_blocking=True)
        rounds = self._rounds(work)
        if rounds:
            self._fill(work, 0)
        for k in range(rounds):
            seq = self.seq + k
            self._sync_stream(0)
            self._publish(POSTED, self._stamp(seq))
            if k + 1 < rounds:
                self._fill(work, k + 1)
            self._drain(work, k)
            self._publish(CONSUMED, self._stamp(seq))
        self.seq += rounds

    def _stamp(self, seq):
        return (self.op_id << 32) + seq + 1

    def _peers_reached(self, which, seq):
        want = self._stamp(seq)
        return lambda: all(self._words[self._word(r, which)] >= want for r in range(self.world_size) if r != self.rank)

    def _fill(self, work, k):
        """Copy this rank's sends of round k into its slot (the slot's last readers done first)."""
        seq = self.seq + k
        if seq >= 2:
            self._wait(self._peers_reached(CONSUMED, seq - 2))
        slot = self._slot(self.rank, seq)
        with self._on(0, work.event):
            if work.kind == "broadcast":
                if self.rank == 0:
                    for i, off, a, b in self._broadcast_pieces(work, k):
                        slot[off:off + b - a].copy_(work.sends[i][a:b], non_blocking=True)
                return
            for i, j, off, a, b in self._pieces(work, k):
                if i == self.rank:
                    slot[off:off + b - a].copy_(work.sends[j][a:b], non_blocking=True)

    def _drain(self, work, k):
        """Wait for round k from every peer, copy what this rank receives out of their slots."""
        seq = self.seq + k
        self._wait(self._peers_reached(POSTED, seq))
        with self._on(1, work.event):
            if work.kind == "broadcast":
                if self.rank != 0:
                    slot = self._slot(0, seq)
                    for i, off, a, b in self._broadcast_pieces(work, k):
                        work.recvs[i][a:b].copy_(slot[off:off + b - a], non_blocking=True)
            else:
                for i, j, off, a, b in self._pieces(work, k):
                    if j == self.rank:
                        work.recvs[i][a:b].copy_(self._slot(i, seq)[off:off + b - a], non_blocking=True)
        self._sync_stream(1)

    def _on(self, which, event):
        if self.device.type != "cuda":
            return _NoStream
        stream = self._streams[which]
        stream.wait_event(event)
        return torch.cuda.stream(stream)

    def _sync_stream(self, which):
        if self.device.type == "cuda":
            self._streams[which].synchronize()

    def close(self):
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self._data.data_ptr())
            self._pinned = False
        self._words.release()
        del self._data
        try:
            self._map.close()
        except BufferError:
            pass  # a view of it is still referenced (a traceback's frame): unmapped once that goes
        for fd in (self.fd, *self.bells):
            os.close(fd)


class _NoStream:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NoStream = _NoStream()
