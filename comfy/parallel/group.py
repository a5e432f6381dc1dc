"""``ParallelGroup``: rank 0's owner of the worker processes and process groups of one loaded model.

Lifecycle (``group.state``)::

    idle --start()--> starting --> ready --run()--> running --> ready ...
    starting | ready | running --fault--> broken --close()--> closing --> closed --start()--> starting
    any --close()--> closing --> closed                  (close() is idempotent)

Rank 0 is this process on ``devices[0]``; rank r >= 1 is a worker process on ``devices[r]``.

Why per-worker OS pipes for control, and not multiprocessing or a socket:
* nothing is pickled: frames are JSON + HMAC (``protocol.py``), spawned with ``subprocess``, so a
  worker can be handed no Python object at all;
* a worker idles on a blocking pipe read, not inside a collective, so waiting for work any length
  of time never trips a gloo/NCCL timeout;
* when rank 0 dies the pipe reaches EOF and the worker exits; no orphan keeps a GPU;
* the pipes are private to the two processes (no port another local user could reach), and the
  token that signs every frame is written into the pipe, never into argv or the environment.
The HMAC still matters: it rejects a frame written by anything but this group's rank 0 (a stray
fd, an injected write) and keeps the framing safe to move onto a socket for multi-host use.

Control messages go over the pipes; tensors go over the data process group (NCCL for CUDA, gloo
for CPU); small agreements (preflight, cancel) over a gloo control group.

Faults: a monitor thread reads every worker's replies and watches their processes. A worker that
exits, sends a bad frame, raises inside an op or misses a deadline makes the group ``broken``: the
monitor records one ``ParallelGroupError`` (rank, exit code, log tail) and kills every worker, which
also unblocks a rank-0 collective waiting on them. ``run()`` and ``start()`` then raise that error.
A broken group is not repaired in place: ``close()`` then ``start()`` (``ensure_started()``).

Bounds (Timeouts in ``config.py``): a worker that dies is reported within about a second (EOF on
its pipe or its reaped exit; the monitor polls every 0.1 s) except during the process-group
rendezvous itself, which only ``Timeouts.rendezvous`` ends; a missed start-up, op or cancel
deadline is reported within about half a second of passing. Rank 0's own op code runs in the
calling thread and cannot be pre-empted: a deadline ends the collectives it waits in (by killing
the workers), not pure computation on rank 0.
"""

import atexit
import dataclasses
import importlib
import logging
import os
import secrets
import shutil
import signal
import tempfile
import threading
import time
import traceback
import weakref

import torch
import torch.distributed as dist

from . import comm, ops, pg
from .config import Timeouts, loopback_ifname, parse_devices, validate_worker_spec, worker_env
from .errors import ParallelGroupError, ParallelStateError
from .monitor import Monitor
from .protocol import DEFAULT_LIMITS
from .procs import WorkerProcess
from .runner import OpRunner

logger = logging.getLogger(__name__)

_live = weakref.WeakSet()

ACTIVE_STATES = ("starting", "ready", "running")
# at interpreter exit, how long close() waits for the thread of an op in flight after killing the workers
EXIT_GRACE = 1.0


