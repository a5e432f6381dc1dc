"""Worker process entry: ``python -m comfy.parallel.worker --rank R --cmd-fd FD --reply-fd FD --parent-pid P``.

Spawned by ``ParallelGroup.start`` (never by hand); ``Worker.serve`` lists what it does, in order.
Exit codes are listed in ``errors.py``; everything this process says goes to its log (stderr).
"""

import argparse
import faulthandler
import importlib
import importlib.util
import logging
import os
import platform
import queue
import select
import shutil
import signal
import sys
import threading
import time
import traceback

from . import errors
from .errors import ParallelCancelled, PreflightMismatch, ProtocolError, UnknownOpError
from .protocol import KINDS_TO_WORKER, TOKEN_BYTES, FrameReader, canonical_json, encode, read_exact, write_all

logger = logging.getLogger("comfy.parallel.worker")

BOOT_TIMEOUT = 60.0
REPLY_TIMEOUT = 30.0
PARENT_POLL = 0.5
_HELLO = {"rank": int, "world_size": int, "device": str, "backend": str, "store_path": str, "spec": dict,
          "timeouts": dict}


# the rendezvous folder rank 0 made for this group; removed here when rank 0 is gone (it cannot, if killed)
_rendezvous = [None]


def _leave(code):
    """Exit now: no atexit hooks and no process-group destructors that could wait on dead peers."""
    folder = _rendezvous[0]
    if code == errors.EXIT_PARENT_GONE and folder is not None and "-rendezvous-" in os.path.basename(folder):
        shutil.rmtree(folder, ignore_errors=True)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


