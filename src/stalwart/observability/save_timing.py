"""Checkpoint save timing: saves in their own timers and log fields, never in iteration time.

As Megatron's ``save_checkpoint_and_time``: ``interval-time`` is stopped for the save and
restarted (with a barrier) after it, so "elapsed time per iteration" is training only. The
blocking part is timed in ``save-checkpoint`` (``save-checkpoint-non-persistent``); the total, up
to the commit of an async save, from the save's start to the finalize that committed it.

Usage in a hand-written loop::

    saves = SaveTiming(timers, ledger=ledger)         # ledger: the goodput ledger, optional
    ...
    with saves.blocking(iteration, async_save=True):  # the call that stages / writes
        manager.save(iteration, model, optimizer, common, per_rank)
    ...
    done = manager.maybe_finalize()                   # every iteration (async saves)
    if done is not None:
        saves.finalized(done)
    with saves.finalizing():                          # a blocking finalize (exit)
        manager.finalize()
    saves.finalized_all()

Pass ``saves`` to :class:`~stalwart.observability.train_log.TrainingLog` as a field provider: the
next iteration line shows ``save blocking (ms)`` for saves started in its interval and ``save
total (ms)`` for saves committed in it; the keys ``save-checkpoint-blocking-ms`` and
``save-checkpoint-total-ms`` go to the sinks and the metrics file. No collective, no host sync.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from stalwart.observability.goodput.records import Bucket
from stalwart.observability.timer_names import (
    INTERVAL_TIME,
    SAVE_CHECKPOINT,
    SAVE_CHECKPOINT_NON_PERSISTENT,
)
from stalwart.observability.timers import Timer, Timers
from stalwart.observability.train_log import IntervalInfo, LogField

# Not "<name>-time-ms": these are per save, not per iteration (the report's timer breakdown
# stacks the per-iteration timers).
BLOCKING_KEY = "save-checkpoint-blocking-ms"
TOTAL_KEY = "save-checkpoint-total-ms"


@dataclass
class _Pending:
    iteration: int
    started: float


class SaveTiming:
    """Times saves (see the module docstring). ``ledger`` (optional) gets the blocking time as
    its checkpoint bucket; the overlap of an async save with training stays productive."""

    def __init__(self, timers: Timers, ledger: Any = None) -> None:
        self.timers = timers
        self._ledger = ledger
        self._pending: list[_Pending] = []
        self._blocking_ms: list[float] = []
        self._total_ms: list[float] = []

    @contextlib.contextmanager
    def blocking(
        self, iteration: int, *, non_persistent: bool = False, async_save: bool = False
    ) -> Iterator[None]:
        """Time the blocking part of a save of ``iteration``; ``interval-time`` is paused."""
        interval = self.timers(INTERVAL_TIME)
        was_running = isinstance(interval, Timer) and interval.is_running
        if was_running:
            interval.stop()
        timer = self.timers(SAVE_CHECKPOINT_NON_PERSISTENT if non_persistent else SAVE_CHECKPOINT)
        span = self._ledger.span(Bucket.CHECKPOINT) if self._ledger is not None else _null()
        started = time.perf_counter()
        ok = False
        try:
            with span:
                timer.start()
                try:
                    yield
                finally:
                    timer.stop()
            ok = True
        finally:
            blocking_s = time.perf_counter() - started
            if was_running:
                # As Megatron: the next interval starts together on every rank (a save is a
                # collective, so every rank is here); after a failed save, no collective.
                interval.start(barrier=ok)
        self._blocking_ms.append(blocking_s * 1000.0)
        if async_save:
            self._pending.append(_Pending(iteration, started))
        else:
            self._total_ms.append(blocking_s * 1000.0)

    @contextlib.contextmanager
    def finalizing(self) -> Iterator[None]:
        """A blocking wait for a pending async save (the exit's finalize): checkpoint time."""
        span = self._ledger.span(Bucket.CHECKPOINT) if self._ledger is not None else _null()
        with span:
            yield

    def finalized(self, iteration: int) -> None:
        """The async save of ``iteration`` was committed now (``maybe_finalize`` returned it)."""
        now = time.perf_counter()
        done = [p for p in self._pending if p.iteration == iteration]
        self._pending = [p for p in self._pending if p.iteration != iteration]
        self._total_ms += [(now - p.started) * 1000.0 for p in done]

    def finalized_all(self) -> None:
        """Every pending async save was committed (after ``finalize()``)."""
        for pending in list(self._pending):
            self.finalized(pending.iteration)

    def log_fields(self, info: IntervalInfo) -> list[LogField]:
        """`LogFieldProvider`: the saves of this interval (nothing when there were none)."""
        del info
        fields = []
        if self._blocking_ms:
            fields.append(_field("save blocking (ms)", self._blocking_ms, BLOCKING_KEY))
        if self._total_ms:
            fields.append(_field("save total (ms)", self._total_ms, TOTAL_KEY))
        self._blocking_ms, self._total_ms = [], []
        return fields


def _field(label: str, values: list[float], key: str) -> LogField:
    """Mean over the interval's saves; ``(n saves)`` in the label when there were several."""
    if len(values) > 1:
        label = f"{label} ({len(values)} saves)"
    return LogField(label, sum(values) / len(values), "{:.1f}", key)


def _null() -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()
