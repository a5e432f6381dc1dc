"""torch.distributed set-up shared by rank 0 and the workers: store, groups, teardown, ownership.

torch.distributed's default group is process-global, so at most one ``ParallelGroup`` per process
may hold it (``claim`` / ``release``).
"""

import datetime
import logging
import threading

import torch.distributed as dist

from .errors import ParallelStateError

logger = logging.getLogger(__name__)

_slot_lock = threading.Lock()
_holder = [None]


def claim(group):
    """Make ``group`` the process's owner of torch.distributed, or raise naming the current owner."""
    if not dist.is_available():
        raise ParallelStateError("this torch build has no torch.distributed; a parallel group needs it", group.state)
    with _slot_lock:
        holder = _holder[0]
        if holder is not None and holder is not group:
            raise ParallelStateError(
                f"cannot start group {group.name!r}: group {holder.name!r} (state {holder.state}, {holder.world_size} ranks) "
                "is active in this process and torch.distributed's default process group is process-global; "
                f"close() group {holder.name!r} first", group.state)
        if dist.is_initialized():
            raise ParallelStateError(
                "torch.distributed's default process group is already initialized by other code in this process; "
                "ParallelGroup must own it: call torch.distributed.destroy_process_group() first", group.state)
        _holder[0] = group


def release(group):
    with _slot_lock:
        if _holder[0] is group:
            _holder[0] = None


def file_store(path, world_size, timeout):
    """The rendezvous store: a FileStore at ``path``, which the last of ``world_size`` users removes.

    Rank 0 puts it in a private (0700) folder: unlike a TCPStore there is no port another local user
    could list, write junk into or flood with connections. The workers get its path over their pipe.
    """
    store = dist.FileStore(path, world_size)
    store.set_timeout(datetime.timedelta(seconds=timeout))
    return store


def init_groups(backend, store, rank, world_size, device, timeouts):
    """Join the default (data) group and create the gloo control group; returns the control group.

    The data group is NCCL for CUDA, gloo for CPU; the control group carries the small agreements
    (preflight, cancel) so that they never queue behind NCCL kernels. The rendezvous is bounded by ``timeouts.rendezvous``; afterwards every collective of both
    groups by ``timeouts.collective`` (a backstop: ParallelGroup's own deadlines come first).
    """
    rendezvous = datetime.timedelta(seconds=timeouts["rendezvous"])
    _restore_group_counter()
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=rendezvous,
                            device_id=device if device.type == "cuda" else None, pg_options=data_group_options(backend, rendezvous))
    collective = datetime.timedelta(seconds=timeouts["collective"])
    control = dist.new_group(backend="gloo", timeout=collective)
    if hasattr(dist.distributed_c10d, "_set_pg_timeout"):
        dist.distributed_c10d._set_pg_timeout(collective, None)
    return control


def _restore_group_counter():
    """Put torch's group counter back to 0 when no process group exists, as destroy_process_group() does.

    torch names the default group (and so prefixes every rendezvous key) after a process-wide counter
    that ``init_process_group`` advances first and only ``destroy_process_group`` resets. When the
    rendezvous fails (a peer died, hung or wrote garbage), no group exists to destroy and the counter
    stays advanced: this process would then wait for keys "1/..." while fresh workers publish "0/...",
    and every later start would time out. Before any init no group exists (``claim`` checked), so 0 is
    the value torch itself would have.
    """
    world = getattr(dist.distributed_c10d, "_world", None)
    if not dist.is_initialized() and getattr(world, "group_count", 0):
        logger.info("resetting torch.distributed's group counter (%d) left by a failed rendezvous", world.group_count)
        world.group_count = 0


def data_group_options(backend, timeout):
    """NCCL on high-priority CUDA streams, else the defaults (None). ``timeout``: the group's timeout
    (torch warns when the options carry another one than init_process_group's).

    Sequence-parallel attention issues each all-to-all and then, on the compute stream, the next
    chunk's kernels; at normal priority those kernels' waiting blocks take the SMs first and the
    transfer starts only as they drain.
    """
    if backend != "nccl":
        return None
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = True
    options._timeout = timeout
    return options


def destroy_groups(abort):
    """Destroy every process group of this process; ``abort`` after a fault (NCCL may wait on a dead peer)."""
    if not dist.is_initialized():
        return
    try:
        if abort and dist.get_backend() == "nccl" and hasattr(dist.distributed_c10d, "_abort_process_group"):
            dist.distributed_c10d._abort_process_group()
        else:
            dist.destroy_process_group()
    except Exception:
        logger.exception("destroying the process groups failed")
