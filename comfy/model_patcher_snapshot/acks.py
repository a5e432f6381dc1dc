"""Acknowledging patch snapshots: what a rank reports once its ModelPatcher holds one, and the gate
that no denoising starts before every rank acknowledged the version rank 0 holds (``require_acks``).
"""

import dataclasses


from .codec import is_digest


class SnapshotApplyError(RuntimeError):
    """A snapshot could not be applied. The message says which state the model was left in: its previous
    snapshot (refused before any write), its base weights (rolled back), or undefined (rebuild it)."""


class SnapshotNotAcked(RuntimeError):
    """Some rank has not acknowledged the current snapshot version."""


@dataclasses.dataclass(frozen=True)
class SnapshotAck:
    """What a rank reports after applying a snapshot. JSON-able through ``to_json`` / ``from_json``."""

    rank: int
    lineage: int
    digest: str
    key_count: int

    @property
    def version(self):
        return (self.lineage, self.digest)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, obj) -> "SnapshotAck":
        fields = ("digest", "key_count", "lineage", "rank")
        if not isinstance(obj, dict) or sorted(obj) != list(fields):
            raise ValueError(f"snapshot ack must be an object with exactly the fields {fields}, got {obj!r}")
        for f in ("rank", "lineage", "key_count"):
            if type(obj[f]) is not int or obj[f] < 0:
                raise ValueError(f"snapshot ack field {f!r} must be a non-negative int, got {obj[f]!r}")
        if not is_digest(obj["digest"]):
            raise ValueError(f"snapshot ack digest must be 64 lowercase hex digits, got {obj['digest']!r}")
        return cls(**obj)


def require_acks(snapshot, acks, world_size: int) -> None:
    """Raise ``SnapshotNotAcked`` unless ranks 0..world_size-1 each acked exactly ``snapshot``'s version."""
    by_rank = {}
    for ack in acks:
        by_rank.setdefault(ack.rank, []).append(ack)
    problems = []
    for rank in range(world_size):
        got = by_rank.get(rank, [])
        if not got:
            problems.append(f"rank {rank}: no ack")
            continue
        ack = got[-1]
        if ack.version != snapshot.version:
            problems.append(f"rank {rank}: acked version {ack.lineage}/{ack.digest[:12]}")
        elif ack.key_count != snapshot.key_count:
            problems.append(f"rank {rank}: acked {ack.key_count} patched keys, the snapshot has {snapshot.key_count}")
    extra = sorted(r for r in by_rank if not 0 <= r < world_size)
    if extra:
        problems.append(f"acks from ranks {extra} outside a world of {world_size}")
    if problems:
        raise SnapshotNotAcked(f"refusing to run: not every rank holds patch snapshot version "
                               f"{snapshot.lineage}/{snapshot.digest[:12]} ({'; '.join(problems)}); "
                               "send that snapshot to the listed ranks and wait for their acks")
