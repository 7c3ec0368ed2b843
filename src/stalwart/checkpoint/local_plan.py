"""The pure decisions of a resume with local or in-memory copies: which local iteration is
complete and who sends which shard to whom, and which copy of all (persistent, global
non-persistent, local, in-memory) every rank loads. Each rank calls them on the same gathered
reports, so every rank decides the same without another collective.

    >>> held = [Held(0, 8, 0, 2, "fully_parallel", "s", False, "/a"),
    ...         Held(0, 8, 1, 2, "fully_parallel", "s", False, "/b")]   # rank 0 holds both
    >>> plan, why = plan_local(held, world_size=2)
    >>> plan.iteration, [(t.owner, t.holder, t.receivers) for t in plan.transfers]
    (8, [(0, 0, (0, 1)), (1, 0, (0, 1))])
    >>> plan_local(held[:1], world_size=2)[1]
    "iteration 8 lacks rank 1's shard (no local directory holds it)"
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

FULLY_PARALLEL = "fully_parallel"
ATOMIC = "atomic"


class CopyKind(enum.Enum):
    """Where a resume's state comes from (the value reads in a log line)."""

    PERSISTENT = "persistent checkpoint"
    GLOBAL = "global non-persistent checkpoint"
    LOCAL = "local copy"
    IN_MEMORY = "in-memory snapshot"


@dataclass(frozen=True)
class Held:
    """A complete local shard that rank ``holder`` can read (its scan found it)."""

    holder: int
    iteration: int
    owner: int
    world_size: int
    algo: str
    save_id: str
    sharded: bool
    path: str


@dataclass(frozen=True)
class Transfer:
    """``holder`` reads ``owner``'s shard at ``path`` and sends it to ``receivers`` (itself
    included when it is one)."""

    owner: int
    holder: int
    path: str
    receivers: tuple[int, ...]


@dataclass(frozen=True)
class LocalPlan:
    """The newest complete local iteration and how its shards reach the ranks."""

    iteration: int
    saved_world: int
    algo: str
    transfers: tuple[Transfer, ...]
    skipped: tuple[str, ...] = ()  # why newer local iterations were not complete

    @property
    def replicas(self) -> list[Transfer]:
        """Shards served by a rank other than their owner (a replica, or a new world)."""
        return [t for t in self.transfers if t.holder != t.owner]


def source_owner(rank: int, saved_world: int) -> int:
    """The saved rank whose shard holds ``rank``'s per-rank state (rank 0's beyond the saved
    world: a job resumed on more ranks, as DCP's loads do)."""
    return rank if rank < saved_world else 0


def _receivers(owner: int, algo: str, saved_world: int, world_size: int) -> tuple[int, ...]:
    if algo == FULLY_PARALLEL:  # every rank needs every owner's part of the replicated state
        return tuple(range(world_size))
    return tuple(r for r in range(world_size) if source_owner(r, saved_world) == owner)


def _plan_one(shards: list[Held], world_size: int) -> tuple[LocalPlan | None, str | None]:
    first = shards[0]
    it, saved_world, algo = first.iteration, first.world_size, first.algo
    if any((s.world_size, s.algo) != (saved_world, algo) for s in shards):
        return None, f"iteration {it}: its shards disagree on the world size or algorithm"
    if algo not in (FULLY_PARALLEL, ATOMIC):
        return None, f"iteration {it}: unknown algorithm {algo[:40]!r}"
    if saved_world != world_size and any(s.sharded for s in shards):
        return None, (
            f"iteration {it} was saved by {saved_world} ranks with sharded "
            f"(FSDP2) state; this job has {world_size}"
        )
    holders: dict[int, list[Held]] = {o: [] for o in range(saved_world)}
    for shard in shards:
        holders[shard.owner].append(shard)
    missing = [o for o, found in holders.items() if not found]
    if missing:
        who = ", ".join(str(o) for o in missing[:8])
        return None, (
            f"iteration {it} lacks rank{'s' if len(missing) > 1 else ''} {who}'s "
            "shard (no local directory holds it)"
        )
    transfers = []
    for owner, found in holders.items():
        receivers = _receivers(owner, algo, saved_world, world_size)
        if not receivers:
            continue
        own = [s for s in found if s.holder == owner and owner < world_size]
        serving = own[0] if own else min(found, key=lambda s: (s.holder, s.path))
        transfers.append(Transfer(owner, serving.holder, serving.path, receivers))
    return LocalPlan(it, saved_world, algo, tuple(transfers)), None


def plan_local(held: Iterable[Held], world_size: int) -> tuple[LocalPlan | None, str | None]:
    """The newest complete local iteration (every saved rank's shard in some rank's directory,
    all of one save) and its transfers; else (None, why the newest one is not complete), or
    (None, None) when there is no local copy at all."""
    saves: dict[tuple[int, str], list[Held]] = {}
    for shard in held:
        saves.setdefault((shard.iteration, shard.save_id), []).append(shard)
    skipped: list[str] = []
    for key in sorted(saves, reverse=True):
        plan, why = _plan_one(sorted(saves[key], key=lambda s: (s.owner, s.holder)), world_size)
        if plan is not None:
            return LocalPlan(
                plan.iteration, plan.saved_world, plan.algo, plan.transfers, tuple(skipped)
            ), None
        skipped.append(why or "")
    return None, (skipped[0] if skipped else None)


def common_snapshot(reports: list[list[int]]) -> tuple[int | None, str | None]:
    """The newest in-memory snapshot iteration every rank holds; else (None, why)."""
    if not reports or not all(reports):
        return None, None if not any(reports) else "not every rank holds an in-memory snapshot"
    common = set(reports[0]).intersection(*map(set, reports[1:]))
    if not common:
        return None, "the ranks' in-memory snapshots are of different iterations"
    return max(common), None


@dataclass(frozen=True)
class ResumeChoice:
    """What every rank loads: ``kind`` and ``iteration``; ``detail`` says why (one line)."""

    kind: CopyKind
    iteration: int
    detail: str


# On a tie the cheapest copy wins: all hold the same state.
_PREFERENCE = (CopyKind.IN_MEMORY, CopyKind.LOCAL, CopyKind.PERSISTENT, CopyKind.GLOBAL)


def choose_copy(candidates: dict[CopyKind, int], notes: Iterable[str] = ()) -> ResumeChoice | None:
    """The newest of ``candidates`` (kind -> iteration); the detail names the others and
    ``notes`` (why a newer copy was not usable). None when there is none."""
    if not candidates:
        return None
    kind = max(candidates, key=lambda k: (candidates[k], -_PREFERENCE.index(k)))
    others = [f"the {k.value} of iteration {it}" for k, it in candidates.items() if k is not kind]
    parts = ([f"newest complete; also found {', '.join(others)}"] if others else []) + [
        n for n in notes if n
    ]
    detail = f"the {kind.value} of iteration {candidates[kind]}"
    return ResumeChoice(
        kind, candidates[kind], detail + (f" ({'; '.join(parts)})" if parts else "")
    )


__all__ = [
    "ATOMIC",
    "FULLY_PARALLEL",
    "CopyKind",
    "Held",
    "LocalPlan",
    "ResumeChoice",
    "Transfer",
    "choose_copy",
    "common_snapshot",
    "plan_local",
    "source_owner",
]
