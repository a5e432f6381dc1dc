"""A worker: a headless process running ops as rank r of a ParallelGroup, started by ``group.BOOT``.

hello -> "booted" -> ComfyUI's start-up with rank 0's arguments (when asked), the op modules, the
transport -> "ready" with the fingerprints of its code -> "run" until "shutdown". Its output goes to
rank 0's log; it exits once rank 0 closes its pipe or exits. Exit codes: 3 a bad frame, 4 rank 0
gone, 6 start-up failed, 7 the worker loop failed.
"""

import faulthandler
import importlib
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback

import torch

import comfy.cli_args

from . import channel, ops
from .errors import PreflightMismatch
from .transport import HostTransport, OpAborted

logger = logging.getLogger("comfy.parallel.worker")

PARENT_POLL = 0.5
HEARTBEAT = 0.2


def _leave(code):
    """Exit now: no exit handlers, nothing that could wait on a peer."""
    logging.shutdown()
    os._exit(code)


class Worker:
    def __init__(self, rank, frames, reply_fd, hello):
        self.rank, self.frames, self.reply_fd, self.hello = rank, frames, reply_fd, hello

    def send(self, kind, body):
        try:
            channel.write(self.reply_fd, channel.encode(kind, body), 30.0)
        except (OSError, TimeoutError) as e:
            logger.error("cannot reply to rank 0 (%s); exiting", e)
            _leave(4)

    def start(self):
        h = self.hello
        device = torch.device(h["device"])
        if h["comfyui"] is not None:
            _start_comfyui(h["comfyui"], cpu=device.type == "cpu")
        for name in h["imports"]:
            logger.info("importing %s", name)
            importlib.import_module(name)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        t = h["transport"]
        transport = HostTransport(self.rank, h["world_size"], device, t["slot_bytes"], fd=t["fds"][0], bells=t["fds"][1:])
        for fd in t["fds"]:
            os.set_inheritable(fd, False)
        threading.Thread(target=_beat, args=(transport,), name="parallel-heartbeat", daemon=True).start()
        self.send("ready", {"fingerprints": ops.code_fingerprints(h["modules"])})
        logger.info("ready: rank %d of %d on %s", self.rank, h["world_size"], device)
        return ops.OpContext(self.rank, h["world_size"], device, transport)

    def serve(self, ctx):
        """Ops until "shutdown"; the end of the pipe ends the process (rank 0 exited or dropped the group)."""
        try:
            for kind, body in self.frames:
                if kind == "shutdown":
                    logger.info("shutdown requested by rank 0")
                    _leave(0)
                if kind != "run":
                    logger.error("unexpected %r frame after start-up; exiting", kind)
                    _leave(3)
                self.send("result", self.run(ctx, body))
        except EOFError:
            logger.warning("rank 0 closed the control channel (it exited or dropped the group); exiting")
            _leave(4)
        except (OSError, ValueError) as e:
            logger.error("rejected a control frame from rank 0: %s; exiting", e)
            _leave(3)

    def run(self, ctx, body):
        op_id, name, t = body["id"], body["op"], ctx.transport
        ctx.op_name = name
        t.begin_op(op_id, time.monotonic() + body["timeout"])
        try:
            t.settle()
            with torch.inference_mode():  # as ComfyUI runs its nodes: no autograd state (a VAE's weights require grad)
                value = ops.get_op(name)(ctx, body["meta"])
            channel.encode("result", {"value": value})  # JSON, or the op fails here
            return {"id": op_id, "status": "ok", "value": value}
        except (OpAborted, PreflightMismatch) as e:  # every rank left the op (rank 0 raises a mismatch)
            logger.info("op %r (id %d) left: %s", name, op_id, e)
            return {"id": op_id, "status": "aborted", "value": None}
        except Exception as e:
            t.abort(op_id)  # every rank leaves the op now
            logger.exception("op %r (id %d) raised", name, op_id)
            return {"id": op_id, "status": "error", "value": None,
                    "error": {"type": type(e).__name__, "message": str(e)[:2000], "traceback": traceback.format_exc()[-16000:]}}


def _beat(transport):
    while True:
        transport.heartbeat()
        time.sleep(HEARTBEAT)


def _start_comfyui(start, cpu):
    """Before any ComfyUI model code is imported: rank 0's args, then DynamicVRAM as main.py starts it, on this
    worker's device only (cuda:0 here; the group's other GPUs are visible for the device path's peer copies),
    and only where rank 0 runs it, so that every rank has the same kind of ModelPatcher."""
    def decode(d):
        if set(d) == {"enum", "value"}:
            return getattr(comfy.cli_args, d["enum"])(d["value"])
        return set(d["set"]) if set(d) == {"set"} else d
    args = comfy.cli_args.args
    vars(args).update(json.loads(start["args"], object_hook=decode))
    if cpu:
        args.cpu = True  # this worker's device; rank 0 may run on a GPU
    if not start["dynamic_vram"]:
        args.enable_dynamic_vram, args.disable_dynamic_vram = False, True
        return
    import comfy_aimdo.control
    headroom = None if args.reserve_vram is None else int(args.reserve_vram * 1024 ** 3)
    comfy_aimdo.control.init(simple_vram_headroom=headroom, nvml_pressure=not args.disable_nvml_pressure)
    # model_management reads the device at import, which must follow comfy_aimdo.control.init()
    from comfy import memory_management, model_patcher
    if not comfy_aimdo.control.init_devices([(0, int(args.vram_headroom * 1024 ** 3))]):
        raise RuntimeError("rank 0 runs DynamicVRAM but comfy-aimdo did not start on this worker's device")
    model_patcher.CoreModelPatcher = model_patcher.ModelPatcherDynamic
    memory_management.aimdo_enabled = True


def _frames(reader):
    while True:
        yield from reader.feed()


def _watch_parent(parent_pid):
    """Exit once rank 0 is gone (a process rank 0 forked may hold the pipe open, so no EOF comes)."""
    while True:
        time.sleep(PARENT_POLL)
        if os.getppid() != parent_pid:
            logger.error("rank 0 (pid %d) exited; exiting", parent_pid)
            _leave(4)


def main(argv):
    rank, cmd_fd, reply_fd, parent_pid = (int(a) for a in argv)
    # the level first: rank 0 forwards WARNING and above to its own log
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # this process's children must not hold the pipes (rank 0 would not see this worker's exit as EOF)
    os.set_inheritable(cmd_fd, False)
    os.set_inheritable(reply_fd, False)
    os.set_blocking(reply_fd, False)
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    frames = _frames(channel.Reader(cmd_fd))
    try:
        worker = Worker(rank, frames, reply_fd, next(frames)[1])
    except (EOFError, OSError, ValueError) as e:
        logger.error("no start-up frame from rank 0: %s", e)
        _leave(4)
    worker.send("booted", {})
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
