"""What the rerun state machine keeps per pass: the records, the state saved before it, and the
pass begun *ahead* (the next iteration's first work, launched before this pass was read).

Split from ``machine.py`` to keep files small; nothing here talks to other ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from stalwart.reliability.rerun.buffer import ValidationRecord
from stalwart.reliability.rerun.types import CallKey


@dataclass
class Saved:
    """State put back before a rerun: every RNG, the caller's extra state (loss scaler) and
    the device large-value trackers."""

    rng: dict[str, Any]
    extra: Any
    trackers: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class Records:
    """The host-evaluated records of one pass and its per-message call counters."""

    pending: list[ValidationRecord] = field(default_factory=list)
    seq: dict[tuple[str, str], int] = field(default_factory=dict)

    def next_key(self, scope: str, message: str) -> CallKey:
        seq = self.seq.get((scope, message), 0) + 1
        self.seq[(scope, message)] = seq
        return scope, message, seq

    @property
    def host_evaluated(self) -> bool:
        """Whether a record of this pass needs the host to decide (no device verdict)."""
        return bool(self.pending)


@dataclass
class Ahead:
    """The initial pass of ``iteration``, begun before the previous pass was read.

    ``saved`` was captured when it began (before any of its work), so it is exactly what the
    machine would have saved at the start of that iteration.
    """

    iteration: int
    saved: Saved
    records: Records = field(default_factory=Records)
