"""``ParallelGroup``: rank 0 (this process, ``devices[0]``) owns one headless worker process per other device.

idle -> starting -> ready <-> running; a dead, stopped, hung or misbehaving worker -> broken (every
worker killed) until close() -> closed. No process-wide state (no torch.distributed group, environment
change, signal or exit handler) and no socket: workers talk to rank 0 over private pipes and move data
through the group's shared memory. A monitor thread judges workers by liveness: one that works (loads
a checkpoint) is waited for up to the op's timeout; one that exits, stays stopped, or shows neither a
heartbeat, CPU time, nor a running or I/O state for ``Timeouts.silent`` breaks the group at once.
"""

import collections
import contextlib
import enum
import functools
import importlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import torch

import comfy.cli_args

from . import channel, ops
from .errors import ParallelCancelled, ParallelError, ParallelGroupError, ParallelOpError, ParallelStateError, ParallelTimeout
from .transport import HostTransport, OpAborted

logger = logging.getLogger(__name__)

# workers import exactly what rank 0 imports: rank 0's sys.path, in its order, before anything else
BOOT = "import json, sys; sys.path[:] = json.loads(sys.argv[1]); from comfy.parallel.worker import main; main(sys.argv[2:])"
POLL = 0.1
LOG_TAIL = 200
SLOT_BYTES = 64 << 20
# modules whose code every rank must share, besides the ones an op names
OWN_MODULES = tuple(f"comfy.parallel.{m}" for m in ("channel", "group", "ops", "stream_path", "transport", "worker"))


@dataclass(frozen=True)
class Timeouts:
    """Seconds. ``startup``: spawn to ready; ``op``: a run() without a timeout of its own; ``stopped``: a
    worker stopped (SIGSTOP, a debugger) this long is at fault; ``silent``: a worker with neither a
    heartbeat nor CPU time for this long is hung; ``close``: a clean shutdown."""
    startup: float = 600.0
    op: float = 600.0
    stopped: float = 5.0
    silent: float = 30.0
    close: float = 5.0


