"""One worker process as rank 0 sees it: the process, its two control pipes and its log.

A ``WorkerProcess`` is owned by one ``ParallelGroup``, the only one to signal or reap it. Each worker
runs in its own session, so a terminal's Ctrl-C reaches rank 0 alone; signals go to the worker's
whole process group, so anything an op started goes with it.
"""

import logging
import os
import signal
import subprocess
import sys

from .protocol import KINDS_FROM_WORKER, FrameReader, encode, write_all

logger = logging.getLogger(__name__)

LOG_TAIL_BYTES = 6000
LOG_TAIL_LINES = 40


def log_tail(path, max_bytes=LOG_TAIL_BYTES, max_lines=LOG_TAIL_LINES):
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return ""
    lines = data.decode("utf-8", "replace").splitlines()
    if size > max_bytes and lines:
        lines = lines[1:]
    return "\n".join(lines[-max_lines:])


class WorkerProcess:
    """Spawned by ``spawn``; ``send`` frames to it, ``read_available`` its replies, ``kill`` and ``reap`` it."""

    def __init__(self, rank, device, proc, cmd_fd, reply_fd, log_path, token):
        self.rank = rank
        self.device = device
        self.proc = proc
        self.cmd_fd = cmd_fd
        self.reply_fd = reply_fd
        self.log_path = log_path
        self._token = token
        self._reader = FrameReader(token, KINDS_FROM_WORKER)
        self._send_seq = 0
        self.eof = False
        self.exit_handled = False
        self.phase = "spawned"
        self.stopped_since = None

    @classmethod
    def spawn(cls, rank, device, log_path, env, token):
        """Start ``python -m comfy.parallel.worker`` with its two pipes; its output goes to ``log_path``.

        The log file is opened exclusively: an existing log is never overwritten.
        """
        cmd_r, cmd_w = os.pipe()
        reply_r, reply_w = os.pipe()
        try:
            with open(log_path, "xb") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "comfy.parallel.worker", "--rank", str(rank),
                     "--cmd-fd", str(cmd_r), "--reply-fd", str(reply_w), "--parent-pid", str(os.getpid())],
                    pass_fds=(cmd_r, reply_w), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    env=env, start_new_session=True, close_fds=True)
        except BaseException:
            os.close(cmd_w)
            os.close(reply_r)
            raise
        finally:
            os.close(cmd_r)
            os.close(reply_w)
        os.set_blocking(cmd_w, False)
        os.set_blocking(reply_r, False)
        logger.debug("spawned worker rank %d (pid %d) on %s, log %s", rank, proc.pid, device, log_path)
        return cls(rank, device, proc, cmd_w, reply_r, log_path, token)

    @property
    def pid(self):
        return self.proc.pid

    def send_token(self, timeout):
        write_all(self.cmd_fd, self._token, timeout)

    def send(self, kind, op_id, body, manifest=(), timeout=5.0):
        """Frame and write one message; TimeoutError if the worker does not drain its pipe in time."""
        if self.cmd_fd is None:
            raise BrokenPipeError(f"the control channel to worker rank {self.rank} is closed")
        self._send_seq += 1
        write_all(self.cmd_fd, encode(self._token, kind, self._send_seq, op_id, body, manifest), timeout)

    def read_available(self):
        """Replies readable now, in order; sets ``eof`` when the worker closed its end. Raises ProtocolError."""
        out = []
        while not self.eof:
            try:
                chunk = os.read(self.reply_fd, 1 << 16)
            except BlockingIOError:
                break
            except OSError:
                chunk = b""
            if not chunk:
                self.eof = True
                self._reader.close()
                break
            out.extend(self._reader.feed(chunk))
        return out

    def poll(self):
        return self.proc.poll()

    def is_stopped(self):
        """True while the process is stopped ('T': SIGSTOP and friends, 't': a tracer); False where
        /proc cannot tell."""
        try:
            with open(f"/proc/{self.proc.pid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            return False
        return stat[stat.rindex(b")") + 2:stat.rindex(b")") + 3] in (b"T", b"t")

    def wait(self, timeout):
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def signal(self, sig):
        """Signal the worker's process group (the worker and anything it started) while it is unreaped."""
        if self.proc.returncode is not None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass

    def kill(self):
        self.signal(signal.SIGKILL)

    def log_tail(self):
        return log_tail(self.log_path)

    def close_fds(self):
        for name in ("cmd_fd", "reply_fd"):
            fd = getattr(self, name)
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
                setattr(self, name, None)