class ParallelGroup:
    """Owns the workers, process groups and rendezvous store of one model; see the module docstring.

    ``log_dir``: where per-rank logs go (``rank{r}-gen{g}.log``; g grows with every start, so a
    respawn never overwrites); never deleted. When None, each start logs into a folder of its own
    under ComfyUI's temp directory (the system's outside ComfyUI), which ``close()`` removes unless
    the group broke: then it stays, and the error names it.
    """

    def __init__(self, name="parallel", log_dir=None, timeouts=None, limits=None):
        self.name = name
        self.timeouts = timeouts or Timeouts()
        self.limits = limits or DEFAULT_LIMITS
        self._log_root = log_dir
        self._log_dir = log_dir
        self._own_log_dir = None
        self._cond = threading.Condition(threading.RLock())
        self._send_lock = threading.Lock()
        self._state = "idle"
        self._error = None
        self._workers = []
        self._devices = []
        self._backend = None
        self._generation = 0
        self._start_args = None
        self._store = None
        self._store_dir = None
        self._pg_owned = False
        self._control_group = None
        self._monitor = None
        self._runner = None
        self._idle = threading.Event()
        self._idle.set()
        self._env_set = []
        self.startup_seconds = {}
        self.setup_metas = []
        _live.add(self)

    # -- introspection ------------------------------------------------------------------------

    @property
    def state(self):
        return self._state

    @property
    def error(self):
        """The fault that broke the group, or None."""
        return self._error

    @property
    def world_size(self):
        return len(self._devices)

    @property
    def log_dir(self):
        return self._log_dir

    def worker_pids(self):
        return {w.rank: w.pid for w in self._workers if w.poll() is None}

    def log_paths(self):
        return {w.rank: w.log_path for w in self._workers}

    def __repr__(self):
        return f"ParallelGroup({self.name!r}, state={self._state}, devices={self._devices})"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self, devices, worker_spec, *, local_state=None, env=None):
        """Spawn one worker per ``devices[1:]``, rendezvous, probe, run each worker's setup; state -> ready.

        ``worker_spec``: ``{"imports": [...], "setup": "module:function" | None, "setup_args": {...}}``
        (JSON only); the imports run here too (rank 0 runs every op), setup on workers only.
        ``local_state`` becomes rank 0's ``ctx.state``; ``env`` adds to the workers' environment.
        Raises ``ParallelGroupError`` (rank, exit code, log tail) if a worker fails or the start-up
        deadline passes; the group is then ``broken`` with everything already torn down.
        """
        devices, kind = parse_devices(devices)
        spec = validate_worker_spec(worker_spec)
        envs = {r: worker_env(d, kind, env) for r, d in enumerate(devices) if r > 0}
        # rank 0 runs every op too, so it registers the same ops; an import error surfaces here, before any spawn
        for module in spec["imports"]:
            importlib.import_module(module)
        with self._cond:
            if self._state not in ("idle", "closed"):
                raise ParallelStateError(f"start() needs state idle or closed; group {self.name!r} is {self._state}"
                                         + ("; call close() first" if self._state != "closing" else ""), self._state)
            pg.claim(self)
            self._state, self._error = "starting", None
            self._devices, self._backend = devices, "nccl" if kind == "cuda" else "gloo"
            self._start_args = {"devices": devices, "worker_spec": spec, "local_state": local_state, "env": env}
            self._idle.clear()
        try:
            self._start(spec, envs, local_state)
        except BaseException as exc:
            if self._state == "closing":
                err = exc
            else:
                err = self._attribute(exc, lambda e=exc: ParallelGroupError(
                    f"start-up of group {self.name!r} failed on rank 0: {type(e).__name__}: {e}", rank=0))
            self._teardown(graceful=False)
            with self._cond:
                if self._state != "closing":
                    self._state = "broken"
                    if not isinstance(self._error, ParallelGroupError):
                        self._error = ParallelGroupError(f"start-up was interrupted: {exc!r}", rank=0,
                                                         log_dir=self._log_dir)
                self._cond.notify_all()
            _drop_frame_locals(exc)
            if err is exc:
                raise
            raise err from exc
        finally:
            self._idle.set()

    def _start(self, spec, envs, local_state):
        t0 = time.monotonic()
        deadline = t0 + self.timeouts.startup
        token = secrets.token_bytes(32)
        self._generation = self._next_generation()
        # a fresh store file per start, in a folder only this user can enter
        self._store_dir = tempfile.mkdtemp(prefix=f"comfy-parallel-{self.name}-rendezvous-", dir=_temp_root(create=True))
        store_path = os.path.join(self._store_dir, "store")
        self._store = pg.file_store(store_path, len(self._devices), self.timeouts.startup)
        self._monitor = Monitor(self)
        world = len(self._devices)
        for r in range(1, world):
            path = os.path.join(self._log_dir, f"rank{r}-gen{self._generation}.log")
            w = WorkerProcess.spawn(r, self._devices[r], path, envs[r], token, self.limits)
            self._workers.append(w)
            w.send_token(timeout=10.0)
            w.send("hello", 0, {"rank": r, "world_size": world, "device": "cuda:0" if self._backend == "nccl" else "cpu",
                                "backend": self._backend, "store_path": store_path, "spec": spec,
                                "timeouts": self.timeouts.to_json(), "limits": dataclasses.asdict(self.limits)}, timeout=10.0)
        self._monitor.start()
        connected = self._monitor.wait_replies("connected", range(1, world), deadline, "start-up (spawn and imports)")
        t1 = time.monotonic()
        for r, msg in connected.items():
            if msg.body.get("torch") != torch.__version__:
                raise ParallelGroupError(f"worker rank {r} runs torch {msg.body.get('torch')} but rank 0 runs {torch.__version__}; "
                                         "workers import what sys.path points at: make both use one environment", rank=r)
        self._pin_loopback()
        device = torch.device(self._devices[0])
        self._pg_owned = True
        self._control_group = pg.init_groups(self._backend, self._store, 0, world, device, self.timeouts.to_json())
        t2 = time.monotonic()
        try:
            comm.probe(0, world, device, dist.group.WORLD, self._control_group)
        except Exception as e:
            raise ParallelGroupError(
                f"start-up probe (all_reduce + all_to_all over the {self._backend} data group, all_reduce over the gloo "
                f"control group) failed on rank 0: {e}", rank=0,
                hint=f"check that the loopback interface '{loopback_ifname()}' is up and not firewalled (GLOO_SOCKET_IFNAME/"
                     "NCCL_SOCKET_IFNAME are pinned to it); for CUDA that every device is healthy and visible, and try "
                     "NCCL_P2P_DISABLE=1 or NCCL_SHM_DISABLE=1 (set NCCL_DEBUG=INFO via env= to see why in the worker logs)") from e
        t3 = time.monotonic()
        ready = self._monitor.wait_replies("ready", range(1, world), deadline, "start-up (probe and setup)")
        self._runner = OpRunner(self, ops.OpContext(0, world, device, dist.group.WORLD, self._control_group,
                                                    state=local_state if local_state is not None else {}))
        self.setup_metas = [None] + [ready[r].body.get("meta") for r in range(1, world)]
        t4 = time.monotonic()
        self.startup_seconds = {"spawn_and_import": t1 - t0, "rendezvous": t2 - t1, "probe": t3 - t2,
                                "setup": t4 - t3, "total": t4 - t0}
        with self._cond:
            if self._error is not None:
                raise self._error
            self._state = "ready"
        logger.info("parallel group %r ready: %d ranks on %s in %.2fs (logs in %s)", self.name, world, self._devices,
                    t4 - t0, self._log_dir)

    def run(self, op_name, tensors=None, meta=None, timeout=None):
        """Run op ``op_name`` on every rank; see ``runner.OpRunner.run``."""
        with self._cond:
            runner = self._runner
            if self._state != "ready" or runner is None:
                raise self._not_ready("run()")
        try:
            return runner.run(op_name, tensors or {}, meta or {}, timeout or self.timeouts.op)
        except BaseException as e:
            if self._state != "ready":
                _drop_frame_locals(e)
            raise

    def cancel(self):
        """Ask the op in flight to stop; returns at once (True if an op was in flight). Thread-safe."""
        runner = self._runner
        return runner.cancel() if runner is not None else False

    def ensure_started(self):
        """Ready the group again after a fault or close(), with the arguments of the last start()."""
        with self._cond:
            state = self._state
        if state == "ready":
            return self
        if self._start_args is None:
            raise ParallelStateError(f"group {self.name!r} was never started; call start(devices, worker_spec) first", state)
        if state == "broken":
            self.close()
        self.start(**self._start_args)
        return self

    def close(self):
        """Stop every worker (graceful when idle, SIGTERM then SIGKILL otherwise), destroy the process groups,
        close the store. Idempotent; also runs at interpreter exit and is safe after any fault."""
        self._close(self.timeouts.rendezvous + self.timeouts.close)

    def _close(self, caller_grace):
        """close(); waits up to ``caller_grace`` s for a start() or run() in flight on another thread to return."""
        with self._cond:
            state = self._state
            if state in ("idle", "closed"):
                self._state = "closed"
                return
            if state == "closing":
                self._cond.wait_for(lambda: self._state == "closed", timeout=self.timeouts.close + 30)
                return
            self._state = "closing"
            self._cond.notify_all()
        if state in ("starting", "running"):
            # start() or run() is in flight on another thread: killing its peers unblocks any collective
            # it waits in (a process-group rendezvous only ends with Timeouts.rendezvous)
            self._kill_workers()
            if not self._idle.wait(caller_grace):
                logger.error("group %r: the thread in %s() did not return; tearing down under it", self.name, state)
        self._teardown(graceful=state == "ready")
        self._release_log_dir()
        with self._cond:
            self._state = "closed"
            self._cond.notify_all()

    # -- internals shared with monitor.py and runner.py -------------------------------------------

    def _not_ready(self, what):
        if self._state == "broken" and self._error is not None:
            return self._error.again()
        if self._state == "running":
            return ParallelStateError(f"{what}: group {self.name!r} is already running an op; it runs one op at a time", self._state)
        return ParallelStateError(f"{what} needs a ready group; group {self.name!r} is {self._state}"
                                  + ("; call start() first" if self._state in ("idle", "closed") else ""), self._state)

    def _record_fault(self, err):
        """Keep the first fault, mark the group broken, kill every worker. Returns the recorded fault."""
        with self._cond:
            if self._state in ("closing", "closed"):
                return self._error or err
            if self._error is None:
                self._error = err.with_log_dir(self._log_dir)
                logger.error("parallel group %r broken: %s", self.name, err.reason)
            if self._state in ACTIVE_STATES:
                self._state = "broken"
            self._cond.notify_all()
            recorded = self._error
        self._kill_workers()
        return recorded

    def _attribute(self, exc, make_error, grace=0.5):
        """What to raise for ``exc`` raised on rank 0; the group is broken either way.

        A worker's fault recorded within ``grace`` seconds wins: a peer's death usually reaches rank 0
        as a transport error before the monitor has reaped it. A KeyboardInterrupt or SystemExit is
        returned as it is (after the workers are stopped), anything else becomes ``make_error()``.
        """
        if isinstance(exc, ParallelGroupError):
            return self._record_fault(exc)
        if isinstance(exc, Exception):
            with self._cond:
                self._cond.wait_for(lambda: self._error is not None, timeout=grace)
                if self._error is not None:
                    return self._error
            return self._record_fault(make_error())
        self._record_fault(ParallelGroupError(f"rank 0 was interrupted ({type(exc).__name__})", rank=0))
        return exc

    def _kill_workers(self):
        for w in list(self._workers):
            w.kill()

    def _teardown(self, graceful):
        workers = list(self._workers)
        if graceful:
            with self._send_lock:
                for w in workers:
                    try:
                        w.send("shutdown", 0, {}, timeout=1.0)
                    except (OSError, TimeoutError, ValueError):
                        w.kill()
            _wait_all(workers, self.timeouts.close)
        for sig, wait in ((signal.SIGTERM, 1.0), (signal.SIGKILL, 5.0)):
            alive = [w for w in workers if w.poll() is None]
            for w in alive:
                w.signal(sig)
            _wait_all(alive, wait)
        for w in workers:
            if w.poll() is None:
                logger.error("worker rank %d (pid %d) survived SIGKILL (uninterruptible sleep?); it is left behind", w.rank, w.pid)
        if self._monitor is not None:
            self._monitor.stop()
            self._monitor = None
        if self._pg_owned:
            pg.destroy_groups(abort=not graceful)
            self._pg_owned = False
        with self._send_lock:
            for w in workers:
                w.close_fds()
            self._workers = []
        if self._runner is not None:
            # an op may have kept ctx (or a caller the error that references it); the groups go regardless
            self._runner.ctx.data_group = self._runner.ctx.control_group = None
        self._control_group = None
        self._store = None
        if self._store_dir is not None:
            shutil.rmtree(self._store_dir, ignore_errors=True)
            self._store_dir = None
        self._runner = None
        self._unpin_loopback()
        pg.release(self)

    def _pin_loopback(self):
        """Single host: gloo and NCCL talk over loopback only, as the workers do (read when groups are created)."""
        lo = loopback_ifname()
        for key in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            self._env_set.append((key, os.environ.get(key)))
            os.environ[key] = lo

    def _unpin_loopback(self):
        for key, old in reversed(self._env_set):
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old
        self._env_set = []

    def _next_generation(self):
        if self._log_root is None and self._own_log_dir is None:
            self._own_log_dir = self._log_dir = tempfile.mkdtemp(prefix=f"comfy-parallel-{self.name}-", dir=_temp_root(create=True))
        os.makedirs(self._log_dir, exist_ok=True)
        gens = [0]
        for f in os.listdir(self._log_dir):
            head, _, tail = f.partition("-gen")
            if head.startswith("rank") and tail.endswith(".log") and tail[:-4].isdigit():
                gens.append(int(tail[:-4]))
        return max(max(gens), self._generation) + 1

    def _release_log_dir(self):
        """After close(): remove the folder this group made for its logs, unless a fault needs them
        (its error names the folder); either way the next start makes a new one."""
        own, self._own_log_dir = self._own_log_dir, None
        if own is None or self._error is not None:
            return
        shutil.rmtree(own, ignore_errors=True)
        if self._log_dir == own:
            self._log_dir = None


