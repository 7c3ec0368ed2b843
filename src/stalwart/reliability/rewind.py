"""Spike rewind (``--rewind-on-spike``): what a rewind does, as pure decisions and its record.

A loss spike that the rerun reproduces (on a peer replica, or in place when the job has none)
is the data's, not the hardware's: training on it, as Megatron does, can derail the run, and
rerunning it elsewhere gives the same spike. PaLM's answer, done by hand about 20 times: go back
to a checkpoint before the spike and skip the batches around it. Here the rerun machine ends the
spiking iteration untrained with a :class:`~stalwart.reliability.rerun.types.SpikeRewind`
verdict and the loop (``stalwart.loop.Shell``; the work is ``stalwart.loop.rewind``):

1. restores its newest snapshot (``Checkpointer.load``: persistent, non-persistent or local
   copy, whichever is newest; none yet: the iteration's start, already restored);
2. skips the window of ``--rewind-skip-window`` iterations from the spiking one on
   (:func:`skip_window`; a stretch of bad data spikes at its first batch): each is consumed
   without training, as ``--iterations-to-skip`` does, and recorded in the tracker file (status
   ``rewind_skipped``) so that a relaunch skips it too; the iterations between the snapshot
   and the spike are trained again;
3. from the restored iteration on, multiplies the learning rate by ``--rewind-lr-scale`` per
   rewind (:func:`lr_scale_at`: a function of the records, so a relaunch scales alike);
4. counts the rewind: ``--max-rewinds`` per run (the tracker file's count across relaunches);
   a spike after the last one trains on, as without rewinds.

A rewind to a snapshot with ``c`` completed iterations of a spike at iteration ``k`` (as
logged) ends the run bitwise equal to a run that skipped the same window from the start
(without ``--rewind-lr-scale``): iterations ``c + 1`` to ``k - 1`` are trained again from the
same state, data and RNG.

    >>> skip_window(spike=12, window=3)
    (12, 14)
    >>> records = [RewindRecord(spike=12, restored=8, first=12, last=14)]
    >>> lr_scale_at(8, records, 0.5), lr_scale_at(9, records, 0.5)
    (1.0, 0.5)
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass

from stalwart.reliability.rerun.tracker import read_status_lines
from stalwart.reliability.rerun.types import RerunValidationStatus

logger = logging.getLogger(__name__)

_SKIPPED = RerunValidationStatus.REWIND_SKIPPED
# The tracker line's message: "Spiky loss at iteration 12: rewound to iteration 8".
_MESSAGE = re.compile(r"at iteration (?P<spike>\d{1,18}): rewound to iteration (?P<to>\d{1,18})")


@dataclass(frozen=True)
class RewindRecord:
    """One rewind: the spike at iteration ``spike`` (as logged), the snapshot of ``restored``
    completed iterations it went back to, and the skipped iterations ``first..last``."""

    spike: int
    restored: int
    first: int
    last: int

    @property
    def skipped(self) -> range:
        return range(self.first, self.last + 1)

    def message(self, what: str) -> str:
        """The tracker line's message (``what``: the check, "Spiky loss")."""
        return f"{what} at iteration {self.spike}: rewound to iteration {self.restored}"

    def describe(self) -> str:
        """The skipped iterations, for a line."""
        if self.first == self.last:
            return f"iteration {self.first}"
        return f"iterations {self.first}-{self.last}"


def skip_window(spike: int, window: int) -> tuple[int, int]:
    """``(first, last)`` iterations to skip (as logged): ``window`` of them from the spiking
    iteration ``spike`` on."""
    return spike, spike + window - 1


def lr_scale_at(number: int, records: Iterable[RewindRecord], scale: float) -> float:
    """The learning-rate factor of iteration ``number`` (as logged): ``scale`` per rewind whose
    snapshot is older than it."""
    factor = 1.0
    for record in records:
        if number > record.restored:
            factor *= scale
    return factor


def read_rewinds(tracker_path: str) -> list[RewindRecord]:
    """The rewinds a tracker file records (its ``rewind_skipped`` lines, grouped by spike), in
    the order they happened; lines whose message is not a rewind's are passed over."""
    found: dict[tuple[int, int], list[int]] = {}
    for iteration, message in read_status_lines(tracker_path, _SKIPPED):
        m = _MESSAGE.search(message)
        if m is None:
            logger.warning("tracker file %s: a rewind_skipped line names no rewind", tracker_path)
            continue
        found.setdefault((int(m["spike"]), int(m["to"])), []).append(iteration)
    return [
        RewindRecord(spike, restored, min(skipped), max(skipped))
        for (spike, restored), skipped in found.items()
    ]


class RewindPolicy:
    """The rewinds of a run: the settings, the records so far (the tracker file's, then this
    process's) and whether one more is allowed.

    Args:
        enabled: ``--rewind-on-spike``.
        window / lr_scale / max_rewinds: ``--rewind-skip-window``, ``--rewind-lr-scale``,
            ``--max-rewinds``.
        records: the rewinds done so far in the run (:func:`read_rewinds`).
    """

    def __init__(
        self,
        *,
        enabled: bool,
        window: int = 1,
        lr_scale: float = 1.0,
        max_rewinds: int = 1,
        records: Iterable[RewindRecord] = (),
    ) -> None:
        self.enabled = enabled
        self.window, self.lr_scale, self.max_rewinds = window, lr_scale, max_rewinds
        self.records = list(records)

    def allows(self) -> bool:
        """Whether a spike may rewind now (the rerun machine asks; the same on every rank)."""
        return self.enabled and len(self.records) < self.max_rewinds

    def plan(self, spike: int, restored: int) -> RewindRecord:
        """The rewind of the spike at iteration ``spike`` to the snapshot of ``restored``
        completed iterations (pure: :meth:`add` records it)."""
        if restored >= spike:
            raise ValueError(
                f"a rewind restores a snapshot before its spike ({restored} >= {spike})"
            )
        first, last = skip_window(spike, self.window)
        return RewindRecord(spike, restored, first, last)

    def add(self, record: RewindRecord) -> None:
        self.records.append(record)

    def scale_at(self, number: int) -> float:
        """The learning-rate factor of iteration ``number`` (1.0 without rewinds)."""
        if self.lr_scale == 1.0:
            return 1.0
        return lr_scale_at(number, self.records, self.lr_scale)


__all__ = ["RewindPolicy", "RewindRecord", "lr_scale_at", "read_rewinds", "skip_window"]
