"""The data path of a ParallelGroup: host memory shared by the group's processes and nobody else.

Rank 0 creates one memfd segment and one eventfd "bell" per rank; the workers inherit them. Each
rank owns two slots. On CUDA the GPUs move the data themselves (stream_path). Otherwise a collective
runs on the calling thread in rounds: in round k every rank copies what it sends into its slot k % 2
and publishes it, then copies what it receives out of its peers' slots and publishes that. Every wait
blocks on the rank's bell and ends when the op is aborted or past its deadline.
"""

import collections
import contextlib
import mmap
import os
import select
import time

import torch

HEADER = 4096  # the words below, then a page of 32-bit flags written and waited on by the GPUs (stream_path)
FLAG_PAGE = 4096
ABORT = 0  # the highest aborted op id; any rank may write it
RANK_WORDS = 8  # a cache line per rank: heartbeat, posted, consumed
HEARTBEAT, POSTED, CONSUMED = 0, 1, 2
MAX_RANKS = HEADER // (8 * RANK_WORDS) - 1
ALIGN = 64


class OpAborted(Exception):
    """The op was aborted by another rank's failure, a cancel or a fault; leave it."""


def _chunks(sizes, cap):
    """The concatenation of ``sizes`` bytes in rounds of ``cap`` -> (round, offset in it, index, start, stop)."""
    offset = 0
    for i, size in enumerate(sizes):
        a = 0
        while a < size:
            k, off = divmod(offset + a, cap)
            b = min(size, a + cap - off)
            yield k, off, i, a, b
            a = b
        offset += size


class Done:
    """A collective of the host path: done when its call returned."""

    def wait(self):
        pass