class Worker:
    def __init__(self, rank, token, reader, cmd_fd, reply_fd, hello):
        body = hello.body
        for key, kind in _HELLO.items():
            if not isinstance(body.get(key), kind):
                raise ProtocolError(f"hello lacks {key!r} ({kind.__name__}): {body!r:.300}")
        if body["rank"] != rank:
            raise ProtocolError(f"hello is for rank {body['rank']}, but this worker was spawned as rank {rank}")
        self.rank = rank
        self.world_size = body["world_size"]
        self.device_name = body["device"]
        self.backend = body["backend"]
        self.store_path = body["store_path"]
        _rendezvous[0] = os.path.dirname(self.store_path)
        self.spec = body["spec"]
        self.timeouts = body["timeouts"]
        self._token = token
        self._reader = reader
        self._cmd_fd = cmd_fd
        self._reply_fd = reply_fd
        os.set_blocking(reply_fd, False)
        self._send_seq = 0
        self._queue = queue.Queue()
        self._last_run_id = 0
        self.cancel_upto = 0
        self._store = None

    def serve(self):
        """Start up, then serve ops one at a time until "shutdown". Start-up, in order:

        1. (``main``) read the group token (32 raw bytes) and an authenticated "hello" (rank, world
           size, device, backend, store path, worker spec, timeouts); reply "booted";
        2. start the control reader thread: "run"/"shutdown" become work for this thread, "cancel" the
           flag ``ctx.cancelled()`` reads, and EOF (rank 0 gone) an immediate exit;
        3. import the spec's modules (they register ops), open the store, reply "connected";
        4. join the process groups (data group, gloo control group), run the probe;
        5. ``setup(ctx, **setup_args)`` once (e.g. build the model into ``ctx.state``), reply "ready".
        Between ops it blocks on its queue, outside any collective, so idling never trips a timeout.
        """
        # main() installed the SIGUSR1 stack dump; until rank 0 hears this it sends no SIGUSR1,
        # whose default action would kill a worker still starting Python
        self._send("booted", 0, {"pid": os.getpid()})
        threading.Thread(target=self._read_loop, name="parallel-control-reader", daemon=True).start()
        try:
            ctx = self._startup()
        except BaseException:
            logger.exception("start-up failed")
            _leave(errors.EXIT_STARTUP)
        try:
            self._loop(ctx)
        except BaseException:
            logger.exception("worker loop failed")
            _leave(errors.EXIT_INTERNAL)

    # -- control channel ----------------------------------------------------------------------

    def _send(self, kind, op_id, body):
        self._send_seq += 1
        data = encode(self._token, kind, self._send_seq, op_id, body)
        try:
            write_all(self._reply_fd, data, REPLY_TIMEOUT)
        except (OSError, TimeoutError) as e:
            logger.error("cannot reply to rank 0 (%s); exiting", e)
            _leave(errors.EXIT_PARENT_GONE)

    def _read_loop(self):
        while True:
            try:
                data = os.read(self._cmd_fd, 1 << 16)
            except OSError as e:
                logger.error("reading the control channel failed: %s; exiting", e)
                _leave(errors.EXIT_PARENT_GONE)
            try:
                if not data:
                    self._reader.close()
                    logger.warning("rank 0 closed the control channel (it exited or dropped the group); exiting")
                    _leave(errors.EXIT_PARENT_GONE)
                for msg in self._reader.feed(data):
                    self._dispatch(msg)
            except ProtocolError as e:
                logger.error("rejected a control message from rank 0: %s; exiting", e)
                _leave(errors.EXIT_PROTOCOL)
            except Exception:
                # without its reader this worker would wait for ops it can no longer receive
                logger.exception("the control reader failed; exiting")
                _leave(errors.EXIT_INTERNAL)

    def _dispatch(self, msg):
        if msg.kind == "run":
            if msg.id <= self._last_run_id:
                raise ProtocolError(f"op id {msg.id} does not increase (last op was {self._last_run_id})")
            if not isinstance(msg.body.get("op"), str) or not isinstance(msg.body.get("meta"), dict):
                raise ProtocolError(f"run message needs 'op' (str) and 'meta' (object), got {sorted(msg.body)}")
            self._last_run_id = msg.id
            self._queue.put(msg)
        elif msg.kind == "cancel":
            if msg.id > self._last_run_id:
                raise ProtocolError(f"cancel names op {msg.id}, which was never sent (last op {self._last_run_id})")
            self.cancel_upto = max(self.cancel_upto, msg.id)
        elif msg.kind == "shutdown":
            self._queue.put(msg)
        else:
            raise ProtocolError(f"unexpected {msg.kind!r} message after start-up")

    # -- start-up and ops ---------------------------------------------------------------------

    def _startup(self):
        t0 = time.monotonic()
        import torch
        import torch.distributed as dist

        from . import collectives, process_groups
        from .registry import OpContext
        _configure_comfyui(self.spec.get("comfyui"), self.device_name)
        for name in self.spec.get("imports") or []:
            logger.info("importing %s", name)
            importlib.import_module(name)
        setup = None
        if self.spec.get("setup"):
            mod, _, fn = self.spec["setup"].partition(":")
            setup = getattr(importlib.import_module(mod), fn)
        device = torch.device(self.device_name)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        self._store = process_groups.file_store(self.store_path, self.world_size, self.timeouts["startup"])
        self._send("connected", 0, {"pid": os.getpid(), "torch": torch.__version__, "python": platform.python_version()})
        control = process_groups.init_groups(self.backend, self._store, self.rank, self.world_size, device, self.timeouts)
        collectives.probe(self.rank, self.world_size, device, dist.group.WORLD, control)
        ctx = OpContext(self.rank, self.world_size, device, dist.group.WORLD, control, state={})
        meta = None
        if setup is not None:
            logger.info("running setup %s", self.spec["setup"])
            meta = setup(ctx, **(self.spec.get("setup_args") or {}))
            canonical_json(meta)
        self._send("ready", 0, {"meta": meta, "seconds": time.monotonic() - t0})
        logger.info("ready: rank %d of %d on %s (%s) in %.2fs", self.rank, self.world_size, device, self.backend, time.monotonic() - t0)
        return ctx

    def _loop(self, ctx):
        while True:
            msg = self._queue.get()
            if msg.kind == "shutdown":
                logger.info("shutdown requested by rank 0")
                from . import process_groups
                process_groups.destroy_groups(abort=False)
                _leave(errors.EXIT_OK)
            self._send("result", msg.id, self._serve_run(ctx, msg))

    def _serve_run(self, ctx, msg):
        from . import collectives, registry
        op_id, name = msg.id, msg.body["op"]
        status, fn = collectives.STATUS_OK, None
        try:
            fn = registry.get_op(name)
        except UnknownOpError:
            status = collectives.STATUS_UNKNOWN_OP
            logger.error("op %r is not registered here (registered: %s)", name, registry.registered_ops())
        ctx.op_id, ctx.op_name = op_id, name
        ctx._cancel_requested = lambda: self.cancel_upto >= op_id
        try:
            if collectives.op_preflight(op_id, name, msg.digest, status, ctx._cancel_requested(), ctx.control_group, ctx.world_size):
                raise ParallelCancelled(f"op {name!r} (id {op_id}) was cancelled before it started")
            tensors = collectives.broadcast_inputs(msg.manifest, None, ctx.device, ctx.data_group)
            _, meta = registry.check_op_output(name, fn(ctx, tensors, msg.body["meta"]))
            reply = {"status": "ok", "meta": meta}
            encode(self._token, "result", 0, op_id, reply)
            return reply
        except ParallelCancelled:
            logger.info("op %r (id %d) cancelled", name, op_id)
            return {"status": "cancelled", "meta": {}}
        except PreflightMismatch as e:
            logger.warning("%s", e)
            return {"status": "mismatch", "meta": {}, "error": {"type": type(e).__name__, "message": str(e)[:4000]}}
        except Exception as e:
            logger.exception("op %r (id %d) raised", name, op_id)
            return {"status": "error", "meta": {}, "error": {"type": type(e).__name__, "message": str(e)[:4000],
                                                             "traceback": traceback.format_exc()[-16000:]}}
        finally:
            ctx.op_id = ctx.op_name = ctx._cancel_requested = None


