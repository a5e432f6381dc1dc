"""Rank 0's monitor thread: the only reader of the workers' reply pipes, and their watchdog.

It turns every way a worker can fail (exit, bad frame, op error, stop, missed deadline) into one
recorded fault (``GroupCore.fault``), which kills every worker and so ends any collective rank 0 waits in.
"""

import logging
import os
import select
import signal
import threading
import time

from .errors import ParallelGroupError, ParallelOpError, ParallelStateError, ParallelTimeout, ProtocolError, RESTART_HINT, describe_exit
from .state import ENDING

logger = logging.getLogger(__name__)

POLL = 0.1
STACK_DUMP_WAIT = 0.3
# how long a worker's op error waits for a peer's death to show (the same grace rank 0 gives its own errors)
FOLLOW_ON_GRACE = 0.5
_EXPECTED = {"spawned": "booted", "booted": "connected", "connected": "ready", "ready": "result"}
_STATUSES = ("ok", "cancelled", "mismatch", "error")


class Monitor:
    """Runs for the life of the workers; every ``POLL`` seconds, or as soon as a pipe is readable, it:

    * decodes replies (authenticated, in order), checks each is the one expected at that point and
      hands it to whoever waits (``wait_replies``, the op in flight's ``replies``);
    * notices a worker that exited (EOF or reaped: rank, exit code, log tail), that reported an op
      error, or that stays stopped longer than ``Timeouts.stopped``;
    * enforces the op and cancel deadlines: late workers dump their stacks into their logs (SIGUSR1 ->
      faulthandler; only after "booted", before that the signal's default action kills), then die.
    """

    def __init__(self, core):
        self._core = core
        self._cond = core.cond
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._loop, name=f"parallel-monitor-{core.name}", daemon=True)
        self._timeout_lock = threading.Lock()
        self.inbox = {}

    def start(self):
        self._thread.start()

    def stop(self):
        self._stop.set()
        self.wake()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def wake(self):
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass

    # -- waiting (called by rank 0's calling thread) ----------------------------------------------

    def wait_until(self, done, deadline, missing, what):
        """Block until ``done()`` (under the group lock), a fault, or ``deadline`` (then the ranks in
        ``missing()`` are dumped, killed and reported as ``ParallelTimeout``)."""
        core = self._core
        with self._cond:
            while True:
                if core.error is not None:
                    raise core.error
                if core.state in ENDING:
                    raise ParallelStateError(f"group {core.name!r} was closed during {what}", core.state)
                if done():
                    return
                left = deadline() - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, 0.25))
        raise self.timeout_fault(missing(), what)

    def wait_replies(self, kind, ranks, deadline, what):
        ranks = list(ranks)
        self.wait_until(lambda: all(kind in self.inbox.get(r, {}) for r in ranks), lambda: deadline,
                        lambda: [r for r in ranks if kind not in self.inbox.get(r, {})], what)
        return {r: self.inbox[r][kind] for r in ranks}

    def timeout_fault(self, ranks, what):
        """Record (once) that ``ranks`` missed the deadline of ``what``; returns the recorded fault."""
        core = self._core
        with self._timeout_lock:
            if core.error is not None:
                return core.error
            late = [w for w in core.workers if w.rank in ranks]
            booting = [w.rank for w in late if w.phase == "spawned"]
            dumping = [w for w in late if w.phase != "spawned" and w.poll() is None]
            for w in dumping:
                try:
                    w.proc.send_signal(signal.SIGUSR1)
                except ProcessLookupError:
                    pass
            if dumping:
                time.sleep(STACK_DUMP_WAIT)
            stacks = "their stacks at the deadline are in their logs"
            if booting:
                stacks = (f"rank(s) {booting} were still starting Python (no 'booted' reply yet), so their logs hold no "
                          "stack dump" + ("; the others' stacks at the deadline are in their logs" if dumping else ""))
            first = late[0] if late else None
            err = ParallelTimeout(
                f"worker rank(s) {sorted(ranks)} did not finish {what}; they were killed ({stacks})",
                rank=first.rank if first else None, log_tail=first.log_tail() if first else "",
                log_path=first.log_path if first else None,
                hint="raise the matching Timeouts setting if the work is legitimately slow; otherwise look for a hang "
                     f"in the stack above; then {RESTART_HINT}")
            return core.fault(err)

    # -- the thread ------------------------------------------------------------------------------

    def _loop(self):
        try:
            while not self._stop.is_set():
                self._step()
        except Exception as e:
            logger.exception("parallel monitor of %r failed", self._core.name)
            self._core.fault(ParallelGroupError(f"rank 0's monitor thread failed: {e!r}", rank=0))

    def _step(self):
        workers = {w.reply_fd: w for w in self._core.workers if not w.eof and w.reply_fd is not None}
        try:
            readable, _, _ = select.select([*workers, self._wake_r], [], [], POLL)
        except (OSError, ValueError):
            if self._stop.is_set():
                return
            raise
        if self._wake_r in readable:
            try:
                os.read(self._wake_r, 4096)
            except (BlockingIOError, OSError):
                pass
        for fd in readable:
            w = workers.get(fd)
            if w is None:
                continue
            try:
                messages = w.read_available()
            except ProtocolError as e:
                if w.wait(1.0) is not None:
                    self._on_exit(w)
                else:
                    self._core.fault(ParallelGroupError(
                        f"rank 0 rejected a control message from worker rank {w.rank}: {e}", rank=w.rank,
                        log_tail=w.log_tail(), log_path=w.log_path))
                continue
            for m in messages:
                self._on_message(w, m)
        for w in list(self._core.workers):
            if not w.exit_handled and (w.eof or w.poll() is not None):
                self._on_exit(w)
        self._check_stopped()
        self._check_deadline()

    def _on_message(self, w, m):
        core = self._core
        expected = _EXPECTED[w.phase]
        op = core.op
        problem = None
        if m.kind != expected:
            problem = f"sent a {m.kind!r} message where {expected!r} was expected"
        elif m.kind == "result":
            if op is None or m.id != op.id or w.rank in op.replies:
                problem = f"sent a result for op {m.id}, but op {op.id if op else None} is in flight"
            elif m.body.get("status") not in _STATUSES or not isinstance(m.body.get("meta", {}), dict):
                problem = f"sent a malformed result {m.body!r:.200}"
        if problem:
            core.fault(ParallelGroupError(f"worker rank {w.rank} {problem}; the control streams are out of step",
                                               rank=w.rank, log_tail=w.log_tail(), log_path=w.log_path))
            return
        with self._cond:
            if m.kind == "result":
                op.replies[w.rank] = m
            else:
                w.phase = m.kind
                self.inbox.setdefault(w.rank, {})[m.kind] = m
            self._cond.notify_all()
        if m.kind == "result" and m.body["status"] == "error":
            # a peer's death reaches the other workers as a transport error in their collective, often
            # before its exit is reaped here: a worker that died meanwhile is the cause, not this report
            dead = self._dead_peer(w, FOLLOW_ON_GRACE)
            if dead is not None:
                self._on_exit(dead)
            e = m.body.get("error") or {}
            core.fault(ParallelOpError(
                f"op {op.name!r} (id {op.id}) raised {e.get('type', 'an error')} on worker rank {w.rank}: {e.get('message', '')}",
                rank=w.rank, remote_traceback=e.get("traceback", ""), log_path=w.log_path,
                hint="fix the op or its inputs; after a failure on some ranks collectives may be out of step, so "
                     + RESTART_HINT))

    def _dead_peer(self, reporter, grace):
        """A worker other than ``reporter`` that exits within ``grace`` seconds, else None."""
        end = time.monotonic() + grace
        while True:
            for w in self._core.workers:
                if w is not reporter and not w.exit_handled and w.poll() is not None:
                    return w
            if time.monotonic() >= end:
                return None
            time.sleep(0.02)

    def _on_exit(self, w):
        code = w.wait(2.0)
        w.exit_handled = True
        core = self._core
        with self._cond:
            quiet = core.state in ENDING or core.error is not None
            op = core.op
            if w.phase != "ready":
                when = f"during start-up (after '{w.phase}')"
            elif op is not None and w.rank not in op.replies:
                when = f"during op {op.name!r} (id {op.id})"
            else:
                when = "while the group was idle"
        if quiet:
            return
        what = describe_exit(code) if code is not None else "closed its control channel but has not exited"
        core.fault(ParallelGroupError(f"worker rank {w.rank} (pid {w.pid}, {w.device}) {what} {when}", rank=w.rank,
                                           exitcode=code, log_tail=w.log_tail(), log_path=w.log_path))

    def _check_stopped(self):
        core = self._core
        now = time.monotonic()
        for w in list(core.workers):
            if w.exit_handled or not w.is_stopped():
                w.stopped_since = None
            elif w.stopped_since is None:
                w.stopped_since = now
            elif now - w.stopped_since > core.timeouts.stopped and core.error is None:
                core.fault(ParallelGroupError(
                    f"worker rank {w.rank} (pid {w.pid}, {w.device}) is stopped (SIGSTOP?) and stayed stopped for more "
                    f"than {core.timeouts.stopped:g}s (Timeouts.stopped); it was killed", rank=w.rank,
                    log_tail=w.log_tail(), log_path=w.log_path,
                    hint=f"find what stopped it (a debugger, a job-control signal, a container freezer); then {RESTART_HINT}"))

    def _check_deadline(self):
        core = self._core
        op = core.op
        if op is None or op.finished or core.error is not None:
            return
        missing = [w.rank for w in core.workers if w.rank not in op.replies]
        if not missing:
            return
        now = time.monotonic()
        if op.cancel_at is not None and now > op.cancel_at + core.timeouts.cancel:
            self.timeout_fault(missing, f"acknowledging cancel of op {op.name!r} (id {op.id}) within {core.timeouts.cancel:g}s")
        elif now > op.deadline:
            self.timeout_fault(missing, f"op {op.name!r} (id {op.id}) within its {op.timeout:g}s timeout")
