"""``ParallelGroup``: rank 0 (this process, ``devices[0]``) owns one headless ComfyUI worker per other device.

idle -> starting -> ready <-> running; a fault -> broken (every worker killed) until close() -> closed.
A monitor thread reads the replies and watches exits (pidfd), stops and deadlines. Killing the workers
ends every receive rank 0 waits in at once; a gloo send waits out ``Timeouts.collective``."""

import atexit
import enum
import importlib
import json
import logging
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import weakref
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

import comfy.cli_args

from . import frames, ops
from .errors import (RESTART_HINT, ParallelCancelled, ParallelError, ParallelGroupError, ParallelOpError, ParallelStateError,
                     ParallelTimeout, PreflightMismatch, describe_exit)

logger = logging.getLogger(__name__)

# workers import exactly what rank 0 imports: rank 0's sys.path, in its order, before anything else
# (python -m would put the working directory first, and PYTHONSAFEPATH does not exist on Python 3.10)
BOOT = "import json, sys; sys.path[:] = json.loads(sys.argv[1]); from comfy.parallel.worker import main; main(sys.argv[2:])"
POLL = 0.1
# after a rank fails inside a collective, how long the others get to report (a peer's death or
# timeout reaches them within about the same time)
SETTLE = 2.0
_live = weakref.WeakSet()


@dataclass(frozen=True)
class Timeouts:
    """Seconds. ``collective``: the rendezvous and any one wait of a rank for its peers (in a gloo collective,
    or for the workers' results once rank 0 is done); ``op``: a run() without a timeout of its own."""
    startup: float = 600.0
    collective: float = 7.0
    op: float = 600.0
    cancel: float = 10.0
    stopped: float = 5.0
    close: float = 5.0

    def __post_init__(self):
        bad = {k: v for k, v in asdict(self).items() if not (isinstance(v, (int, float)) and 0 < v < float("inf"))}
        if bad:
            raise ValueError(f"Timeouts must be positive numbers of seconds, got {bad}")