class _Worker:
    """One worker process: its control pipes, log pipe, exit sentinel and liveness."""

    def __init__(self, rank, device, env, transport_fds):
        self.rank, self.device = rank, device
        (cmd_r, self.cmd_fd), (self.reply_fd, reply_w), (self.log_fd, log_w) = os.pipe(), os.pipe(), os.pipe()
        argv = [sys.executable, "-c", BOOT, json.dumps([os.path.abspath(p) for p in sys.path]), str(rank), str(cmd_r),
                str(reply_w), str(os.getpid())]
        try:
            self.proc = subprocess.Popen(argv, pass_fds=(cmd_r, reply_w, *transport_fds), stdin=subprocess.DEVNULL,
                                         stdout=log_w, stderr=log_w, env=env, start_new_session=True)
        except BaseException:
            for fd in (self.cmd_fd, self.reply_fd, self.log_fd):
                os.close(fd)
            raise
        finally:
            for fd in (cmd_r, reply_w, log_w):
                os.close(fd)
        self.pid = self.proc.pid
        self.pidfd = os.pidfd_open(self.pid)  # readable once the process has exited
        for fd in (self.cmd_fd, self.reply_fd, self.log_fd):
            os.set_blocking(fd, False)
        self.replies, self.log = channel.Reader(self.reply_fd), collections.deque(maxlen=LOG_TAIL)
        self.log_buf, self.phase, self.ready_body, self.exited = b"", "spawned", None, False
        self.stopped_since, self.seen = None, (None, None, time.monotonic())  # (heartbeat, cpu ticks, when either moved)

    def send(self, kind, body, timeout):
        channel.write(self.cmd_fd, channel.encode(kind, body), timeout)

    def signal(self, sig):
        """To the worker's whole process group (anything it started goes with it), until it is reaped."""
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, sig)

    def read_log(self):
        try:
            data = os.read(self.log_fd, 1 << 16)
        except BlockingIOError:
            return True
        self.log_buf += data
        *lines, self.log_buf = self.log_buf.split(b"\n")
        for line in lines:
            text = line.decode("utf-8", "replace")
            self.log.append(text)
            level = logging.WARNING if text.split(" ", 1)[0] in ("WARNING", "ERROR", "CRITICAL") else logging.DEBUG
            logger.log(level, "[rank %d] %s", self.rank, text)
        return bool(data)

    def stat(self):
        """(state letter, utime + stime ticks) from /proc; None once it is gone."""
        try:
            with open(f"/proc/{self.pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            return None
        return fields[0], int(fields[11]) + int(fields[12])

    def close_fds(self):
        for fd in (self.cmd_fd, self.reply_fd, self.log_fd, self.pidfd):
            os.close(fd)


class _Op:
    def __init__(self, op_id, name, timeout):
        self.id, self.name, self.timeout, self.deadline = op_id, name, timeout, time.monotonic() + timeout
        self.replies, self.cancelled = {}, False


class ParallelGroup:
    """A group of ranks for one job. ``slot_bytes``: the size of each of a rank's two transport slots
    (pinned host memory on CUDA; a collective larger than a slot takes several rounds). ``device_path``:
    on CUDA, copy GPU to GPU where every pair passes a test at start. ``data_path`` says what moves the
    data: "device", "host" (pinned host memory, ordered on the GPUs' streams) or "host, on the calling
    thread" (CPU ranks, or GPUs without stream memory operations, staged in CPU memory)."""

    def __init__(self, name="parallel", timeouts=None, slot_bytes=SLOT_BYTES, device_path=True):
        self.name, self.timeouts, self.slot_bytes = name, timeouts or Timeouts(), slot_bytes
        self.device_path, self.data_path = device_path, None
        self._cond = threading.Condition(threading.RLock())  # guards state, error, _op; wakes waiters
        self._quiet = threading.Event()  # set while no start() or run() is in flight
        self._quiet.set()
        self.state, self.error, self._op, self._workers, self._devices = "idle", None, None, [], []
        self._transport = self._ctx = self._stop = self._monitor = None
        self._op_id, self.startup_seconds = 0, {}

    world_size = property(lambda self: len(self._devices))

    def worker_pids(self):
        return {w.rank: w.pid for w in self._workers if not w.exited}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def start(self, devices, imports=(), *, comfyui=False, local_state=None, env=None):
        """Spawn one worker per ``devices[1:]``, which import ``imports`` (the modules registering the ops; rank 0
        imports them first), run ComfyUI's start-up with this process's arguments if ``comfyui``, attach the
        transport and probe it; -> ready. ``local_state``: rank 0's ``ctx.state``; ``env``: added to the
        workers' environment. ValueError for devices this machine lacks, before any process starts."""
        if not sys.platform.startswith("linux"):
            raise ParallelError(f"parallel worker groups run on Linux only (this is {sys.platform})")
        devices, imports = _check_devices(devices), list(imports)
        for module in imports:
            importlib.import_module(module)
        with self._cond:
            if self.state not in ("idle", "closed"):
                raise ParallelStateError(f"start() needs state idle or closed; group {self.name!r} is {self.state}; call close() first")
            self.state, self.error, self._devices = "starting", None, devices
            self._quiet.clear()
        try:
            self._start(imports, comfyui, local_state, env)
        except BaseException as exc:
            if isinstance(exc, ParallelGroupError):
                self._set_fault(exc)
            err = exc if isinstance(exc, ParallelStateError) or self.error is None else self.error  # the fault under it
            self._quiet.set()
            self.close()
            if err is exc:
                raise
            raise err from exc
        finally:
            self._quiet.set()

    def _start(self, imports, comfyui, local_state, env):
        t0 = time.monotonic()
        deadline = t0 + self.timeouts.startup
        modules = list(OWN_MODULES) + imports
        expected = ops.code_fingerprints(modules)
        self._transport = HostTransport(0, self.world_size, self._devices[0], self.slot_bytes)
        hello = {"world_size": self.world_size, "device": "cuda:0" if self._devices[0].type == "cuda" else "cpu",
                 "transport": {"fds": self._transport.fds(), "slot_bytes": self.slot_bytes}, "imports": imports,
                 "modules": modules, "comfyui": _comfyui_start() if comfyui else None}
        self._stop = threading.Event()
        self._monitor = threading.Thread(target=self._watch, args=(self._stop,), name=f"parallel-{self.name}", daemon=True)
        self._monitor.start()
        for r in range(1, self.world_size):
            w = _Worker(r, self._devices[r], _worker_env(self._devices[r], self._devices, env), self._transport.fds())
            with self._cond:
                self._workers.append(w)
            w.send("hello", dict(hello, rank=r), 10.0)
        self._wait(lambda: all(w.phase == "ready" for w in self._workers), deadline,
                   lambda: ParallelTimeout(f"worker rank(s) {[w.rank for w in self._workers if w.phase != 'ready']} did not "
                                           f"start within {self.timeouts.startup:g}s (Timeouts.startup)"))
        odd = sorted({m for w in self._workers for m, h in expected.items() if w.ready_body["fingerprints"].get(m) != h})
        if odd:
            files = ", ".join(getattr(sys.modules[m], "__file__", m) for m in odd)
            raise ParallelError(f"{files} changed on disk after ComfyUI imported it, so workers would run other code "
                                "than ComfyUI does; restart ComfyUI to run the new code")
        t1 = time.monotonic()
        self._ctx = ops.OpContext(0, self.world_size, self._devices[0], self._transport,
                                  state={} if local_state is None else local_state)
        with self._cond:
            self.state = "ready"
        self.data_path = self.run("parallel.probe", {"device_path": self.device_path}, timeout=60.0).values[0]["data_path"]
        self.startup_seconds = {"spawn_to_ready": t1 - t0, "probe": time.monotonic() - t1, "total": time.monotonic() - t0}
        logger.info("parallel group %r ready: %d ranks in %.2fs, data through the %s path", self.name, self.world_size,
                    self.startup_seconds["total"], self.data_path)

    def _wait(self, done, deadline, late):
        """Until ``done()`` (under the lock); a fault raises it; past ``deadline`` ``late()`` breaks the group."""
        with self._cond:
            while self.error is None:
                if self.state == "closing":
                    raise ParallelStateError(f"group {self.name!r} was closed")
                if done():
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, 0.25))
        err = self.error or self._set_fault(late())
        _wait_all(list(self._workers), 5.0)  # each was sent SIGKILL: the fault reaches the caller with none running
        raise err

    def run(self, op_name, meta=None, timeout=None):
        """Run op ``op_name`` on every rank -> ``OpResult``. An exception of the op on rank 0 is raised as it is,
        one on a worker as ``ParallelOpError``; both leave the group ready, as do ``PreflightMismatch`` and
        ``ParallelCancelled``. ``ParallelGroupError``: the group broke. KeyError or TypeError before anything is sent."""
        fn, meta = ops.get_op(op_name), meta or {}
        with self._cond:
            if self.state == "broken":
                raise ParallelStateError(f"run(): group {self.name!r} is broken ({self.error.reason}); close() it and start() again")
            if self.state != "ready":
                raise ParallelStateError(f"run() needs state ready; group {self.name!r} is {self.state}")
            op = _Op(self._op_id + 1, op_name, timeout or self.timeouts.op)
            frame = channel.encode("run", {"id": op.id, "op": op_name, "meta": meta, "timeout": op.timeout})
            self._op_id, self._op, self.state = op.id, op, "running"
            self._quiet.clear()
        try:
            return self._run(op, fn, frame, meta)
        finally:
            with self._cond:
                self._op = None
                if self.state == "running":
                    self.state = "ready"
                self._cond.notify_all()
            self._quiet.set()

    def _run(self, op, fn, frame, meta):
        ctx, t = self._ctx, self._transport
        ctx.op_name = op.name
        t.begin_op(op.id, op.deadline)
        try:
            for w in self._workers:
                channel.write(w.cmd_fd, frame, 10.0)
        except (OSError, TimeoutError) as e:
            raise self._set_fault(ParallelGroupError(f"could not send op {op.name!r} to the workers ({e})")) from e
        own, value = None, None
        try:
            t.settle()  # after the frames: it may wait for the workers
            value = fn(ctx, meta)
        except OpAborted:
            pass
        except BaseException as e:
            own = e
            t.abort(op.id)
        try:
            self._wait(lambda: len(op.replies) == len(self._workers), op.deadline + 2.0,
                       lambda: ParallelTimeout(f"worker rank(s) {sorted(set(w.rank for w in self._workers) - set(op.replies))} "
                                               f"did not finish op {op.name!r} within its {op.timeout:g}s timeout"))
        except ParallelError:
            if own is not None and not isinstance(own, Exception):
                raise own  # an interrupt of this thread stays what it was
            raise
        if own is not None:
            raise own  # what rank 0's share raised (the same input fails alike on one process)
        errors = sorted((r, m["error"]) for r, m in op.replies.items() if m["status"] == "error")
        if errors:
            rank, err = errors[0]  # the lowest rank: the same input fails alike on every rank
            logger.error("op %r raised on worker rank %d:\n%s", op.name, rank, err["traceback"])
            raise ParallelOpError(f"op {op.name!r} raised {err['type']} on worker rank {rank}: {err['message'][:300]}",
                                  rank, err["type"], err["traceback"])
        if op.cancelled:
            raise ParallelCancelled(f"op {op.name!r} (id {op.id}) was cancelled; the group is ready for the next op")
        statuses = {r: m["status"] for r, m in op.replies.items()}
        if any(s != "ok" for s in statuses.values()):
            raise self._set_fault(ParallelGroupError(f"ranks left op {op.name!r} differently ({statuses})"))
        return ops.OpResult([value] + [op.replies[r]["value"] for r in sorted(op.replies)])

    def cancel(self):
        """Make the op in flight stop on every rank; returns at once (True if one was in flight). Its run() raises
        ``ParallelCancelled`` once every rank has left it; the group stays ready."""
        with self._cond:
            op = self._op
            if op is None:
                return False
            op.cancelled = True
        self._transport.abort(op.id)
        return True

    def _set_fault(self, err):
        """Break the group with ``err`` (the first fault wins): every rank leaves its op, every worker dies."""
        with self._cond:
            if self.error is None:
                self.error = err
                w = next((w for w in self._workers if w.rank == err.rank), None)
                tail = "\n".join(w.log) if w is not None else ""
                logger.error("parallel group %r broken: %s%s", self.name, err,
                             f"\nlast lines of rank {w.rank}'s log:\n{tail}" if tail else "")
                if self.state in ("starting", "ready", "running"):
                    self.state = "broken"
                self._cond.notify_all()
            kept = self.error
        self._kill_all()
        return kept

    def _kill_all(self):
        """Every rank leaves its op now; every worker dies."""
        if self._transport is not None:
            self._transport.abort(1 << 62)
        for w in self._workers:
            w.signal(signal.SIGKILL)

    def _watch(self, stop):
        try:
            poller = select.poll()
            fds = {}
            while not stop.is_set():
                with self._cond:
                    workers = list(self._workers)
                for w in workers:
                    # each handler returns whether its fd stays open
                    for fd, handle in ((w.pidfd, self._on_exit), (w.reply_fd, self._read_replies), (w.log_fd, _Worker.read_log)):
                        if fd not in fds and not w.exited:
                            fds[fd] = functools.partial(handle, w)
                            poller.register(fd, select.POLLIN)
                for fd, _ in poller.poll(POLL * 1000):
                    if not fds[fd]():
                        poller.unregister(fd)
                self._check_workers()
        except Exception as e:
            logger.exception("the monitor of parallel group %r failed", self.name)
            self._set_fault(ParallelGroupError(f"rank 0's monitor thread failed: {e!r}", 0))

    def _read_replies(self, w):
        try:
            replies = w.replies.feed()
        except EOFError:
            return False  # its exit follows (pidfd)
        except ValueError as e:
            self._set_fault(ParallelGroupError(f"worker rank {w.rank} sent a malformed reply ({e})", w.rank))
            return False
        for kind, body in replies:
            problem = _check_reply(kind, body, w.phase)
            if problem:
                self._set_fault(ParallelGroupError(f"worker rank {w.rank} sent a malformed {kind!r} reply ({problem})", w.rank))
                return False
            with self._cond:
                op = self._op
                if kind == "result":
                    if op is None or body["id"] != op.id or w.rank in op.replies:
                        self._set_fault(ParallelGroupError(f"worker rank {w.rank} sent a result for op {body['id']}, "
                                                           f"not for the op in flight", w.rank))
                        return False
                    op.replies[w.rank] = body
                    if body["status"] == "error":
                        self._transport.abort(op.id)
                else:
                    w.phase, w.ready_body = kind, body
                self._cond.notify_all()
        return True

    def _on_exit(self, w):
        code = w.proc.wait()
        while w.read_log():
            pass
        w.exited = True
        with self._cond:
            op = self._op
            when = (f"during start-up (after {w.phase!r})" if w.phase != "ready" else
                    f"during op {op.name!r}" if op is not None and w.rank not in op.replies else "while idle")
            closing = self.state in ("closing", "closed")
        if not closing:
            sig = next((s.name for s in signal.Signals if s == -code), f"signal {-code}")
            how = f"exited with code {code}" if code >= 0 else f"was killed by {sig}"
            self._set_fault(ParallelGroupError(f"worker rank {w.rank} (pid {w.pid}, {w.device}) {how} {when}", w.rank))
        return False

    def _check_workers(self):
        now = time.monotonic()
        op = self._op
        if op is not None and (now > op.deadline or self._transport.aborted()):
            self._transport.abort(op.id)  # a GPU waiting in a collective of a late or aborted op goes on
        heartbeats = self._transport.heartbeats()
        for w in list(self._workers):
            if w.exited or self.error is not None:
                continue
            stat = w.stat()
            if stat is None:
                continue
            state, cpu = stat
            w.stopped_since = (w.stopped_since or now) if state in (b"T", b"t") else None
            if w.stopped_since is not None and now - w.stopped_since > self.timeouts.stopped:
                self._set_fault(ParallelGroupError(
                    f"worker rank {w.rank} (pid {w.pid}, {w.device}) stayed stopped (SIGSTOP? a debugger?) for more than "
                    f"{self.timeouts.stopped:g}s (Timeouts.stopped) and was killed", w.rank))
                continue
            # running, or waiting on storage (a checkpoint read by page faults holds the GIL): working
            if (heartbeats[w.rank], cpu) != w.seen[:2] or state in (b"R", b"D"):
                w.seen = (heartbeats[w.rank], cpu, now)
            elif w.stopped_since is None and now - w.seen[2] > self.timeouts.silent:
                self._set_fault(ParallelGroupError(
                    f"worker rank {w.rank} (pid {w.pid}, {w.device}) showed no heartbeat and no CPU time for "
                    f"{self.timeouts.silent:g}s (Timeouts.silent): hung, and killed", w.rank))

    def close(self):
        """Stop every worker (gracefully when idle) and free the transport. Idempotent; safe after any fault."""
        with self._cond:
            state = self.state
            if state in ("idle", "closed"):
                self.state = "closed"
                return
            if state == "closing":
                self._cond.wait_for(lambda: self.state == "closed", timeout=self.timeouts.close + 30)
                return
            self.state = "closing"
            self._cond.notify_all()
        if state in ("starting", "running"):
            self._kill_all()
            if not self._quiet.wait(10.0):  # the start() or run() in flight returns once its workers are killed
                logger.error("parallel group %r: the thread in %s did not return; tearing down under it", self.name, state)
        workers = self._workers
        if state == "ready":  # idle workers shut down by themselves
            for w in workers:
                try:
                    w.send("shutdown", {}, 1.0)
                except (OSError, TimeoutError):
                    w.signal(signal.SIGKILL)
            _wait_all(workers, self.timeouts.close)
        for sig, wait in ((signal.SIGTERM, 1.0), (signal.SIGKILL, 5.0)):
            for w in workers:
                w.signal(sig)
            _wait_all(workers, wait)
        if self._stop is not None:
            self._stop.set()
            self._monitor.join()
            self._stop = self._monitor = None
        for w in workers:
            w.close_fds()
        self._ctx = None
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        with self._cond:
            self._workers, self.state = [], "closed"
            self._cond.notify_all()


