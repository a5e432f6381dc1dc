"""Collect a patched tree's whole tests-unit as on Linux, Windows and macOS (the OSes of upstream's CI).

    python scripts/collect_as.py TREE

Upstream's unit-test workflow runs `python -m pytest tests-unit` on ubuntu, windows-2022 and macos,
so every test module of the series must import on all three. Here Linux is real; Windows and macOS
are simulated before pytest starts: sys.platform says win32 / darwin, and the `signal` and `os`
names those systems lack are removed (a module that needs them at import time fails to collect, as
it would there). Modules that only need them at run time must skip there; that is not checked here.
Fails on any collection error in a file the series adds (one the base, COMFYUI_DIR or
.comfyui/comfyui-h3-newest, lacks); ComfyUI's own modules that fail to collect are listed apart
(missing optional packages, or native backends the simulation cannot switch).
"""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# what CPython's signal module has on Windows; every other name goes
WINDOWS_SIGNAL = {"SIGABRT", "SIGFPE", "SIGILL", "SIGINT", "SIGSEGV", "SIGTERM", "SIGBREAK", "CTRL_C_EVENT",
                  "CTRL_BREAK_EVENT", "SIG_DFL", "SIG_IGN", "NSIG", "Signals", "Handlers", "default_int_handler",
                  "getsignal", "raise_signal", "set_wakeup_fd", "signal", "strsignal", "valid_signals"}
WINDOWS_OS = ("fork", "forkpty", "register_at_fork", "setsid", "getsid", "killpg", "getpgid", "setpgid", "getpgrp",
              "setpgrp", "getuid", "geteuid", "getgid", "getegid", "uname", "sysconf", "sched_getaffinity",
              "sched_setaffinity", "pidfd_open", "posix_spawn", "posix_spawnp", "getloadavg", "nice", "mkfifo",
              "wait", "wait3", "wait4", "WNOHANG", "pipe2", "fchown", "chown", "lchown", "openpty", "ttyname")
# Linux-only names that macOS lacks
MACOS_SIGNAL = ("SIGRTMIN", "SIGRTMAX", "SIGPOLL", "SIGPWR", "SIGSTKFLT", "pidfd_send_signal", "sigtimedwait",
                "sigwaitinfo")
MACOS_OS = ("sched_getaffinity", "sched_setaffinity", "pidfd_open", "pipe2", "memfd_create", "eventfd", "splice",
            "copy_file_range", "posix_fadvise", "getrandom", "prlimit")


def simulate(platform):
    """Pretend to be `platform` from here on. Modules that pick a native backend by platform at
    import time (subprocess, asyncio, psutil, ...) and ComfyUI's model stack, which imports them,
    are imported first, as the real ones: what is simulated is the import of the test modules."""
    import comfy.model_management  # noqa: F401
    import comfy.sd  # noqa: F401
    import folder_paths  # noqa: F401
    import asyncio  # noqa: F401
    import multiprocessing  # noqa: F401
    import pathlib  # noqa: F401
    import shutil  # noqa: F401
    import signal
    import subprocess  # noqa: F401,F811
    import tempfile  # noqa: F401
    if platform == "win32":
        gone_signal = [n for n in dir(signal) if not n.startswith("_") and n not in WINDOWS_SIGNAL]
        gone_os = WINDOWS_OS
    else:
        gone_signal, gone_os = MACOS_SIGNAL, MACOS_OS
    for name in gone_signal:
        if hasattr(signal, name):
            delattr(signal, name)
    for name in gone_os:
        if hasattr(os, name):
            delattr(os, name)
    sys.platform = platform


def child(platform):
    """In the tree (cwd): collect tests-unit, print one JSON line {collected, errors}."""
    sys.path.insert(0, os.getcwd())
    import torch
    if not torch.cuda.is_available():
        from comfy.cli_args import args
        args.cpu = True
    import pytest
    if platform != "linux":
        simulate(platform)
    # -s: pytest's fd capture would reach for Windows console APIs under a simulated win32
    argv = ["--collect-only", "-q", "-s", "-p", "no:cacheprovider", "tests-unit"]
    rc = pytest.main(argv)
    sys.stdout.flush()
    return rc


def is_ours(path, base):
    """A test file the series adds: in the patched tree, not in the base."""
    return not os.path.exists(os.path.join(base, path))


def collect(tree, platform):
    argv = [sys.executable, os.path.abspath(__file__), "--child", platform]
    out = subprocess.run(argv, cwd=tree, capture_output=True, text=True, timeout=900)
    text = out.stdout + out.stderr
    errors = sorted(set(re.findall(r"^ERROR (tests-unit/\S+)", text, re.M)))
    return {"exit": out.returncode, "errors": errors, "summary": (text.strip().splitlines() or [""])[-1]}, text


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        return child(sys.argv[2])
    if len(sys.argv) != 2:
        sys.exit("usage: python scripts/collect_as.py TREE")
    tree = os.path.abspath(sys.argv[1])
    sys.path.insert(0, os.path.join(ROOT, "patches"))
    import manifest
    base = manifest.comfyui_dir()
    ok = True
    for platform in ("linux", "win32", "darwin"):
        result, text = collect(tree, platform)
        mine = [e for e in result["errors"] if is_ours(e.split("::")[0], base)]
        theirs = [e for e in result["errors"] if e not in mine]
        collected = [line for line in text.splitlines() if "::" in line and is_ours(line.split("::")[0], base)]
        ok = ok and not mine and bool(collected)
        label = platform if platform == "linux" else f"{platform} (simulated)"
        print(f"collect_as {label}: {len(collected)} of our tests, {len(mine)} collection errors in our files; "
              f"ComfyUI's own: {len(theirs)} ({result['summary']})")
        for e in mine:
            print(f"  OUR ERROR: {e}")
            block = re.search(r"_+ ERROR collecting " + re.escape(e) + r" _+\n(.*?)(?=\n_{5,} |\n=+ )", text, re.S)
            if block:
                print("    " + "\n    ".join(block.group(1).strip().splitlines()[-6:]))
        if not collected:
            print("  none of our tests collected")
        for e in theirs:
            print(f"  ComfyUI's own (not ours): {e}")
    print(f"collect_as: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