def _watch_parent(parent_pid):
    """Exit once rank 0 is gone. EOF on the control pipe usually says so first, but a process rank 0
    forked keeps the pipe open; the parent pid changes either way (PR_SET_PDEATHSIG would fire when
    the spawning thread ends, and ComfyUI starts groups from its prompt thread)."""
    while True:
        time.sleep(PARENT_POLL)
        if os.getppid() != parent_pid:
            logger.error("rank 0 (pid %d) exited; exiting", parent_pid)
            _leave(errors.EXIT_PARENT_GONE)


def _read_hello(fd, reader, timeout):
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no hello from rank 0 within {timeout:.0f}s")
        if not select.select([fd], [], [], min(left, 1.0))[0]:
            continue
        data = os.read(fd, 1 << 16)
        if not data:
            reader.close()
            raise EOFError("rank 0 closed the control channel before the hello")
        messages = reader.feed(data)
        if messages:
            if len(messages) > 1 or messages[0].kind != "hello":
                raise ProtocolError(f"expected one 'hello' first, got {[m.kind for m in messages]}")
            return messages[0]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--cmd-fd", type=int, required=True)
    ap.add_argument("--reply-fd", type=int, required=True)
    ap.add_argument("--parent-pid", type=int, required=True)
    a = ap.parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format=f"%(asctime)s rank{a.rank} pid{os.getpid()} %(levelname)s %(name)s: %(message)s")
    faulthandler.enable()
    # rank 0 sends SIGUSR1 before killing a late worker that has replied "booted", so its log shows where it was stuck
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    threading.Thread(target=_watch_parent, args=(a.parent_pid,), name="parallel-parent-watch", daemon=True).start()
    try:
        token = read_exact(a.cmd_fd, TOKEN_BYTES, BOOT_TIMEOUT)
        reader = FrameReader(token, KINDS_TO_WORKER)
        worker = Worker(a.rank, token, reader, a.cmd_fd, a.reply_fd, _read_hello(a.cmd_fd, reader, BOOT_TIMEOUT))
    except ProtocolError as e:
        logger.error("rejected the start-up message from rank 0: %s", e)
        _leave(errors.EXIT_PROTOCOL)
    except (TimeoutError, EOFError, OSError) as e:
        logger.error("no start-up message from rank 0: %s", e)
        _leave(errors.EXIT_PARENT_GONE)
    worker.serve()


def _configure_comfyui(settings, device_name):
    """A headless ComfyUI takes rank 0's execution settings before any model code imports
    comfy.model_management (which reads them at import). Without settings, a CPU worker still tells
    ComfyUI, if present, to run on the CPU: it asserts CUDA at import otherwise."""
    kind = "cpu" if device_name.startswith("cpu") else "cuda"
    if settings is not None:
        from . import headless
        headless.configure(settings, kind)
    elif kind == "cpu" and importlib.util.find_spec("comfy.cli_args") is not None:
        from comfy.cli_args import args
        args.cpu = True


if __name__ == "__main__":
    main()

