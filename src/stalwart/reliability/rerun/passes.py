"""What the rerun state machine keeps per pass: the records and the state saved before it (and
:class:`StateSaver`, which saves and restores it). Nothing here talks to other ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from stalwart.reliability.rerun.checks.rules import ValidationRecord
from stalwart.reliability.rerun.rng import RngStateTracker
from stalwart.reliability.rerun.types import CallKey
from stalwart.rng_state import capture_rng_state, restore_rng_state


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


class StateSaver:
    """Saves and restores what a rerun puts back: every RNG of ``rng``, the caller's extra
    state (``save`` / ``restore``, e.g. a loss scaler) and the device large-value windows
    (``save_trackers`` / ``restore_trackers``, the recorder's)."""

    def __init__(
        self,
        rng: RngStateTracker,
        save: Callable[[], Any] | None,
        restore: Callable[[Any], None] | None,
        save_trackers: Callable[[], dict[str, torch.Tensor]],
        restore_trackers: Callable[[dict[str, torch.Tensor]], None],
    ) -> None:
        self.rng = rng
        self._save = save
        self._restore = restore
        self._save_trackers = save_trackers
        self.restore_trackers = restore_trackers

    def capture(self) -> Saved:
        extra = self._save() if self._save is not None else None
        trackers = self._save_trackers()
        return Saved(capture_rng_state(self.rng), extra, trackers)

    def restore_rng(self, saved: Saved) -> None:
        restore_rng_state(saved.rng, self.rng)

    def restore(self, saved: Saved | None) -> None:
        if saved is None:
            return
        restore_rng_state(saved.rng, self.rng)
        if saved.extra is not None and self._restore is not None:
            self._restore(saved.extra)
        self.restore_trackers(saved.trackers)
