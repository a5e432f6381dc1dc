"""A worker: a headless ComfyUI running ops as rank r of a ParallelGroup, started by ``group.BOOT``.

It reads "hello", replies "booted", takes rank 0's ComfyUI args and ComfyUI's device start-up, imports
the op modules, replies "connected", joins the process groups, probes, replies "ready", then serves
"run" until "shutdown". It logs to stdout/stderr. Exit codes: 3 bad frame, 4 rank 0 gone, 6 start-up
failed, 7 the worker loop failed."""

import faulthandler
import importlib
import logging
import os
import queue
import shutil
import signal
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist

import comfy.cli_args
import comfy.dynamic_vram

from . import frames, ops
from .errors import ParallelCancelled, PreflightMismatch

logger = logging.getLogger("comfy.parallel.worker")

PARENT_POLL = 0.5
_folder = [None]  # rank 0's private folder, which this worker removes if rank 0 dies


def _leave(code):
    """Exit now: no atexit hooks, no process-group destructors that could wait on dead peers."""
    if code == 4 and _folder[0] is not None:
        shutil.rmtree(_folder[0], ignore_errors=True)
    logging.shutdown()
    os._exit(code)


class Worker:
    def __init__(self, rank, cmd_fd, reply_fd, hello):
        self.rank, self.cmd_fd, self.reply_fd, self.hello, self.work, self.cancel_upto = rank, cmd_fd, reply_fd, hello, queue.Queue(), 0

    def send(self, kind, body):
        try:
            frames.write(self.reply_fd, frames.encode(kind, body), 30.0)
        except (OSError, TimeoutError) as e:
            logger.error("cannot reply to rank 0 (%s); exiting", e)
            _leave(4)

    def read_commands(self):
        """The control reader thread: "run"/"shutdown" become work, "cancel" the flag ctx.cancelled() reads."""
        while True:
            try:
                kind, body, tensors = frames.read(self.cmd_fd)
            except EOFError:
                logger.warning("rank 0 closed the control channel (it exited or dropped the group); exiting")
                _leave(4)
            except (OSError, ValueError) as e:
                logger.error("rejected a control frame from rank 0: %s; exiting", e)
                _leave(3)
            if kind not in ("run", "cancel", "shutdown"):
                logger.error("unexpected %r frame after start-up; exiting", kind)
                _leave(3)
            if kind == "cancel":
                self.cancel_upto = max(self.cancel_upto, body["id"])
            else:
                self.work.put((kind, body, tensors))

    def start(self):
        h = self.hello
        _folder[0] = h["folder"]
        device = torch.device(h["device"])
        if h["comfyui_args"] is not None:
            _start_comfyui(h["comfyui_args"], cpu=device.type == "cpu")
        for name in h["imports"]:
            logger.info("importing %s", name)
            importlib.import_module(name)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        self.send("connected", {})
        before, t = ops.open_fds(), h["timeouts"]
        ctx = ops.OpContext(self.rank, h["world_size"], device, *ops.init_groups(h["store"], self.rank, h["world_size"], device,
                                                                                 t["collective"], t["op"]))
        ops.probe(ctx)
        ops.seal_fds(before)
        self.send("ready", {})
        logger.info("ready: rank %d of %d on %s", self.rank, h["world_size"], device)
        return ctx

    def serve(self, ctx):
        while True:
            kind, body, tensors = self.work.get()
            if kind == "shutdown":
                logger.info("shutdown requested by rank 0")
                dist.destroy_process_group()
                _leave(0)
            self.send("result", self.run(ctx, body, tensors))

    def run(self, ctx, body, tensors):
        op_id, name = body["id"], body["op"]
        fn = ops._OPS.get(name)  # a missing op stops every rank in the preflight
        ctx.op_id, ctx.op_name, ctx.cancel_requested = op_id, name, lambda: self.cancel_upto >= op_id
        try:
            if ops.op_preflight(ctx, fn is not None, ctx.cancel_requested()):
                raise ParallelCancelled(f"op {name!r} (id {op_id}) was cancelled before it started")
            out = fn(ctx, {k: v.to(ctx.device) for k, v in tensors.items()}, body["meta"])
            frames.check_json(out[1], f"the meta op {name!r} returned")
            return {"id": op_id, "status": "ok", "meta": out[1]}
        except ParallelCancelled:
            logger.info("op %r (id %d) cancelled", name, op_id)
            return {"id": op_id, "status": "cancelled", "meta": {}}
        except PreflightMismatch as e:
            logger.warning("%s", e)
            return {"id": op_id, "status": "mismatch", "meta": {}}
        except Exception as e:
            logger.exception("op %r (id %d) raised", name, op_id)
            return {"id": op_id, "status": "error", "meta": {}, "in_collective": ops.in_collective(e),
                    "error": {"type": type(e).__name__, "message": str(e)[:2000], "traceback": traceback.format_exc()[-16000:]}}
        finally:
            ctx.cancel_requested = None


def _start_comfyui(values, cpu):
    """Before any ComfyUI model code is imported: rank 0's args, then ComfyUI's own start-up of the device
    and DynamicVRAM (main.py runs the same), so that attention, dtypes and memory follow those args."""
    def decode(v):
        if isinstance(v, dict) and set(v) == {"enum", "value"}:
            return getattr(comfy.cli_args, v["enum"])(v["value"])
        if isinstance(v, dict) and set(v) == {"set"}:
            return {decode(x) for x in v["set"]}
        return v
    args = comfy.cli_args.args
    vars(args).update({k: decode(v) for k, v in values.items()})
    if cpu:
        args.cpu = True  # this worker's device; rank 0 may run on a GPU
    comfy.dynamic_vram.init_allocator()
    # imports comfy.model_management, which reads the args: device, VRAM state, attention
    comfy.dynamic_vram.enable(comfy.cli_args.get_console_log_level(args.verbose))


def _watch_parent(parent_pid):
    """Exit once rank 0 is gone (a process rank 0 forked may hold the pipe open, so no EOF comes)."""
    while True:
        time.sleep(PARENT_POLL)
        if os.getppid() != parent_pid:
            logger.error("rank 0 (pid %d) exited; exiting", parent_pid)
            _leave(4)


def main(argv):
    rank, cmd_fd, reply_fd, parent_pid = (int(a) for a in argv)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format=f"%(asctime)s rank{rank} pid{os.getpid()} %(levelname)s %(name)s: %(message)s")
    # this process's children must not hold the pipes (rank 0 would not see this worker's exit as EOF)
    os.set_inheritable(cmd_fd, False)
    os.set_inheritable(reply_fd, False)
    os.set_blocking(reply_fd, False)
    faulthandler.enable()
    # rank 0 sends SIGUSR1 before it kills a late worker that has replied "booted": the stacks go to the log
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    try:
        worker = Worker(rank, cmd_fd, reply_fd, frames.read(cmd_fd)[1])
    except (EOFError, OSError, ValueError) as e:
        logger.error("no start-up frame from rank 0: %s", e)
        _leave(4)
    worker.send("booted", {"pid": os.getpid()})
    threading.Thread(target=worker.read_commands, name="parallel-control-reader", daemon=True).start()
    try:
        ctx = worker.start()
    except BaseException:
        logger.exception("start-up failed")
        _leave(6)
    try:
        worker.serve(ctx)
    except BaseException:
        logger.exception("the worker loop failed")
        _leave(7)
