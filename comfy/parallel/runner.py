"""Running one op on every rank, from rank 0: ``OpRunner.run`` and ``OpRunner.cancel``.

Workers do the mirror image in ``worker.py``. Group state goes through ``state.GroupCore``.
"""

import logging
import time
import traceback

import torch

from . import collectives, registry
from .errors import ParallelCancelled, ParallelGroupError, ParallelOpError, PreflightMismatch, RESTART_HINT
from .protocol import DEFAULT_LIMITS, canonical_json, check_manifest, request_digest
from .state import GroupState

logger = logging.getLogger(__name__)


class Inflight:
    """The op in flight, as rank 0 tracks it (``GroupCore.op``); the monitor fills ``replies``."""

    def __init__(self, op_id, name, timeout):
        self.id = op_id
        self.name = name
        self.timeout = timeout
        self.started = time.monotonic()
        self.deadline = self.started + timeout
        self.cancel_at = None
        self.replies = {}
        self.finished = False


class OpRunner:
    """Rank 0's side of an op. One op, in order::

        rank 0:  "run" frame to every worker (op id, name, meta, tensor manifest; signed)
        all:     preflight gather over the gloo control group (op id, request digest, status, cancel
                 flag): any disagreement raises PreflightMismatch on every rank, before any data moves
        all:     one broadcast of rank 0's tensors over the data group; fn(ctx, tensors, meta)
        workers: "result" frame (status, meta); rank 0 returns OpResult(its tensors, every rank's meta)

    Cancellation: ranks leave an op only where all of them take the same decision from the same
    collective (the preflight gather, ``ctx.cancelled()``), so no data collective is left half
    entered. An op that never checks finishes; one that does not reach a check within
    ``Timeouts.cancel`` has its late workers killed. After ``cancel()`` the op's ``run()`` always
    raises ``ParallelCancelled``; ``group_broken`` says whether the group survived. Any other
    exception on any rank breaks the group: the ranks may disagree on which collectives were issued.
    """

    def __init__(self, core, monitor, ctx):
        self._core = core
        self._monitor = monitor
        self.ctx = ctx
        self._op_id = 0

    def run(self, op_name, tensors, meta, timeout):
        """Run ``op_name`` on every rank; returns ``OpResult``.

        Raises ``PreflightMismatch`` (group stays ready), ``ParallelCancelled``, ``ParallelGroupError``
        / ``ParallelTimeout`` / ``ParallelOpError`` (group broken), or, before anything is sent,
        ``UnknownOpError`` / ``TypeError`` / ``ValueError`` for bad arguments.
        """
        core = self._core
        fn = registry.get_op(op_name)
        if not isinstance(tensors, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in tensors.items()):
            raise TypeError("tensors must be a dict of str -> torch.Tensor")
        if not isinstance(meta, dict):
            raise TypeError(f"meta must be a dict, got {type(meta).__name__}")
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        manifest = collectives.manifest_for(tensors)
        body = {"op": op_name, "meta": meta}
        size = len(_json(body, "meta"))
        limit = DEFAULT_LIMITS.max_header_bytes
        if size > limit - 1024:
            raise ValueError(f"meta is {size} bytes as JSON; the control-message limit is {limit} (send bulk data as tensors)")
        check_manifest(manifest)
        with core.send_lock:
            op = Inflight(self._op_id + 1, op_name, timeout)
            core.begin_op(op)
            self._op_id = op.id
            for w in core.workers:
                try:
                    w.send("run", op.id, body, manifest, timeout=min(5.0, timeout))
                except (OSError, TimeoutError) as e:
                    err = core.attribute(e, lambda e=e, w=w: ParallelGroupError(
                        f"could not send op {op.name!r} (id {op.id}) to worker rank {w.rank}: {e}", rank=w.rank,
                        log_tail=w.log_tail(), log_path=w.log_path))
                    core.end_op(op)
                    raise err from e
        try:
            return self._run(op, fn, tensors, meta, manifest, request_digest("run", op.id, body, manifest))
        finally:
            core.end_op(op)

    def cancel(self):
        """Ask the op in flight to stop; returns at once (True if an op was in flight). Thread-safe."""
        core = self._core
        with core.cond:
            op = core.op
            if core.state != GroupState.RUNNING or op is None or op.finished:
                return False
            if op.cancel_at is None:
                op.cancel_at = time.monotonic()
            core.cond.notify_all()
        with core.send_lock:
            if not op.finished:
                for w in core.workers:
                    try:
                        w.send("cancel", op.id, {}, timeout=1.0)
                    except (OSError, TimeoutError):
                        pass  # a worker that cannot take it is reported by the monitor or the cancel deadline
        logger.info("parallel group %r: cancel requested for op %r (id %d)", core.name, op.name, op.id)
        return True

    def _run(self, op, fn, tensors, meta, manifest, digest):
        core, ctx = self._core, self.ctx
        ctx.op_id, ctx.op_name = op.id, op.name
        ctx._cancel_requested = lambda: op.cancel_at is not None
        outcome, local_exc, out = "ok", None, None
        try:
            if collectives.op_preflight(op.id, op.name, digest, collectives.STATUS_OK, op.cancel_at is not None,
                                        ctx.control_group, ctx.world_size):
                raise ParallelCancelled(f"op {op.name!r} (id {op.id}) was cancelled before it started")
            placed = collectives.broadcast_inputs(manifest, tensors, ctx.device, ctx.data_group)
            out = fn(ctx, placed, meta)
        except ParallelCancelled as e:
            outcome, local_exc = "cancelled", e
        except PreflightMismatch as e:
            outcome, local_exc = "mismatch", e
        except BaseException as e:
            err = self._fault_for(op, e)
            if err is e:
                raise
            raise err from (err.__cause__ or e)
        finally:
            ctx.op_id = ctx.op_name = ctx._cancel_requested = None
        missing = lambda: [w.rank for w in core.workers if w.rank not in op.replies]
        deadline = lambda: op.cancel_at + core.timeouts.cancel if op.cancel_at is not None else op.deadline
        try:
            self._monitor.wait_until(lambda: not missing(), deadline, missing, f"op {op.name!r} (id {op.id})")
        except ParallelGroupError as e:
            raise self._as_cancel(op, e) from e
        statuses = {r: m.body["status"] for r, m in sorted(op.replies.items())}
        if any(s != outcome for s in statuses.values()):
            err = core.fault(ParallelGroupError(
                f"ranks left op {op.name!r} (id {op.id}) differently (rank 0: {outcome}, workers: {statuses}); an op must "
                "only stop at agreement points (ctx.cancelled(), ctx.preflight())", rank=0))
            raise self._as_cancel(op, err)
        if outcome == "mismatch":
            raise local_exc
        if outcome == "cancelled" or op.cancel_at is not None:
            raise ParallelCancelled(f"op {op.name!r} (id {op.id}) was cancelled; the group is ready for the next op")
        out_tensors, out_meta = registry.check_op_output(op.name, out)
        _json(out_meta, f"the meta returned by op {op.name!r} on rank 0")
        metas = [out_meta] + [op.replies[r].body.get("meta", {}) for r in sorted(op.replies)]
        return registry.OpResult(out_tensors, metas, op.id, time.monotonic() - op.started)

    def _fault_for(self, op, exc):
        """The error ``run()`` raises when rank 0 itself failed with ``exc`` inside op ``op``."""
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        err = self._core.attribute(exc, lambda: ParallelOpError(
            f"op {op.name!r} (id {op.id}) raised {type(exc).__name__} on rank 0: {exc}", rank=0, remote_traceback=tb,
            hint=f"fix the op or its inputs; the workers were stopped because collectives may be out of step, so {RESTART_HINT}"))
        if not isinstance(err, ParallelGroupError):
            return err
        return self._as_cancel(op, err)

    def _as_cancel(self, op, err):
        if op.cancel_at is None:
            return err
        exc = ParallelCancelled(f"op {op.name!r} (id {op.id}) was cancelled, but the group broke on the way out: "
                                f"{err.reason}; {RESTART_HINT}", group_broken=True)
        exc.__cause__ = err
        return exc


def _json(value, what):
    try:
        return canonical_json(value)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what} must be JSON-able (dicts, lists, str, numbers, bool, None; no NaN): {e}") from None
