"""The fault-injection flags the scenarios pass to ``stalwart train``, and the watch that spots
a save inside its commit window (where a commit-phase hang holds it)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from stalwart.chaos.schedule import FaultPlan
from stalwart.checkpoint import layout


def error_injection(kind: str, plan: FaultPlan) -> list[str]:
    """The rerun machine's ``kind`` error at the plan's iteration and rank, every time."""
    return [
        "--error-injection-rate",
        "1",
        "--error-injection-type",
        kind,
        "--error-injection-iterations",
        str(plan.iteration),
        "--error-injection-ranks",
        str(plan.rank),
    ]


def inject(kind: str, plan: FaultPlan) -> list[str]:
    """``--inject-fault kind`` at the plan's iteration and rank."""
    return [
        "--inject-fault",
        kind,
        "--inject-fault-iteration",
        str(plan.iteration),
        "--inject-fault-rank",
        str(plan.rank),
    ]


def hold_in_commit(iteration: int, seconds: str) -> list[str]:
    """Rank 0 (the committing rank) sleeps ``seconds`` inside the commit of ``iteration``'s save."""
    return [
        "--inject-fault",
        "hang",
        "--inject-fault-phase",
        "commit",
        "--inject-fault-iteration",
        str(iteration),
        "--inject-fault-rank",
        "0",
        "--inject-fault-hang-seconds",
        seconds,
    ]


def in_commit(save: Path, iteration: int, previous: int) -> Callable[[], bool]:
    """True once the save of ``iteration`` is written but not committed: its temporary
    directory holds ``.metadata`` while the tracker still names ``previous``."""
    tracker = save / layout.TRACKER_FILENAME

    def written_not_committed() -> bool:
        written = list(save.glob(f"{layout.iteration_dir_name(iteration)}.tmp-*/.metadata"))
        return bool(written) and tracker.exists() and tracker.read_text().strip() == str(previous)

    return written_not_committed
