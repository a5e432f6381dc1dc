"""Run a function on N ranks, each in its own process, with a gloo group.

Used by the test suite (``conftest.run_ranks``). A rank server (one Python process per ``sys.path``,
started on first use) imports torch and each target's module once; every call forks fresh rank
processes from it, so a call costs no interpreter start or import and no call sees another's state.
Nothing crosses a process boundary as pickle: requests and replies are JSON lines, the target is
named as ``module:function``, results come back as safetensors (tensors) plus JSON (everything
else), written by each rank into a folder the parent made. A rank that raises writes its traceback;
the parent re-raises the first failure. When ranks are still running after a failure's grace period
or the timeout, the server is killed with its ranks (one process group); the next call starts a new one.
"""

import atexit
import datetime
import importlib
import json
import os
import select
import signal
import sys
import time
import traceback

_LINUX = sys.platform.startswith("linux")


def _die_with_parent(sig=signal.SIGKILL):
    """Linux: this process gets ``sig`` when the one that started it exits (no orphans after a crash)."""
    if _LINUX:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG


def _split_result(value):
    """A rank's return value -> (tensors dict, JSON-able rest)."""
    import torch
    if isinstance(value, dict):
        tensors = {k: v.detach().cpu().contiguous() for k, v in value.items() if isinstance(v, torch.Tensor)}
        rest = {k: v for k, v in value.items() if not isinstance(v, torch.Tensor)}
        return tensors, {"kind": "dict", "value": rest}
    if isinstance(value, torch.Tensor):
        return {"__value__": value.detach().cpu().contiguous()}, {"kind": "tensor"}
    return {}, {"kind": "json", "value": value}


def _rank_main(req, rank):
    """One rank of one call, in a process forked for it: join the group, run, write the result."""
    out = req["out"]
    failed_at = None
    try:
        import torch.distributed as dist
        from safetensors.torch import save_file
        module_name, fn_name = req["target"].split(":")
        fn = getattr(importlib.import_module(module_name), fn_name)
        if req["init"]:
            dist.init_process_group("gloo", init_method=req["init"], rank=rank, world_size=req["world"],
                                    timeout=datetime.timedelta(seconds=req["timeout"]))
        try:
            result = fn(rank, req["world"], **req["kwargs"])
        except BaseException:
            # stamped before the group is torn down, which makes the peers fail too
            failed_at = time.time()
            raise
        finally:
            if req["init"] and dist.is_initialized():
                dist.destroy_process_group()
        tensors, meta = _split_result(result)
        save_file(tensors, os.path.join(out, f"rank{rank}.safetensors"))
        with open(os.path.join(out, f"rank{rank}.json.tmp"), "w") as f:
            json.dump(meta, f)
        os.replace(os.path.join(out, f"rank{rank}.json.tmp"), os.path.join(out, f"rank{rank}.json"))
        return 0
    except BaseException:
        # the time lets the parent report the root cause, not a peer's follow-on error
        with open(os.path.join(out, f"rank{rank}.error"), "w") as f:
            json.dump({"time": failed_at or time.time(), "traceback": traceback.format_exc()}, f)
        return 1