def _temp_root(create=False):
    """ComfyUI's temp directory when ComfyUI is importable (it empties it at start-up), else the system's."""
    try:
        import folder_paths
    except ImportError:
        root = tempfile.gettempdir()
    else:
        root = folder_paths.get_temp_directory()
    if create:
        os.makedirs(root, exist_ok=True)
    return root


def _drop_frame_locals(exc):
    """Clear the locals of the finished frames in ``exc``'s traceback chain. They hold the process
    groups the failed collectives ran on, and a gloo group keeps its sockets open for as long as
    anything references it; the traceback text stays."""
    todo, seen = [exc], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        todo += [e.__cause__, e.__context__]


def _wait_all(workers, timeout):
    deadline = time.monotonic() + timeout
    for w in workers:
        w.wait(max(0.0, deadline - time.monotonic()))


def _close_all_at_exit():
    # the thread of an op in flight (ComfyUI's prompt thread is a daemon) ends with the interpreter:
    # kill the workers and tear down without waiting out its deadline
    for group in list(_live):
        try:
            group._close(caller_grace=EXIT_GRACE)
        except Exception:
            logger.exception("closing parallel group %r at exit failed", group.name)


# threading's exit hooks run before non-daemon threads are joined (atexit's only after), so an op in
# flight on such a thread is ended here rather than waited for (concurrent.futures does the same)
getattr(threading, "_register_atexit", atexit.register)(_close_all_at_exit)