class HostTransport:
    """One rank's end. Rank 0 (no ``fd``) makes the segment and bells; ``fds()`` lists what workers inherit."""

    def __init__(self, rank, world_size, device, slot_bytes, fd=None, bells=None):
        if not 1 <= world_size <= MAX_RANKS:
            raise ValueError(f"a parallel group has at most {MAX_RANKS} ranks, got {world_size}")
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        self.slot_bytes = -(-slot_bytes // ALIGN) * ALIGN
        self.lane = self.slot_bytes // world_size // ALIGN * ALIGN
        size = HEADER + FLAG_PAGE + 2 * world_size * self.slot_bytes
        if fd is None:
            fd = os.memfd_create("comfy-parallel", os.MFD_CLOEXEC)
            os.ftruncate(fd, size)
            bells = [os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC) for _ in range(world_size)]
        self.fd, self.bells = fd, bells
        self._map = mmap.mmap(fd, size)
        self._words = memoryview(self._map)[:HEADER].cast("q")
        with torch.inference_mode(False):  # not inference tensors: an abort writes the flags from any thread (the monitor's)
            self.flags = torch.frombuffer(self._map, dtype=torch.int32, offset=HEADER, count=FLAG_PAGE // 4)
            self._data = torch.frombuffer(self._map, dtype=torch.uint8, offset=HEADER + FLAG_PAGE)
        self.op_id, self.deadline, self.seq, self.stream_path, self._aborts_seen = 0, float("inf"), 0, None, 0
        self._poll = select.poll()
        self._poll.register(self.bells[rank], select.POLLIN)

    def fds(self):
        return [self.fd, *self.bells]

    def _word(self, rank, which):
        return 8 + rank * RANK_WORDS + which

    def heartbeat(self):
        i = self._word(self.rank, HEARTBEAT)
        self._words[i] = self._words[i] + 1

    def heartbeats(self):
        return [self._words[self._word(r, HEARTBEAT)] for r in range(self.world_size)]

    def abort(self, op_id):
        """Make every rank leave op ``op_id`` (a no-op for an op already left); no GPU waits for a flag any more."""
        if self._words[ABORT] < op_id:
            self._words[ABORT] = op_id
        self._ring(range(self.world_size))
        if self.stream_path is not None:
            self.stream_path.release()

    def slot_address(self, rank, parity):
        return self._data.data_ptr() + (rank * 2 + parity) * self.slot_bytes

    def aborted(self):
        return self._words[ABORT] >= self.op_id

    def _ring(self, ranks):
        for r in ranks:
            with contextlib.suppress(BlockingIOError):  # the counter is full: the bell already rings
                os.eventfd_write(self.bells[r], 1)

    def publish(self, which, value):
        self._words[self._word(self.rank, which)] = value
        self._ring(r for r in range(self.world_size) if r != self.rank)

    def wait_words(self, which, want, spin=2e-4):
        """Until every peer's word ``which`` is at least ``want`` (spinning ``spin`` s first, then on the bell)."""
        ready = self._peers_reached(which, want)
        end = time.perf_counter() + spin
        while not ready():
            if time.perf_counter() > end:
                self._wait(ready)
                return

    def nonce(self):
        return os.urandom(8)

    def _wait(self, ready):
        while not ready():
            if self.aborted():
                raise OpAborted(f"op {self.op_id} was aborted")
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"rank {self.rank}: a collective of op {self.op_id} passed the op's deadline")
            self._poll.poll(min(left, 0.5) * 1000)
            with contextlib.suppress(BlockingIOError):
                os.eventfd_read(self.bells[self.rank])

    def begin_op(self, op_id, deadline):
        """Enter op ``op_id``; then, once every rank is told to run it, ``settle()``."""
        self.op_id, self.deadline, self.seq = op_id, deadline, 0

    def settle(self):
        """The stream path after an aborted op: waits for every rank (each calls it at the start of its op)."""
        if self.stream_path is not None and self._words[ABORT] != self._aborts_seen:
            # an op was aborted since the last one: every rank's stream drained, then every flag zero
            self._aborts_seen = self._words[ABORT]
            self.stream_path.drain()
            self.all_gather_bytes(b"", 1)
            self.stream_path.reset()
            self.all_gather_bytes(b"", 1)

    def all_to_all(self, sends, recvs, sizes):
        """``sends[j]`` -> rank j's ``recvs[rank]``. ``sizes[i][j]``: bytes from rank i to rank j, the same
        matrix on every rank; tensors contiguous (None where the size is 0). -> an object whose wait() returns
        once ``recvs`` hold the data. CUDA tensors go by the ``stream_path`` the group set up at start (device
        to device, or through host memory); its wait() is the caller's stream waiting on the GPU."""
        if any(t is not None and t.is_cuda for t in (*sends, *recvs)):
            if self.stream_path is None:
                return self._through_cpu(sends, recvs, lambda s, r: self.all_to_all(s, r, sizes))
            return self.stream_path.all_to_all(_bytes(sends), _bytes(recvs), sizes)
        n, rounds = self.world_size, collections.defaultdict(list)
        for i in range(n):
            for j in range(n):
                if i != j:
                    for k, _, _, a, b in _chunks([sizes[i][j]], self.lane):
                        rounds[k].append((i, (j,), j * self.lane, j, i, a, b))
        return self._submit(sends, recvs, rounds, own=sizes[self.rank][self.rank] > 0)

    def broadcast(self, tensors):
        """Rank 0's ``tensors`` into every other rank's (same shapes and dtypes, contiguous); blocks."""
        if self.stream_path is not None and tensors and tensors[0].is_cuda:
            n = self.world_size
            for t in tensors:
                size, flat = t.numel() * t.element_size(), t.reshape(-1).view(torch.uint8)
                sizes = [[size if i == 0 and j else 0 for j in range(n)] for i in range(n)]
                self.stream_path.all_to_all([flat] * n if self.rank == 0 else [None] * n,
                                            [None] * n if self.rank == 0 else [flat] + [None] * (n - 1), sizes).wait()
            return
        if tensors and tensors[0].is_cuda:
            none = [None] * len(tensors)
            self._through_cpu(none if self.rank else tensors, tensors if self.rank else none,
                              lambda s, r: self.broadcast(r if self.rank else s))
            return
        rounds, peers = collections.defaultdict(list), tuple(range(1, self.world_size))
        for k, off, i, a, b in _chunks([t.numel() * t.element_size() for t in tensors], self.slot_bytes):
            rounds[k].append((0, peers, off, i, i, a, b))
        self._submit(tensors, tensors, rounds)

    def all_gather_bytes(self, data, size=64):
        """Every rank's ``data`` (at most ``size`` bytes) -> the list of all ranks' (zero-padded); blocks."""
        if len(data) > size:
            raise ValueError(f"all_gather_bytes takes at most {size} bytes, got {len(data)}")
        mine = torch.frombuffer(bytearray(data.ljust(size, b"\0")), dtype=torch.uint8)
        out = [torch.empty(size, dtype=torch.uint8) for _ in range(self.world_size)]
        self.all_to_all([mine] * self.world_size, out, [[size] * self.world_size] * self.world_size).wait()
        return [bytes(t.tolist()) for t in out]

    @torch.inference_mode()  # it may write tensors ComfyUI made in inference mode, for a caller outside it
    def _through_cpu(self, sends, recvs, move):
        """CUDA tensors where the GPUs lack stream memory operations: staged in CPU memory, blocking."""
        staged = [None if t is None else torch.empty(t.shape, dtype=t.dtype) for t in recvs]
        move([None if t is None else t.cpu() for t in sends], staged)
        for t, c in zip(recvs, staged):
            if t is not None:
                t.copy_(c)
        return Done()

    @torch.inference_mode()
    def _submit(self, sends, recvs, rounds, own=False):
        """``rounds[k]``: round k's pieces (src, dsts, slot offset, send index, recv index, start, stop);
        ``own``: copy this rank's ``sends[rank]`` into its ``recvs[rank]``. Runs them on this thread -> Done."""
        if self.aborted():
            raise OpAborted(f"op {self.op_id} was aborted")
        sends, recvs = _bytes(sends), _bytes(recvs)
        if own:
            recvs[self.rank].copy_(sends[self.rank])
        for k in range(len(rounds)):
            seq = self.seq + k
            if seq >= 2:  # the slot's last readers are done with it
                self.wait_words(CONSUMED, self.stamp(seq - 2))
            slot = self._slot(self.rank, seq)
            for src, _, off, i, _, a, b in rounds[k]:
                if src == self.rank:
                    slot[off:off + b - a].copy_(sends[i][a:b])
            self.publish(POSTED, self.stamp(seq))
            self.wait_words(POSTED, self.stamp(seq))
            for src, dsts, off, _, i, a, b in rounds[k]:
                if self.rank in dsts:
                    recvs[i][a:b].copy_(self._slot(src, seq)[off:off + b - a])
            self.publish(CONSUMED, self.stamp(seq))
        self.seq += len(rounds)
        return Done()

    def stamp(self, seq):
        return (self.op_id << 32) + seq + 1

    def _peers_reached(self, which, want):
        return lambda: all(self._words[self._word(r, which)] >= want for r in range(self.world_size) if r != self.rank)

    def _slot(self, rank, seq):
        start = (rank * 2 + seq % 2) * self.slot_bytes
        return self._data[start:start + self.slot_bytes]

    def close(self):
        self.abort(1 << 62)  # a collective still waiting for a peer (gone, or never coming) leaves it
        if self.stream_path is not None:
            self.stream_path.close()
            self.stream_path = None
        self._words.release()
        del self._data
        try:
            self._map.close()
        except BufferError:
            pass  # a view of it is still referenced (a traceback's frame): unmapped once that goes
        for fd in (self.fd, *self.bells):
            os.close(fd)


def _bytes(tensors):
    return [None if t is None else t.reshape(-1).view(torch.uint8) for t in tensors]
