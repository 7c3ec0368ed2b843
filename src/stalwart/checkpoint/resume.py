"""The one decision of a resume when a `CheckpointManager` also keeps local or in-memory copies:
every rank sends what it found (rank 0: the newest iteration its trackers name; every rank: the
copies it can read) in one all-gather, then every rank makes the same pure choice
(`stalwart.checkpoint.local_plan.choose_copy`): the newest complete iteration wins. A copy at
least as new as the trackers' wins without a file of a checkpoint directory being read (an
in-process restart from memory reads none); otherwise rank 0 checks the directories' choice as
a resume without copies does and broadcasts it (a second collective).

`CopyTier` is what the manager needs of such copies (`stalwart.checkpoint.local.LocalCheckpoints`
and `stalwart.checkpoint.in_memory.InMemorySnapshots` are the two).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast

from torch import nn
from torch.optim import Optimizer

from stalwart.checkpoint import layout
from stalwart.checkpoint.errors import CheckpointError
from stalwart.checkpoint.loading import (
    CheckpointLocator,
    Choice,
    LoadedCheckpoint,
    nothing_to_load,
)
from stalwart.checkpoint.local import TierPlan
from stalwart.checkpoint.local_plan import CopyKind, ResumeChoice, choose_copy
from stalwart.distributed import collectives
from stalwart.log_notice import NOTICE

logger = logging.getLogger("stalwart.checkpoint")


class CopyTier(Protocol):
    """Copies a manager saves and resumes from besides its directories (see module docstring)."""

    kind: CopyKind

    def bind(self, process_group: Any) -> None: ...

    def check_writable(self) -> None: ...

    def save(
        self,
        iteration: int,
        state: dict[str, Any],
        common: dict[str, Any],
        per_rank: dict[str, Any],
    ) -> None: ...

    def maybe_finalize(self, blocking: bool = False) -> int | None: ...

    def report(self) -> Any: ...

    def plan(self, reports: list[Any], exclude: set[int]) -> TierPlan: ...

    def load(
        self,
        plan: Any,
        model: nn.Module,
        optimizer: Optimizer | None,
        *,
        strict: bool,
        check_common: Callable[[dict[str, Any]], None] | None,
    ) -> tuple[str | None, tuple[dict[str, Any], dict[str, Any] | None, int] | None]: ...

    def close(self, *, abort: bool = False) -> None: ...


@dataclass(frozen=True)
class CopyChoice:
    """What every rank loads: ``resume`` says which copy and why; ``disk`` is the checkpoint
    directory when that is it, ``offer`` the tier's plan when the tier's copy is."""

    resume: ResumeChoice
    disk: Choice | None
    offer: TierPlan

    @property
    def from_tier(self) -> bool:
        return self.resume.kind in (CopyKind.LOCAL, CopyKind.IN_MEMORY)

    def rejected_key(self) -> str:
        """How a failed load of this choice is remembered (the next decision skips it)."""
        if self.disk is not None and not self.from_tier:
            return self.disk.path
        return f"{self.resume.kind.name}:{self.resume.iteration}"


def _excluded(kind: CopyKind, rejected: set[str]) -> set[int]:
    prefix = f"{kind.name}:"
    return {int(key[len(prefix) :]) for key in rejected if key.startswith(prefix)}


DiskDecision = tuple[Choice | None, str | None]  # rank 0's (choice, error)


def tracked_head(roots: list[tuple[str | None, bool]]) -> tuple[int, bool] | str | None:
    """The newest iteration a tracker of ``roots`` ((directory, non-persistent) pairs) names
    with its ``COMPLETE`` marker there, and whether it is non-persistent; only the trackers are
    read, no file of a checkpoint. None: no tracker; a string: a tracker is unreadable."""
    found: list[tuple[int, bool]] = []
    for root, non_persistent in roots:
        if root is None:
            continue
        try:
            tracked = layout.read_tracker(root)
        except CheckpointError as exc:
            return str(exc)
        if tracked is not None and layout.is_complete(
            os.path.join(root, layout.iteration_dir_name(tracked))
        ):
            found.append((tracked, non_persistent))
    # The newest; the persistent one on a tie.
    return max(found, key=lambda f: (f[0], not f[1])) if found else None


def decide(
    tier: CopyTier,
    roots: list[tuple[str | None, bool]],
    disk_decision: Callable[[], DiskDecision],
    group: Any,
    ranks: tuple[int, int],
    rejected: set[str],
) -> CopyChoice | None:
    """Gather rank 0's :func:`tracked_head` of ``roots`` and every rank's copies in one
    collective. When a copy is at least as new, every rank takes it and no checkpoint
    directory is read; else rank 0's ``disk_decision()`` (the checked choice among the
    directories) is broadcast and the newest of the two wins (see module docstring). Rank 0
    logs the choice. ``ranks``: this rank in ``group`` and the global rank of its rank 0; after
    a failed load (``rejected``) the directories are always checked.

    Raises:
        CheckpointError: rank 0's error (an explicit ``--load`` without a checkpoint, ...).
    """
    head = tracked_head(roots) if ranks[0] == 0 and not rejected else "checked"
    gathered = collectives.all_gather_objects((head, tier.report()), group)
    head = gathered[0][0]  # type: ignore[index]
    reports = [g[1] for g in gathered]  # type: ignore[index]
    offer = tier.plan(reports, _excluded(tier.kind, rejected))
    candidates: dict[CopyKind, int] = {}
    newest = offer.iteration is not None and (
        head is None or (not isinstance(head, str) and offer.iteration >= head[0])
    )
    disk = None
    if newest and isinstance(head, tuple):
        candidates[_disk_kind(head[1])] = head[0]
    elif not newest:
        mine = disk_decision() if ranks[0] == 0 else None
        outcome = collectives.broadcast_object(mine, ranks[1], group)
        disk, error = cast(DiskDecision, outcome)
        if error is not None:
            raise CheckpointError(str(error))
        if disk is not None:
            candidates[_disk_kind(disk.non_persistent)] = disk.iteration
    if offer.iteration is not None:
        candidates[tier.kind] = offer.iteration
    picked = _choose(tier.kind, candidates, offer, disk)
    if picked is not None and ranks[0] == 0:
        # Shown by default: which copy a restart trusted, and why not a newer one.
        logger.info("resuming from %s", picked.resume.detail, extra=NOTICE)
    return picked


def _disk_kind(non_persistent: bool) -> CopyKind:
    return CopyKind.GLOBAL if non_persistent else CopyKind.PERSISTENT


def _choose(
    kind: CopyKind, candidates: dict[CopyKind, int], offer: TierPlan, disk: Choice | None
) -> CopyChoice | None:
    notes = [f"not the {kind.value}: {offer.why}"] if offer.why else []
    resume = choose_copy(candidates, notes)
    if resume is not None and resume.kind is kind and offer.where:
        resume = choose_copy(candidates, [*notes, offer.where])
    return None if resume is None else CopyChoice(resume, disk, offer)


def load_copy(
    choice: CopyChoice,
    load: Callable[..., tuple[str | None, tuple[Any, Any, int] | None]],
    model: nn.Module,
    optimizer: Optimizer | None,
    load_dir: str | None,
) -> tuple[str | None, LoadedCheckpoint | None]:
    """``load(plan, model, optimizer)`` (the tier's, collective) as a `LoadedCheckpoint` whose
    ``path`` names the iteration under ``load_dir`` (where its rerun verdict would be) and whose
    ``source`` says which copy it is."""
    problem, small = load(choice.offer.plan, model, optimizer)
    if problem is not None or small is None:
        return problem, None
    it = choice.resume.iteration
    path = os.path.join(load_dir or "", layout.iteration_dir_name(it))
    source = f"the {choice.resume.kind.value} of iteration {it}"
    return None, LoadedCheckpoint(it, path, *small, True, source=source)


@dataclass(frozen=True)
class Roots:
    """The directories a manager resumes from: ``--load`` (persistent), the global
    non-persistent one, and whether ``--load`` was named apart from ``--save``."""

    load_dir: str | None
    np_dir: str | None
    load_explicit: bool


@dataclass(frozen=True)
class Decider:
    """A `CheckpointManager`'s choice of what to load (collective): among its directories
    (rank 0 decides and broadcasts), or with ``copies``, :func:`decide`."""

    roots: Roots
    locator: CheckpointLocator
    copies: CopyTier | None
    group: Any

    def decide(
        self, iteration: int | None, rejected: set[str], rank: int, src: int
    ) -> Choice | CopyChoice | None:
        """``rank``: this rank in the group; ``src``: the global rank of the group's rank 0.

        Raises:
            CheckpointError: on every rank, rank 0's error.
        """
        if self.copies is not None and iteration is None:
            return self._with_copies(rejected, rank, src)
        mine = self._disk(iteration, rejected, True) if rank == 0 else None
        choice, error = cast(DiskDecision, collectives.broadcast_object(mine, src, self.group))
        if error is not None:
            raise CheckpointError(error)
        return choice

    def _disk(
        self, iteration: int | None, rejected: set[str], fresh_start_note: bool
    ) -> DiskDecision:
        """Rank 0's checked choice among the directories, or the error to raise everywhere."""
        roots = self.roots
        try:
            choice = self.locator.choose(iteration, rejected, logger)
            if choice is None and not rejected and (fresh_start_note or roots.load_explicit):
                nothing_to_load(roots.load_dir, roots.load_explicit, logger)
            return choice, None
        except CheckpointError as exc:
            return None, str(exc)

    def _with_copies(self, rejected: set[str], rank: int, src: int) -> CopyChoice | None:
        assert self.copies is not None
        roots = self.roots
        picked = decide(
            self.copies,
            [(roots.load_dir, False), (roots.np_dir, True)],
            lambda: self._disk(None, rejected, False),
            self.group,
            (rank, src),
            rejected,
        )
        if rank == 0 and picked is None and not rejected and not roots.load_explicit:
            nothing_to_load(roots.load_dir, roots.load_explicit, logger)  # the fresh start line
        return picked


__all__ = [
    "CopyChoice",
    "CopyTier",
    "Decider",
    "Roots",
    "decide",
    "load_copy",
    "tracked_head",
]
