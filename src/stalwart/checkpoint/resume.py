"""The one decision of a resume when a `CheckpointManager` also keeps local or in-memory copies:
every rank sends what it found (rank 0: the persistent or global checkpoint its trackers name;
every rank: the copies it can read) in one all-gather, then every rank makes the same pure
choice (`stalwart.checkpoint.local_plan.choose_copy`): the newest complete iteration wins.

`CopyTier` is what the manager needs of such copies (`stalwart.checkpoint.local.LocalCheckpoints`
and `stalwart.checkpoint.in_memory.InMemorySnapshots` are the two).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from torch import nn
from torch.optim import Optimizer

from stalwart.checkpoint.errors import CheckpointError
from stalwart.checkpoint.loading import Choice
from stalwart.checkpoint.local import TierPlan
from stalwart.checkpoint.local_plan import CopyKind, ResumeChoice, choose_copy
from stalwart.distributed import collectives


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


def decide(
    disk_decision: tuple[Choice | None, str | None],
    tier: CopyTier,
    group: Any,
    rejected: set[str],
) -> CopyChoice | None:
    """Gather every rank's findings (one collective) and choose (see module docstring).
    ``disk_decision``: rank 0's (choice, error); the other ranks' is ignored.

    Raises:
        CheckpointError: rank 0's error (an explicit ``--load`` without a checkpoint, ...).
    """
    gathered = collectives.all_gather_objects((disk_decision, tier.report()), group)
    disk, error = gathered[0][0]  # type: ignore[index]
    if error is not None:
        raise CheckpointError(str(error))
    offer = tier.plan([g[1] for g in gathered], _excluded(tier.kind, rejected))  # type: ignore[index]
    candidates: dict[CopyKind, int] = {}
    if disk is not None:
        candidates[CopyKind.GLOBAL if disk.non_persistent else CopyKind.PERSISTENT] = disk.iteration
    if offer.iteration is not None:
        candidates[tier.kind] = offer.iteration
    notes = [f"{tier.kind.value}s: {offer.why}"] if offer.why else []
    resume = choose_copy(candidates, notes)
    if resume is not None and resume.kind is tier.kind and offer.where:
        resume = choose_copy(candidates, [*notes, offer.where])
    return None if resume is None else CopyChoice(resume, disk, offer)


def log_choice(choice: CopyChoice, log: logging.Logger) -> None:
    """Rank 0's one line: which copy every rank loads, and why."""
    log.info("resuming from %s", choice.resume.detail)


__all__ = ["CopyChoice", "CopyTier", "decide", "log_choice"]