def _check_reply(kind, body, phase):
    """What is wrong with a worker's reply, or ''."""
    want = {"booted": "spawned", "ready": "booted", "result": "ready"}
    if kind not in want:
        return "unknown kind"
    if phase != want[kind]:
        return f"{kind!r} while {phase!r}"
    if kind != "result":
        return "" if kind == "booted" or isinstance(body.get("fingerprints"), dict) else "no fingerprints"
    if not (isinstance(body.get("id"), int) and body.get("status") in ("ok", "error", "aborted") and "value" in body):
        return "a result needs id, status and value"
    err = body.get("error")
    if body["status"] == "error" and not (isinstance(err, dict) and all(isinstance(err.get(k), str) for k in ("type", "message", "traceback"))):
        return "an error result needs type, message and traceback"
    return ""


def _wait_all(workers, timeout):
    end = time.monotonic() + timeout
    while any(w.proc.poll() is None for w in workers) and time.monotonic() < end:
        time.sleep(0.02)


def _check_devices(devices):
    """-> torch devices, all 'cpu' or all existing 'cuda:<i>' (ranks may share a GPU); ValueError otherwise."""
    parsed = [torch.device(d) for d in devices]
    kinds = {d.type for d in parsed}
    if len(parsed) < 2 or len(kinds) != 1 or not kinds <= {"cpu", "cuda"}:
        raise ValueError(f"a parallel group needs 2 or more devices, all 'cpu' or all 'cuda:<index>'; got {list(devices)}")
    found = torch.cuda.device_count() if kinds == {"cuda"} else 0
    bad = [str(d) for d in parsed if d.type == "cuda" and (d.index is None or d.index >= found)]
    if bad:
        raise ValueError(f"devices {', '.join(bad)} were asked for, but this machine has {found} CUDA device(s) "
                         f"({', '.join(f'cuda:{i}' for i in range(found)) or 'none'}); name only those, with their index")
    return parsed


