"""``ParallelGroup``: rank 0's owner of the worker processes and process groups of one loaded model.

Rank 0 is this process on ``devices[0]``; rank r >= 1 is a worker process on ``devices[r]``. The
lifecycle is ``state.GroupState``; ops run through ``runner.py``, faults are found by ``monitor.py``.
"""

import atexit
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

from . import collectives, process_groups, registry
from .config import Timeouts, loopback_ifname, parse_devices, validate_worker_spec, worker_env
from .errors import ParallelGroupError, ParallelStateError
from .monitor import Monitor
from .runner import OpRunner
from .state import GroupCore, GroupState
from .worker_process import WorkerProcess

logger = logging.getLogger(__name__)

_live = weakref.WeakSet()

# at interpreter exit, how long close() waits for the thread of an op in flight after killing the workers
EXIT_GRACE = 1.0


class ParallelGroup:
    """Owns the workers, process groups and rendezvous store of one model.

    A worker that exits, sends a bad frame, raises in an op, stays stopped or misses a deadline
    breaks the group: every worker is killed and ``start()``/``run()`` raise one ``ParallelGroupError``
    (rank, exit code, log tail). A broken group is not repaired in place: ``close()`` then ``start()``
    (``ensure_started()``). Rank 0's own op code runs in the calling thread: a deadline ends the
    collectives it waits in (by killing the workers), not pure computation on rank 0.

    ``log_dir``: where per-rank logs go (``rank{r}-gen{g}.log``; g grows with every start, so a
    respawn never overwrites); never deleted. When None, each start logs into a folder of its own
    under ComfyUI's temp directory (the system's outside ComfyUI), which ``close()`` removes unless
    the group broke: then it stays, and the error names it.
    """

    def __init__(self, name="parallel", log_dir=None, timeouts=None):
        self.name = name
        self.timeouts = timeouts or Timeouts()
        self._core = GroupCore(name, self.timeouts)
        self._core.log_dir = log_dir
        self._log_root = log_dir
        self._own_log_dir = None
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
        self._env_set = []
        self.startup_seconds = {}
        self.setup_metas = []
        _live.add(self)

    @property
    def state(self):
        return self._core.state

    @property
    def error(self):
        """The fault that broke the group, or None."""
        return self._core.error

    @property
    def world_size(self):
        return len(self._devices)

    @property
    def log_dir(self):
        return self._core.log_dir

    def worker_pids(self):
        return {w.rank: w.pid for w in self._core.workers if w.poll() is None}

    def __repr__(self):
        return f"ParallelGroup({self.name!r}, state={self.state}, devices={self._devices})"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

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
        core = self._core
        with core.cond:
            if core.state not in (GroupState.IDLE, GroupState.CLOSED):
                raise ParallelStateError(f"start() needs state idle or closed; group {self.name!r} is {core.state}"
                                         + ("; call close() first" if core.state != GroupState.CLOSING else ""), core.state)
            process_groups.claim(self)
            core.set_state(GroupState.STARTING)
            core.quiet.clear()
            self._devices, self._backend = devices, "nccl" if kind == "cuda" else "gloo"
            self._start_args = {"devices": devices, "worker_spec": spec, "local_state": local_state, "env": env}
        try:
            self._start(spec, envs, local_state)
        except BaseException as exc:
            err = exc if core.state == GroupState.CLOSING else core.attribute(exc, lambda e=exc: ParallelGroupError(
                f"start-up of group {self.name!r} failed on rank 0: {type(e).__name__}: {e}", rank=0))
            self._teardown(graceful=False)
            # the fault already kept stays (a close() in between leaves the group closing)
            core.fault(ParallelGroupError(f"start-up was interrupted: {exc!r}", rank=0))
            _drop_frame_locals(exc)
            if err is exc:
                raise
            raise err from exc
        finally:
            core.quiet.set()

    def _start(self, spec, envs, local_state):
        core = self._core
        t0 = time.monotonic()
        deadline = t0 + self.timeouts.startup
        token = secrets.token_bytes(32)
        self._generation = self._next_generation()
        # a fresh store file per start, in a folder only this user can enter
        self._store_dir = tempfile.mkdtemp(prefix=f"comfy-parallel-{self.name}-rendezvous-", dir=_temp_root(create=True))
        store_path = os.path.join(self._store_dir, "store")
        self._store = process_groups.file_store(store_path, len(self._devices), self.timeouts.startup)
        self._monitor = Monitor(core)
        world = len(self._devices)
        for r in range(1, world):
            path = os.path.join(core.log_dir, f"rank{r}-gen{self._generation}.log")
            w = WorkerProcess.spawn(r, self._devices[r], path, envs[r], token)
            core.workers.append(w)
            w.send_token(timeout=10.0)
            w.send("hello", 0, {"rank": r, "world_size": world, "device": "cuda:0" if self._backend == "nccl" else "cpu",
                                "backend": self._backend, "store_path": store_path, "spec": spec,
                                "timeouts": self.timeouts.to_json()}, timeout=10.0)
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
        self._control_group = process_groups.init_groups(self._backend, self._store, 0, world, device, self.timeouts.to_json())
        t2 = time.monotonic()
        try:
            collectives.probe(0, world, device, dist.group.WORLD, self._control_group)
        except Exception as e:
            raise ParallelGroupError(
                f"start-up probe (all_reduce + all_to_all over the {self._backend} data group, all_reduce over the gloo "
                f"control group) failed on rank 0: {e}", rank=0,
                hint=f"check that the loopback interface '{loopback_ifname()}' is up and not firewalled (GLOO_SOCKET_IFNAME/"
                     "NCCL_SOCKET_IFNAME are pinned to it); for CUDA that every device is healthy and visible, and try "
                     "NCCL_P2P_DISABLE=1 or NCCL_SHM_DISABLE=1 (set NCCL_DEBUG=INFO via env= to see why in the worker logs)") from e
        t3 = time.monotonic()
        ready = self._monitor.wait_replies("ready", range(1, world), deadline, "start-up (probe and setup)")
        ctx = registry.OpContext(0, world, device, dist.group.WORLD, self._control_group,
                                 state=local_state if local_state is not None else {})
        self._runner = OpRunner(core, self._monitor, ctx)
        self.setup_metas = [None] + [ready[r].body.get("meta") for r in range(1, world)]
        t4 = time.monotonic()
        self.startup_seconds = {"spawn_and_import": t1 - t0, "rendezvous": t2 - t1, "probe": t3 - t2,
                                "setup": t4 - t3, "total": t4 - t0}
        with core.cond:
            if core.error is not None:
                raise core.error
            core.set_state(GroupState.READY)
        logger.info("parallel group %r ready: %d ranks on %s in %.2fs (logs in %s)", self.name, world, self._devices,
                    t4 - t0, core.log_dir)

    def run(self, op_name, tensors=None, meta=None, timeout=None):
        """Run op ``op_name`` on every rank; see ``runner.OpRunner``."""
        with self._core.cond:
            runner = self._runner
            if self._core.state != GroupState.READY or runner is None:
                raise self._core.not_ready("run()")
        try:
            return runner.run(op_name, tensors or {}, meta or {}, timeout or self.timeouts.op)
        except BaseException as e:
            if self._core.state != GroupState.READY:
                _drop_frame_locals(e)
            raise

    def cancel(self):
        """Ask the op in flight to stop; returns at once (True if an op was in flight). Thread-safe."""
        runner = self._runner
        return runner.cancel() if runner is not None else False

    def ensure_started(self):
        """Ready the group again after a fault or close(), with the arguments of the last start()."""
        state = self._core.state
        if state == GroupState.READY:
            return self
        if self._start_args is None:
            raise ParallelStateError(f"group {self.name!r} was never started; call start(devices, worker_spec) first", state)
        if state == GroupState.BROKEN:
            self.close()
        self.start(**self._start_args)
        return self

    def close(self):
        """Stop every worker (graceful when idle, SIGTERM then SIGKILL otherwise), destroy the process groups,
        remove the store. Idempotent; also runs at interpreter exit and is safe after any fault."""
        self._close(self.timeouts.rendezvous + self.timeouts.close)

    def _close(self, caller_grace):
        """close(); waits up to ``caller_grace`` s for a start() or run() in flight on another thread to return."""
        core = self._core
        with core.cond:
            state = core.state
            if state in (GroupState.IDLE, GroupState.CLOSED):
                core.set_state(GroupState.CLOSED)
                return
            if state == GroupState.CLOSING:
                core.cond.wait_for(lambda: core.state == GroupState.CLOSED, timeout=self.timeouts.close + 30)
                return
            core.set_state(GroupState.CLOSING)
        if state in (GroupState.STARTING, GroupState.RUNNING):
            # start() or run() is in flight on another thread: killing its peers unblocks any collective
            # it waits in (a process-group rendezvous only ends with Timeouts.rendezvous)
            core.kill_workers()
            if not core.quiet.wait(caller_grace):
                logger.error("group %r: the thread in %s() did not return; tearing down under it", self.name, state)
        self._teardown(graceful=state == GroupState.READY)
        self._release_log_dir()
        core.set_state(GroupState.CLOSED)

    def _teardown(self, graceful):
        core = self._core
        workers = list(core.workers)
        if graceful:
            with core.send_lock:
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
            process_groups.destroy_groups(abort=not graceful)
            self._pg_owned = False
        with core.send_lock:
            for w in workers:
                w.close_fds()
            core.workers = []
        if self._runner is not None:
            # an op may have kept ctx (or a caller the error that references it); the groups go regardless
            self._runner.ctx.data_group = self._runner.ctx.control_group = None
            self._runner = None
        self._control_group = None
        self._store = None
        if self._store_dir is not None:
            shutil.rmtree(self._store_dir, ignore_errors=True)
            self._store_dir = None
        self._unpin_loopback()
        process_groups.release(self)

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
        core = self._core
        if self._log_root is None and self._own_log_dir is None:
            self._own_log_dir = core.log_dir = tempfile.mkdtemp(prefix=f"comfy-parallel-{self.name}-", dir=_temp_root(create=True))
        os.makedirs(core.log_dir, exist_ok=True)
        gens = [0]
        for f in os.listdir(core.log_dir):
            head, _, tail = f.partition("-gen")
            if head.startswith("rank") and tail.endswith(".log") and tail[:-4].isdigit():
                gens.append(int(tail[:-4]))
        return max(max(gens), self._generation) + 1

    def _release_log_dir(self):
        """After close(): remove the folder this group made for its logs, unless a fault needs them
        (its error names the folder); either way the next start makes a new one."""
        own, self._own_log_dir = self._own_log_dir, None
        if own is None or self._core.error is not None:
            return
        shutil.rmtree(own, ignore_errors=True)
        if self._core.log_dir == own:
            self._core.log_dir = None


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