class _Worker:
    """One worker process, its two pipes, its exit sentinel and its log."""

    def __init__(self, rank, device, log_path, env):
        self.rank, self.device, self.log_path = rank, device, log_path
        (cmd_r, self.cmd_fd), (self.reply_fd, reply_w) = os.pipe(), os.pipe()
        argv = [sys.executable, "-c", BOOT, json.dumps([os.path.abspath(p) for p in sys.path]), str(rank), str(cmd_r),
                str(reply_w), str(os.getpid())]
        try:
            with open(log_path, "xb") as log:
                self.proc = subprocess.Popen(argv, pass_fds=(cmd_r, reply_w), stdin=subprocess.DEVNULL, stdout=log,
                                             stderr=subprocess.STDOUT, env=env, start_new_session=True)
        except BaseException:
            os.close(self.cmd_fd)
            os.close(self.reply_fd)
            raise
        finally:
            os.close(cmd_r)
            os.close(reply_w)
        self.pid = self.proc.pid
        self.pidfd = os.pidfd_open(self.pid)  # readable once the process has exited
        os.set_blocking(self.cmd_fd, False)
        os.set_blocking(self.reply_fd, False)
        self.buf, self.phase, self.inbox, self.exited, self.eof, self.stopped_since = bytearray(), "spawned", {}, False, False, None

    def send(self, buffers, timeout):
        frames.write(self.cmd_fd, buffers, timeout)
    def signal(self, sig):
        """To the worker's whole process group (anything an op started goes with it), until it is reaped."""
        if self.proc.returncode is None:
            try:
                os.killpg(self.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def is_stopped(self):  # 'T' SIGSTOP and friends, 't' a tracer
        with open(f"/proc/{self.pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1][1:2] in (b"T", b"t")

    def log_tail(self):
        with open(self.log_path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 6000))
            return f.read().decode("utf-8", "replace")

    def close_fds(self):
        for fd in (self.cmd_fd, self.reply_fd, self.pidfd):
            os.close(fd)


class _Op:
    def __init__(self, op_id, name, timeout):
        self.id, self.name, self.timeout, self.started, self.replies = op_id, name, timeout, time.monotonic(), {}
        self.deadline = self.started + timeout
        # when cancel() was called, rank 0 left its part, a rank first failed inside a collective
        self.cancel_at = self.rank0_done = self.failed_at = self.rank0_error = None


class ParallelGroup:
    """``log_dir``: where the workers' logs go (``rank{r}-gen{g}.log``, never overwritten); by default the private
    folder of each start (``tempfile.mkdtemp``, 0700, outside ComfyUI's temp and output folders), which a clean
    close() removes and a fault keeps for its logs (the error names the log)."""

    def __init__(self, name="parallel", log_dir=None, timeouts=None):
        self.name, self.timeouts, self._log_root, self.log_dir = name, timeouts or Timeouts(), log_dir, log_dir
        self._cond = threading.Condition(threading.RLock())  # guards state, error, _op; wakes waiters
        self._send_lock = threading.Lock()  # one writer per pipe
        self._quiet = threading.Event()  # set while no start() or run() is in flight
        self._quiet.set()
        self.state, self.error, self._op, self._workers, self._devices = "idle", None, None, [], []
        self._generation = self._op_id = 0
        self._folder = self._groups = self._ctx = self._stop = self._monitor = self._start_args = None
        self.startup_seconds = {}
        _live.add(self)

    world_size = property(lambda self: len(self._devices))

    def worker_pids(self):
        return {w.rank: w.pid for w in self._workers if not w.exited}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def start(self, devices, imports=(), *, local_state=None, env=None):
        """Spawn one worker per ``devices[1:]``, which import ``imports`` (the modules registering the ops; rank 0
        imports them first), rendezvous, probe; -> ready. ``local_state``: rank 0's ``ctx.state``; ``env``: added
        to the workers' environment. ValueError for devices this machine lacks, before any process starts."""
        devices, imports = _check_devices(devices), list(imports)
        for module in imports:
            importlib.import_module(module)
        _refuse_changed_sources()
        with self._cond:
            if self.state not in ("idle", "closed"):
                raise ParallelStateError(f"start() needs state idle or closed; group {self.name!r} is {self.state}; "
                                         "call close() first", self.state)
            holder = next((g for g in _live if g is not self and (g._groups is not None or g.state in ("starting", "closing"))), None)
            if holder is not None:
                raise ParallelStateError(f"cannot start group {self.name!r}: group {holder.name!r} (state {holder.state}, "
                                         f"{holder.world_size} ranks) is active in this process and torch.distributed's "
                                         f"default group is process-global; close() it first", self.state)
            if dist.is_initialized():
                raise ParallelStateError("torch.distributed is initialized by other code in this process", self.state)
            self.state, self.error, self._devices = "starting", None, devices
            self._start_args = (devices, imports, local_state, env)
            self._quiet.clear()
        try:
            self._start(imports, local_state, env)
        except BaseException as exc:
            err = self._fault_for(exc, None)
            self._teardown(graceful=False)
            if self.state != "closing":
                self._set_fault(err)
            if err is exc:
                raise
            raise err from exc
        finally:
            self._quiet.set()

    def _start(self, imports, local_state, env):
        t0 = time.monotonic()
        deadline, self._generation = t0 + self.timeouts.startup, self._generation + 1
        # raise the soft fd limit to the hard one, as servers do: gloo's listeners accept connections
        # from any local process, and an accept() past the limit aborts the process
        resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
        self._folder = tempfile.mkdtemp(prefix=f"comfy-parallel-{self.name}-")
        self.log_dir = self._log_root or self._folder
        os.makedirs(self.log_dir, exist_ok=True)
        while any(f.endswith(f"-gen{self._generation}.log") for f in os.listdir(self.log_dir)):
            self._generation += 1
        store_path = os.path.join(self._folder, "store")
        hello = {"world_size": self.world_size, "device": "cuda:0" if self._devices[0].type == "cuda" else "cpu", "store": store_path,
                 "folder": self._folder, "imports": imports, "timeouts": asdict(self.timeouts),
                 "comfyui_args": _comfyui_args() if "comfy.model_management" in sys.modules else None}
        before = ops.open_fds()
        self._stop = threading.Event()
        self._monitor = threading.Thread(target=self._watch, args=(self._stop,), name=f"parallel-{self.name}", daemon=True)
        self._monitor.start()
        for r in range(1, self.world_size):
            w = _Worker(r, self._devices[r], os.path.join(self.log_dir, f"rank{r}-gen{self._generation}.log"),
                        _worker_env(self._devices[r], env))
            self._workers.append(w)
            w.send(frames.encode("hello", dict(hello, rank=r)), 10.0)
        self._wait_phase("connected", deadline)
        t1 = time.monotonic()
        device = self._devices[0]
        self._groups = ops.init_groups(store_path, 0, self.world_size, device, self.timeouts.collective, self.timeouts.op)
        t2 = time.monotonic()
        ctx = ops.OpContext(0, self.world_size, device, *self._groups, state={} if local_state is None else local_state)
        ops.probe(ctx)
        ops.seal_fds(before)
        self._wait_phase("ready", deadline)
        t3 = time.monotonic()
        self._ctx = ctx
        self.startup_seconds = {"spawn_and_import": t1 - t0, "rendezvous": t2 - t1, "probe": t3 - t2, "total": t3 - t0}
        with self._cond:
            if self.error is not None:
                raise self.error
            self.state = "ready"
        logger.info("parallel group %r ready: %d ranks in %.2fs", self.name, self.world_size, t3 - t0)

    def _wait_phase(self, kind, deadline):
        missing = lambda: [w.rank for w in self._workers if kind not in w.inbox]
        self._wait(lambda: not missing(), lambda: deadline, missing, f"start-up ({kind})")

    def _wait(self, done, deadline, missing, what):
        with self._cond:
            while True:
                if self.error is not None:
                    raise self.error
                if self.state == "closing":
                    raise ParallelStateError(f"group {self.name!r} was closed during {what}", self.state)
                if done():
                    return
                left = deadline() - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, 0.25))
        raise self._late(missing(), f"did not finish {what} in time")

    def run(self, op_name, tensors=None, meta=None, timeout=None):
        """Run op ``op_name`` on every rank -> ``OpResult``. Raises ``PreflightMismatch`` (group stays ready),
        ``ParallelCancelled``, ``ParallelGroupError`` (broken), or before anything is sent KeyError or TypeError."""
        fn, tensors, meta = ops.get_op(op_name), tensors or {}, meta or {}
        if not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in tensors.items()):
            raise TypeError("tensors must be a dict of str -> torch.Tensor")
        frames.check_json(meta, "meta")
        with self._send_lock:
            message = frames.encode("run", {"id": self._op_id + 1, "op": op_name, "meta": meta}, tensors)
            with self._cond:
                if self.state != "ready":
                    raise self._not_ready("run()")
                self._op_id += 1
                op = self._op = _Op(self._op_id, op_name, timeout or self.timeouts.op)
                self.state = "running"
                self._quiet.clear()
            try:
                for w in self._workers:
                    w.send(message, max(5.0, self.timeouts.collective))
            except BaseException as e:
                err = self._fault_for(e, None)
                self._end_op(op)
                if err is e:
                    raise
                raise err from e
        try:
            return self._run(op, fn, tensors, meta)
        finally:
            self._end_op(op)

    def _run(self, op, fn, tensors, meta):
        ctx = self._ctx
        ctx.op_id, ctx.op_name, ctx.cancel_requested = op.id, op.name, lambda: op.cancel_at is not None
        outcome, out = "ok", None
        try:
            if ops.op_preflight(ctx, True, op.cancel_at is not None):
                raise ParallelCancelled(f"op {op.name!r} (id {op.id}) was cancelled before it started")
            out = fn(ctx, {k: v.to(ctx.device) for k, v in tensors.items()}, meta)
            if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], dict) and isinstance(out[1], dict)):
                raise TypeError(f"op {op.name!r} must return (tensors, meta) dicts, got {type(out).__name__}")
            frames.check_json(out[1], f"the meta op {op.name!r} returned")
        except ParallelCancelled:
            outcome = "cancelled"
        except PreflightMismatch as e:
            outcome = "mismatch"
            mismatch = e
        except BaseException as e:
            err = self._as_cancel(op, self._fault_for(e, op))
            if err is e:
                raise
            raise err from (err.__cause__ or e)
        finally:
            ctx.cancel_requested = None
            with self._cond:
                op.rank0_done = time.monotonic()
        missing = lambda: [w.rank for w in self._workers if w.rank not in op.replies]
        deadline = lambda: op.cancel_at + self.timeouts.cancel if op.cancel_at is not None else op.deadline
        try:
            self._wait(lambda: not missing(), deadline, missing, f"op {op.name!r} (id {op.id})")
        except ParallelGroupError as e:
            if op.cancel_at is None:
                raise
            raise self._as_cancel(op, e) from e
        statuses = {r: m["status"] for r, m in sorted(op.replies.items())}
        if any(s != outcome for s in statuses.values()):
            raise self._as_cancel(op, self._set_fault(ParallelGroupError(
                f"ranks left op {op.name!r} differently (rank 0 {outcome}, workers {statuses}); an op may stop only at "
                "ctx.cancelled() or ctx.preflight()", 0)))
        if outcome == "mismatch":
            raise mismatch
        if outcome == "cancelled" or op.cancel_at is not None:
            raise ParallelCancelled(f"op {op.name!r} (id {op.id}) was cancelled; the group is ready for the next op")
        metas = [out[1]] + [op.replies[r]["meta"] for r in sorted(op.replies)]
        return ops.OpResult(out[0], metas, op.id, time.monotonic() - op.started)

    def _end_op(self, op):
        with self._cond:
            self._op = None
            if self.state == "running":
                self.state = "ready"
            self._cond.notify_all()
        self._quiet.set()

    def _as_cancel(self, op, err):
        if op.cancel_at is None or not isinstance(err, ParallelGroupError):
            return err
        exc = ParallelCancelled(f"op {op.name!r} (id {op.id}) was cancelled, but the group broke on the way out: "
                                f"{err.reason}", group_broken=True)
        exc.__cause__ = err
        return exc

    def cancel(self):
        """Ask the op in flight to stop at its next agreement point; returns at once (True if one was in flight)."""
        with self._cond:
            op = self._op
            if op is None or op.cancel_at is not None:
                return op is not None
            op.cancel_at = time.monotonic()
        with self._send_lock:
            for w in self._workers:
                try:
                    w.send(frames.encode("cancel", {"id": op.id}), 1.0)
                except (OSError, TimeoutError):
                    pass  # the monitor reports a worker that cannot take it, or the cancel deadline does
        return True

    def ensure_started(self):
        """Ready the group again after a fault or close(), with the arguments of the last start()."""
        if self.state != "ready":
            self.close()
            devices, imports, local_state, env = self._start_args
            self.start(devices, imports, local_state=local_state, env=env)
        return self

    def _not_ready(self, what):
        if self.state == "broken" and self.error is not None:
            return self.error.again()
        return ParallelStateError(f"{what} needs a ready group; group {self.name!r} is {self.state}"
                                  + ("; call start() first" if self.state in ("idle", "closed") else ""), self.state)

    def _set_fault(self, err):
        """Keep the first fault, mark the group broken, kill every worker. -> the fault kept."""
        with self._cond:
            if self.error is None and self.state not in ("closing", "closed"):
                self.error = err
                w = next((w for w in self._workers if w.rank == err.rank), None)
                logger.error("parallel group %r broken: %s%s", self.name, err,
                             f"\nlast lines of rank {w.rank}'s log:\n{w.log_tail()}" if w is not None else "")
                if isinstance(err, ParallelOpError) and err.remote_traceback:
                    logger.error("traceback on rank %s:\n%s", err.rank, err.remote_traceback)
            if self.state in ("starting", "ready", "running"):
                self.state = "broken"
            self._cond.notify_all()
            kept = self.error or err
        for w in self._workers:
            w.signal(signal.SIGKILL)
        return kept

    def _fault_for(self, exc, op):
        """What to raise for ``exc`` raised on rank 0; the group is broken either way. A failure inside a
        collective is usually a peer's death or hang, which the monitor names (within SETTLE)."""
        # the finished frames of a failed collective hold its process group, and gloo keeps a group's
        # sockets open while anything references it: clear their locals (the traceback text stays)
        for e in filter(None, (exc, exc.__cause__, exc.__context__)):
            traceback.clear_frames(e.__traceback__)
        if isinstance(exc, ParallelGroupError):
            return self._set_fault(exc)
        if isinstance(exc, ParallelStateError) and self.state == "closing":
            return exc
        if not isinstance(exc, Exception):
            self._set_fault(ParallelGroupError(f"rank 0 was interrupted ({type(exc).__name__})", 0))
            return exc
        if ops.in_collective(exc) or isinstance(exc, (OSError, TimeoutError)):
            with self._cond:
                if op is not None:
                    op.rank0_error, op.failed_at = exc, op.failed_at or time.monotonic()
                self._cond.wait_for(lambda: self.error is not None, timeout=SETTLE + 1.0)
                if self.error is not None:
                    return self.error
        what = f"op {op.name!r} (id {op.id})" if op is not None else "start-up"
        return self._set_fault(ParallelOpError(
            f"{what} raised {type(exc).__name__} on rank 0: {str(exc)[:120]}", 0,
            remote_traceback="".join(traceback.format_exception(exc)),
            hint="fix the op or its inputs, then " + RESTART_HINT))

    def _late(self, ranks, what):
        """Workers ``ranks`` {what}: their stacks go to their logs, then they die."""
        with self._cond:
            if self.error is not None:
                return self.error
            late = [w for w in self._workers if w.rank in ranks]
            dumping = [w for w in late if w.phase != "spawned" and not w.exited]
            for w in dumping:  # SIGUSR1 kills a worker that has not installed its stack dump yet ("booted")
                w.signal(signal.SIGUSR1)
        if dumping:
            time.sleep(0.3)
        first = late[0] if late else None
        return self._set_fault(ParallelTimeout(
            f"worker rank(s) {sorted(ranks)} {what}; killed, stacks in their logs", first and first.rank,
            log_path=first and first.log_path))

    def _watch(self, stop):
        try:
            while not stop.is_set():
                workers = [w for w in self._workers if not w.exited]
                fds = [w.pidfd for w in workers] + [w.reply_fd for w in workers if not w.eof]
                ready = select.select(fds, [], [], POLL)[0]
                for w in workers:
                    if w.reply_fd in ready:
                        self._read_replies(w)
                    if w.pidfd in ready:
                        self._on_exit(w)
                self._check_workers()
        except Exception as e:
            logger.exception("the monitor of parallel group %r failed", self.name)
            self._set_fault(ParallelGroupError(f"rank 0's monitor thread failed: {e!r}", 0))

    def _read_replies(self, w):
        try:
            data = os.read(w.reply_fd, 1 << 16)
            w.eof = not data  # its exit follows (pidfd)
            w.buf += data
            replies = frames.split(w.buf)
        except (OSError, ValueError) as e:
            return self._set_fault(ParallelGroupError(f"worker rank {w.rank} sent a bad reply ({e})", w.rank, log_path=w.log_path))
        with self._cond:
            for kind, body in replies:
                op = self._op
                if kind == "result" and op is not None and body.get("id") == op.id:
                    op.replies[w.rank] = body
                    if body["status"] == "error" and body.get("in_collective"):
                        op.failed_at = op.failed_at or time.monotonic()
                    elif body["status"] == "error":
                        e = body["error"]
                        self._set_fault(ParallelOpError(
                            f"op {op.name!r} (id {op.id}) raised {e['type']} on worker rank {w.rank}: {e['message'][:120]}",
                            w.rank, log_path=w.log_path, remote_traceback=e["traceback"],
                            hint="fix the op or its inputs, then " + RESTART_HINT))
                elif kind in ("booted", "connected", "ready") and kind not in w.inbox:
                    w.phase, w.inbox[kind] = kind, body
                else:
                    self._set_fault(ParallelGroupError(f"worker rank {w.rank} sent an unexpected {kind!r}", w.rank, log_path=w.log_path))
            self._cond.notify_all()

    def _on_exit(self, w):
        code = w.proc.wait()
        if code > 0:
            # a worker that failed because a peer was killed exits about when that peer is reaped: name the peer
            killed = lambda: next((v for v in self._workers if not v.exited and (v.proc.poll() or 0) < 0), None)
            if killed() is None:
                _wait_all([v for v in self._workers if v is not w and not v.exited], 0.5)
            if killed() is not None:
                self._on_exit(killed())
        w.exited = True
        with self._cond:
            op = self._op
            when = (f"during start-up (after {w.phase!r})" if w.phase != "ready" else
                    f"during op {op.name!r} (id {op.id})" if op is not None and w.rank not in op.replies else "while idle")
        self._set_fault(ParallelGroupError(f"worker rank {w.rank} (pid {w.pid}, {w.device}) {describe_exit(code)} {when}",
                                           w.rank, code, w.log_path))

    def _check_workers(self):
        now = time.monotonic()
        for w in self._workers:
            w.stopped_since = None if w.exited or not w.is_stopped() else w.stopped_since or now
            if w.stopped_since is not None and now - w.stopped_since > self.timeouts.stopped:
                self._set_fault(ParallelGroupError(
                    f"worker rank {w.rank} (pid {w.pid}, {w.device}) stayed stopped (SIGSTOP?) for more than "
                    f"{self.timeouts.stopped:g}s and was killed", w.rank, log_path=w.log_path,
                    hint="find what stopped it (a debugger, job control), then " + RESTART_HINT))
        with self._cond:
            op = self._op
            if op is None or self.error is not None:
                return
            missing = [w.rank for w in self._workers if w.rank not in op.replies]
            if op.failed_at is not None:
                # someone failed inside a collective: the rank that never got there is at fault
                if missing and now > op.failed_at + SETTLE and (op.rank0_done is not None or op.rank0_error is not None):
                    self._late(missing, f"did not reach a collective of op {op.name!r} its peers waited in")
                elif not missing and (op.rank0_done is not None or now > op.failed_at + SETTLE):
                    rank0 = op.rank0_error is not None or op.rank0_done is None
                    self._set_fault(ParallelTimeout(
                        f"{'rank 0' if rank0 else 'the workers'} did not reach a collective of op {op.name!r} in "
                        f"{self.timeouts.collective:g}s (Timeouts.collective)", 0 if rank0 else None))
                return
            if not missing:
                return
            if op.cancel_at is not None and now > op.cancel_at + self.timeouts.cancel:
                self._late(missing, f"did not acknowledge cancel of op {op.name!r} (id {op.id}) within {self.timeouts.cancel:g}s")
            elif now > op.deadline:
                self._late(missing, f"did not finish op {op.name!r} (id {op.id}) within its {op.timeout:g}s timeout")
            elif op.rank0_done is not None and now > op.rank0_done + self.timeouts.collective + SETTLE:
                self._late(missing, f"did not finish op {op.name!r} (id {op.id}) within {self.timeouts.collective:g}s "
                                       "of rank 0 (Timeouts.collective)")

    def close(self, grace=None):
        """Stop every worker (gracefully when idle), destroy the process groups, remove the private folder.
        Idempotent; safe after any fault; also runs at interpreter exit. ``grace``: how long a start() or
        run() in flight on another thread gets to return once its workers are killed."""
        with self._cond:
            state = self.state
            if state in ("idle", "closed"):
                self.state = "closed"
                return
            if state == "closing":
                return self._cond.wait_for(lambda: self.state == "closed", timeout=self.timeouts.close + 30)
            self.state = "closing"
        if state in ("starting", "running"):
            for w in self._workers:
                w.signal(signal.SIGKILL)
            if not self._quiet.wait(self.timeouts.collective + SETTLE + 2 if grace is None else grace):
                logger.error("parallel group %r: the thread in %s did not return; tearing down under it", self.name, state)
        self._teardown(graceful=state == "ready")
        with self._cond:
            self.state = "closed"
            self._cond.notify_all()

    def _teardown(self, graceful):
        workers = self._workers
        if graceful:
            with self._send_lock:
                for w in workers:
                    try:
                        w.send(frames.encode("shutdown", {}), 1.0)
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
        if self._groups is not None:
            ops.destroy_groups(*self._groups, abort=not graceful)
            self._groups = None
        if self._ctx is not None:
            self._ctx.data_group = self._ctx.control_group = None
            self._ctx = None
        with self._send_lock:
            for w in workers:
                w.close_fds()
            self._workers = []
        if self._folder is not None:
            # after a fault the logs stay for the person reading the error; the store goes either way
            if self.error is None or self._log_root is not None:
                shutil.rmtree(self._folder, ignore_errors=True)
            elif os.path.exists(os.path.join(self._folder, "store")):
                os.remove(os.path.join(self._folder, "store"))
            self._folder = None