def _comfyui_start():
    """What a worker needs to start ComfyUI as this process did: the whole ``comfy.cli_args.args`` as JSON (enums
    by class name and value, sets as lists) and whether DynamicVRAM came up here."""
    from comfy import memory_management  # loaded by the caller's ComfyUI already; not by comfy.parallel alone

    def encode(v):
        if isinstance(v, enum.Enum):
            return {"enum": type(v).__name__, "value": v.value}
        if isinstance(v, (set, frozenset)):
            return {"set": list(v)}
        raise ParallelError(f"one of ComfyUI's arguments holds a {type(v).__name__}, which the workers cannot be started with")
    return {"args": json.dumps(vars(comfy.cli_args.args), default=encode), "dynamic_vram": memory_management.aimdo_enabled}


def _worker_env(device, devices, extra):
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONUNBUFFERED="1")
    if device.type == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    else:
        # cuda:<i> is the i-th device this process sees, itself perhaps a subset. The worker's own GPU is its
        # cuda:0; the group's other GPUs follow it, for the device path's peer copies
        visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()] or None
        order = list(dict.fromkeys([device.index] + [d.index for d in devices]))
        env["CUDA_VISIBLE_DEVICES"] = ",".join(visible[i] if visible else str(i) for i in order)
    return env | (extra or {})
