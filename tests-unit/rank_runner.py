"""Run a function on N ranks, each in its own spawned Python process, with a gloo group.

Used by the test suite (``conftest.run_ranks``). Nothing crosses the process boundary as pickle:
the target is named as ``module:function``, arguments travel as JSON and results come back as
safetensors (tensors) plus JSON (everything else), written by the child into a folder the parent
made. A rank that raises writes its traceback; the parent re-raises the first failure.
"""

import argparse
import datetime
import importlib
import importlib.util
import json
import os
import sys
import time
import traceback


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


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True, help="module:function")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--init", default="", help="file:///path/to/store, empty for no process group")
    ap.add_argument("--out", required=True)
    ap.add_argument("--kwargs", default="{}")
    ap.add_argument("--timeout", type=float, default=60.0)
    a = ap.parse_args(argv)
    out = a.out
    failed_at = None
    try:
        import torch
        import torch.distributed as dist
        from safetensors.torch import save_file
        if importlib.util.find_spec("comfy.cli_args") is not None and not torch.cuda.is_available():
            # ComfyUI's model_management asserts CUDA unless told to run on the CPU
            from comfy.cli_args import args as comfy_args
            comfy_args.cpu = True
        module_name, fn_name = a.target.split(":")
        fn = getattr(importlib.import_module(module_name), fn_name)
        if a.init:
            dist.init_process_group("gloo", init_method=a.init, rank=a.rank, world_size=a.world,
                                    timeout=datetime.timedelta(seconds=a.timeout))
        try:
            result = fn(a.rank, a.world, **json.loads(a.kwargs))
        except BaseException:
            # stamped before the group is torn down, which makes the peers fail too
            failed_at = time.time()
            raise
        finally:
            if a.init and dist.is_initialized():
                dist.destroy_process_group()
        tensors, meta = _split_result(result)
        save_file(tensors, os.path.join(out, f"rank{a.rank}.safetensors"))
        with open(os.path.join(out, f"rank{a.rank}.json"), "w") as f:
            json.dump(meta, f)
        del torch
    except BaseException:
        # the time lets the parent report the root cause, not a peer's follow-on error
        with open(os.path.join(out, f"rank{a.rank}.error"), "w") as f:
            json.dump({"time": failed_at or time.time(), "traceback": traceback.format_exc()}, f)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())


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


def _root_failure(procs, out):
    """The failure that happened first (by the child's clock), with its traceback and log tail."""
    failures = []
    for r, p in enumerate(procs):
        if p.returncode in (0, None):
            continue
        err = os.path.join(out, f"rank{r}.error")
        try:
            with open(err) as f:
                info = json.load(f)
        except (OSError, ValueError):
            info = {"time": float("inf"), "traceback": f"(exit code {p.returncode}, no traceback written)"}
        failures.append((info["time"], r, info["traceback"]))
    _, r, tb = min(failures)
    return RankFailure(r, tb, _tail(os.path.join(out, f"rank{r}.log")))


def free_port():
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill(procs):
    import signal
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    for p in procs:
        p.wait()


def run_ranks(fn, world, kwargs=None, timeout=60.0, process_group=True, grace=5.0, workdir=None):
    """Run ``fn(rank, world, **kwargs)`` in ``world`` spawned processes and return each rank's result.

    ``fn`` must be a module-level function. With ``process_group`` each rank first joins a gloo group
    that meets in a store file in the results folder (no port to pick or to race for). A rank that raises makes this raise ``RankFailure`` with its traceback
    (the other ranks get ``grace`` seconds, then are killed); ranks still running after ``timeout``
    seconds are killed and ``RankTimeout`` names them. No child outlives this call.
    """
    import subprocess
    import tempfile

    from safetensors.torch import load_file

    target = f"{fn.__module__}:{fn.__name__}"
    own = workdir is None
    out = tempfile.mkdtemp(prefix="ranks-") if own else workdir
    init = f"file://{os.path.join(out, 'store')}" if process_group else ""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.setdefault("OMP_NUM_THREADS", "1")
    procs = []
    try:
        for r in range(world):
            log = open(os.path.join(out, f"rank{r}.log"), "wb")
            procs.append(subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--target", target, "--rank", str(r),
                 "--world", str(world), "--init", init, "--out", out,
                 "--kwargs", json.dumps(kwargs or {}), "--timeout", str(timeout)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                start_new_session=True))
            log.close()
        deadline = time.monotonic() + timeout
        first_failure = None
        while True:
            running = [r for r, p in enumerate(procs) if p.poll() is None]
            if first_failure is None:
                failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
                if failed:
                    first_failure = failed[0]
                    deadline = min(deadline, time.monotonic() + grace)
            if not running:
                break
            if time.monotonic() > deadline:
                if first_failure is not None:
                    break
                tails = "\n".join(f"--- rank {r} log tail ---\n{_tail(os.path.join(out, f'rank{r}.log'))}" for r in running)
                raise RankTimeout(f"ranks {running} of {world} still running after {timeout:.0f}s; killed them\n{tails}")
            time.sleep(0.02)
        if first_failure is not None:
            raise _root_failure(procs, out)
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
        _kill(procs)
        if own:
            import shutil
            shutil.rmtree(out, ignore_errors=True)