def _wait_all(workers, timeout):
    end = time.monotonic() + timeout
    while any(w.proc.poll() is None for w in workers) and time.monotonic() < end:
        time.sleep(0.02)


def _check_devices(devices):
    """-> torch devices, all 'cpu' or all distinct 'cuda:<i>' that exist; ValueError before anything starts."""
    parsed = [torch.device(d) for d in devices]
    kinds, indices = {d.type for d in parsed}, [d.index for d in parsed]
    if len(parsed) < 2 or len(kinds) != 1 or not kinds <= {"cpu", "cuda"}:
        raise ValueError(f"a parallel group needs 2 or more devices, all 'cpu' or all 'cuda:<index>'; got {list(devices)}")
    if kinds == {"cuda"} and (None in indices or len(set(indices)) != len(indices)):
        raise ValueError(f"name each CUDA device once with its index (cuda:0, cuda:1, ...); got {list(devices)}")
    if kinds == {"cuda"} and max(indices) >= torch.cuda.device_count():
        found = torch.cuda.device_count()
        raise ValueError(f"devices {', '.join(map(str, parsed))} were asked for, but this machine has {found} CUDA "
                         f"device(s) ({', '.join(f'cuda:{i}' for i in range(found)) or 'none'}); list only those")
    return parsed


def _refuse_changed_sources():
    """Workers import rank 0's modules from disk: refuse if a module's file changed since rank 0 first saw
    it (when comfy.parallel was imported, or when a start() imported it), as rank 0 runs the old code."""
    roots = tuple({sys.prefix, sys.base_prefix, sys.exec_prefix})
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if path and os.path.isabs(path) and path.endswith(".py") and not path.startswith(roots):
            st = os.stat(path) if os.path.exists(path) else None
            now = st and (st.st_mtime_ns, st.st_size)
            if _sources.setdefault(path, now) != now:
                raise ParallelError(f"{path} changed after rank 0 imported it, so workers would run other code than "
                                    "rank 0; restart ComfyUI to run the new code")


_sources = {}
_refuse_changed_sources()


def _comfyui_args():
    """Rank 0's whole ``comfy.cli_args.args`` as JSON (enums by class name and value, sets as lists)."""
    def encode(v):
        if isinstance(v, enum.Enum):
            return {"enum": type(v).__name__, "value": v.value}
        if isinstance(v, (set, frozenset)):
            return {"set": sorted((encode(x) for x in v), key=json.dumps)}
        return v
    return {k: encode(v) for k, v in vars(comfy.cli_args.args).items()}


def _worker_env(device, extra):
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONUNBUFFERED="1",
               GLOO_SOCKET_IFNAME="lo", NCCL_SOCKET_IFNAME="lo")
    # cuda:<i> is the i-th device this process sees, itself perhaps a subset
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()] or None
    env["CUDA_VISIBLE_DEVICES"] = "" if device.type == "cpu" else visible[device.index] if visible else str(device.index)
    return env | (extra or {})


def _close_all_at_exit():
    # an op in flight on ComfyUI's prompt thread (a daemon) ends with the interpreter: kill its workers
    for group in list(_live):
        group.close(grace=1.0)


atexit.register(_close_all_at_exit)
