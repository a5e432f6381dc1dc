"""Helpers shared by the parallel tests (a plain module: conftest modules are not importable by name)."""

import os
import time

OPS_MODULE = "parallel_ops_for_tests"
IMPORTS = [OPS_MODULE]


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


def sockets(pids):
    """{pid: [socket inode, ...]} of every socket any of ``pids`` holds."""
    out = {}
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                out.setdefault(pid, []).append(link[8:-1])
    return out


def listening(inodes):
    """The rows of /proc/net/{tcp,tcp6,udp,udp6,unix} that listen (or are bound) on one of ``inodes``."""
    found = []
    for name, inode_col in (("tcp", 9), ("tcp6", 9), ("udp", 9), ("udp6", 9), ("unix", 6)):
        try:
            with open(f"/proc/net/{name}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > inode_col and cols[inode_col] in inodes:
                found.append((name, row))
    return found
