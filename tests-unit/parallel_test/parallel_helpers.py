"""Helpers shared by the parallel tests (a plain module: conftest modules are not importable by name)."""

import os
import socket
import struct
import time

OPS_MODULE = "parallel_ops_for_tests"


def spec(setup=None, **setup_args):
    """A worker spec that imports the test ops."""
    return {"imports": [OPS_MODULE], "setup": setup, "setup_args": setup_args}


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