def _fork_rank(req, rank, reply):
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        reply.close()
        log = os.open(os.path.join(req["out"], f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        _die_with_parent()  # the server
        code = _rank_main(req, rank)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve(folder):
    """The rank server: one JSON request per stdin line -> fork its ranks, reap them, one JSON reply line.
    When the process that started it dies (a crashed or killed test run), it kills its ranks and removes
    its folder."""
    import shutil

    def orphaned(*_):
        shutil.rmtree(folder, ignore_errors=True)
        os.killpg(0, signal.SIGKILL)  # its ranks, and itself

    signal.signal(signal.SIGTERM, orphaned)
    _die_with_parent(signal.SIGTERM)
    import torch  # noqa: F401  (imported once here, inherited by every rank)
    import torch.distributed  # noqa: F401
    import safetensors.torch  # noqa: F401
    try:
        from comfy.cli_args import args as comfy_args
    except ImportError:  # no ComfyUI on this sys.path
        pass
    else:  # ranks run on the CPU; ComfyUI's model_management asserts CUDA unless told so
        comfy_args.cpu = True
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # stray prints go to the server log, never into the reply stream
    for line in sys.stdin:
        req = json.loads(line)
        try:  # imported once, before the fork; a failing import is reported by the ranks themselves
            importlib.import_module(req["target"].split(":")[0])
        except BaseException:
            pass
        pids = [_fork_rank(req, r, reply) for r in range(req["world"])]
        codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
        reply.write(json.dumps({"codes": codes}) + "\n")
        reply.flush()
    shutil.rmtree(folder, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# parent side


class RankFailure(RuntimeError):
    """A rank raised; carries the rank and the child's own traceback."""

    def __init__(self, rank, child_traceback, log_tail=""):
        self.rank = rank
        self.child_traceback = child_traceback
        super().__init__(f"rank {rank} raised:\n{child_traceback}" + (f"\n--- rank {rank} log tail ---\n{log_tail}" if log_tail else ""))


class RankTimeout(RuntimeError):
    """Ranks did not finish within the hard timeout; they were killed."""


def _tail(path, n=2000):
    try:
        with open(path, "rb") as f:
            data = f.read()
        return data[-n:].decode("utf-8", "replace")
    except OSError:
        return ""


def _root_failure(world, out, codes=None):
    """The failure that happened first (by the rank's clock), with its traceback and log tail."""
    failures = []
    for r in range(world):
        err = os.path.join(out, f"rank{r}.error")
        if os.path.exists(err):
            with open(err) as f:
                info = json.load(f)
        elif codes is not None and codes[r] != 0:
            info = {"time": float("inf"), "traceback": f"(exit code {codes[r]}, no traceback written)"}
        else:
            continue
        failures.append((info["time"], r, info["traceback"]))
    if not failures:
        return RuntimeError(f"the rank server ended without a reply; its log:\n{_tail(os.path.join(out, '..', 'server.log'))}")
    _, r, tb = min(failures)
    return RankFailure(r, tb, _tail(os.path.join(out, f"rank{r}.log")))


def free_port():
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    """A rank server and the folder its calls' results go to."""

    def __init__(self, pythonpath):
        import subprocess
        import tempfile
        self.folder = tempfile.mkdtemp(prefix="ranks-")
        # ranks compute on the CPU (gloo); with CUDA hidden nothing initializes it before the fork
        env = dict(os.environ, PYTHONPATH=pythonpath, CUDA_VISIBLE_DEVICES="")
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env.setdefault("OMP_NUM_THREADS", "1")
        with open(os.path.join(self.folder, "server.log"), "wb") as log:
            self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", self.folder], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=log, env=env, start_new_session=True)
        self.calls = 0

    def close(self, kill=False):
        """End the server (EOF, or SIGKILL to its whole process group, ranks included) and its folder."""
        import shutil
        if not kill and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except Exception:
                kill = True
        if kill or self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass
        shutil.rmtree(self.folder, ignore_errors=True)


_servers = {}


def close_servers():
    """End every rank server (the suite calls this at session end; also at interpreter exit)."""
    while _servers:
        _servers.popitem()[1].close()


atexit.register(close_servers)


def _failed(server, error):
    """Kill the server and its ranks (after the error was read from their folder); -> the error."""
    server.close(kill=True)
    return error


def _wait_reply(server, world, out, timeout, grace):
    """The server's reply (each rank's exit code); kills the server on a failure that blocks or a timeout."""
    deadline = time.monotonic() + timeout
    first_failure = False
    fd = server.proc.stdout.fileno()
    while True:
        if select.select([fd], [], [], 0.02)[0]:
            line = server.proc.stdout.readline()
            if line:
                return json.loads(line)["codes"]
            raise _failed(server, _root_failure(world, out))
        if not first_failure and any(os.path.exists(os.path.join(out, f"rank{r}.error")) for r in range(world)):
            first_failure = True  # the others may block in a collective the failed rank left
            deadline = min(deadline, time.monotonic() + grace)
        if time.monotonic() > deadline:
            if first_failure:
                raise _failed(server, _root_failure(world, out))
            running = [r for r in range(world) if not os.path.exists(os.path.join(out, f"rank{r}.json"))]
            tails = "\n".join(f"--- rank {r} log tail ---\n{_tail(os.path.join(out, f'rank{r}.log'))}" for r in running)
            raise _failed(server, RankTimeout(f"ranks {running} of {world} still running after {timeout:.0f}s; killed them\n{tails}"))


def run_ranks(fn, world, kwargs=None, timeout=60.0, process_group=True, grace=5.0):
    """Run ``fn(rank, world, **kwargs)`` in ``world`` processes and return each rank's result.

    ``fn`` must be a module-level function. With ``process_group`` each rank first joins a gloo group
    that meets in a store file in the call's folder (no port to pick or to race for). A rank that
    raises makes this raise ``RankFailure`` with its traceback (the other ranks get ``grace`` seconds,
    then are killed); ranks still running after ``timeout`` seconds are killed and ``RankTimeout``
    names them. No rank outlives this call.
    """
    import shutil
    import tempfile

    from safetensors.torch import load_file

    pythonpath = os.pathsep.join(p for p in sys.path if p)
    server = _servers.get(pythonpath)
    if server is None or server.proc.poll() is not None:
        server = _servers[pythonpath] = _Server(pythonpath)
    out = tempfile.mkdtemp(prefix=f"call{server.calls}-", dir=server.folder)
    server.calls += 1
    try:
        req = {"target": f"{fn.__module__}:{fn.__name__}", "world": world, "kwargs": kwargs or {}, "timeout": timeout,
               "init": f"file://{os.path.join(out, 'store')}" if process_group else "", "out": out}
        try:
            server.proc.stdin.write((json.dumps(req) + "\n").encode())
            server.proc.stdin.flush()
        except OSError:
            raise _failed(server, _root_failure(world, out)) from None
        codes = _wait_reply(server, world, out, timeout, grace)
        if any(codes):
            raise _root_failure(world, out, codes)
        results = []
        for r in range(world):
            with open(os.path.join(out, f"rank{r}.json")) as f:
                meta = json.load(f)
            tensors = load_file(os.path.join(out, f"rank{r}.safetensors"))
            if meta["kind"] == "tensor":
                results.append(tensors["__value__"])
            elif meta["kind"] == "dict":
                results.append({**meta["value"], **tensors})
            else:
                results.append(meta["value"])
        return results
    finally:
        shutil.rmtree(out, ignore_errors=True)
        if server.proc.poll() is not None:
            server.close(kill=True)
            _servers.pop(pythonpath, None)


if __name__ == "__main__" and sys.argv[1:2] == ["--serve"]:
    serve(sys.argv[2])
