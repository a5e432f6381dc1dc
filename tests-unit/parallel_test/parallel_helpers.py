"""Helpers shared by the parallel tests (a plain module: conftest modules are not importable by name)."""

import os
import socket
import struct
import time

import sys
import threading
import traceback

import torch

OPS_MODULE = "parallel_ops_for_tests"
IMPORTS = [OPS_MODULE]


def assert_restart_works(g, world=2):
    g.close()
    assert g.state == "closed"
    g.start(["cpu"] * world, IMPORTS)
    assert g.run("test.echo", {"x": torch.arange(3)}).tensors["x"].tolist() == [0, 1, 2]
    g.close()


def blocked_threads():
    """Threads (other than this one) whose stack is inside torch.distributed or a control-pipe write."""
    out = []
    for ident, frame in sys._current_frames().items():
        if ident == threading.get_ident():
            continue
        stack = "".join(traceback.format_stack(frame))
        if "torch/distributed" in stack or "comfy/parallel/frames.py" in stack:
            out.append(stack)
    return out


class DeathClock:
    """Records when worker ``rank`` of ``g`` dies (polling /proc from a thread)."""

    def __init__(self, g, rank=1):
        self.at = None
        self._thread = threading.Thread(target=self._watch, args=(g, rank), daemon=True)
        self._thread.start()

    def _watch(self, g, rank):
        pid = None
        while pid is None:
            pid = g.worker_pids().get(rank)
            time.sleep(0.005)
        while not pid_gone(pid):
            time.sleep(0.005)
        self.at = time.monotonic()

    def join(self, timeout=30):
        self._thread.join(timeout)
        return self.at


def child_pids(parent=None):
    """PIDs whose parent is ``parent`` (default: this process), zombies included."""
    parent = parent or os.getpid()
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[1]) == parent:
            out.append(int(entry))
    return out


def pid_gone(pid):
    """True once ``pid`` has exited (a zombie counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2:].split()[0] in ("Z", "X")


def wait_until(predicate, timeout, interval=0.02):
    """Poll ``predicate`` until true or ``timeout`` seconds; returns the elapsed time or None."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if predicate():
            return time.monotonic() - t0
        time.sleep(interval)
    return None


def _decode_addr(hexaddr):
    host, port = hexaddr.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1]), int(port, 16)
    words = b"".join(struct.pack("<I", struct.unpack(">I", raw[i:i + 4])[0]) for i in range(0, 16, 4))
    return socket.inet_ntop(socket.AF_INET6, words), int(port, 16)


def listening_sockets(pids):
    """(address, port) of every listening TCP socket held by any of ``pids``."""
    inodes = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    out = []
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] == "0A" and cols[9] in inodes:
                out.append(_decode_addr(cols[1]))
    return out
