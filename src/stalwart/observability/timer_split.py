"""The split of one full-iteration replay that holds the optimizer step into its two timers.

With ``--cuda-graph-include-optimizer`` one replay runs the forward-backward and then the
optimizer step. In ``EVENTS`` mode an external CUDA event pair (the straggler detector's
mechanism, :class:`stalwart.observability.straggler_timing.CudaEventTiming`, recorded inside the
capture) brackets the step's part: ``optimizer`` gets boundary -> end of that part and
``forward-backward`` (which times the whole call) loses the same amount, so it holds graph
start -> boundary. Resolved lazily when the timers are read (log steps): no host sync on the
hot path. The graph's events hold its latest replay only: before the next replay each pass's
figure is read if that replay already finished (a non-blocking ``query``; always so when the
host reads the checks after each replay, as this plan does), else the latest replay's figure
stands for it (as the straggler detector weights its graph regions). In ``SYNC`` mode (and on
the host clock) one replay cannot be split: :func:`make_phase_split` returns :class:`NoSplit`
and ``forward-backward`` holds the in-graph step, which the log says once.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch

from stalwart.observability.straggler_timing import (
    CudaEventTiming,
    Region,
    RegionTiming,
    event_supports_external,
)
from stalwart.observability.timer_names import FORWARD_BACKWARD, OPTIMIZER
from stalwart.observability.timers import Timer, TimingMode

logger = logging.getLogger(__name__)


class PhaseSplit(Protocol):
    """``begin``/``end`` bracket the step inside the graph's body; ``before_pass``/``after_pass``
    run around every training pass of the plan (outside any capture)."""

    def begin(self) -> Region | None: ...
    def end(self, region: Region | None) -> None: ...
    def before_pass(self) -> None: ...
    def after_pass(self) -> None: ...


class NoSplit:
    """No split (SYNC mode, host clock, timers off): every call does nothing."""

    def begin(self) -> Region | None:
        return None

    def end(self, region: Region | None) -> None:
        return None

    def before_pass(self) -> None:
        return None

    def after_pass(self) -> None:
        return None


class _Part:
    """One pass's optimizer part: milliseconds read once its region finished, else lazily."""

    def __init__(self, region: Region, reused: bool) -> None:
        self.region, self.reused = region, reused
        self.ms: float | None = None

    def fold(self) -> None:
        """Read the figure now if the device finished it (non-blocking query)."""
        if self.ms is None and self.region[1].query():
            self.ms = _elapsed_ms(self.region)

    def seconds(self) -> float:
        if self.ms is None:
            # Deliberate sync: only when a timer is read (log step), as EVENTS mode resolves.
            self.region[1].synchronize()
            self.ms = _elapsed_ms(self.region)
        return self.ms / 1000.0


def _elapsed_ms(region: Region) -> float:
    try:
        return float(region[0].elapsed_time(region[1]))
    except RuntimeError:  # events recorded in a capture that was never replayed
        return 0.0


class EventSplit:
    """The split in ``EVENTS`` mode on CUDA (see the module docstring). ``timing``: the
    straggler detector's event backend (:class:`CudaEventTiming`; a test passes a host one
    whose regions hold objects with ``record``/``query``/``synchronize``/``elapsed_time``)."""

    def __init__(self, timers: Any, timing: RegionTiming) -> None:
        self._timing = timing
        self._fb, self._opt = timers(FORWARD_BACKWARD), timers(OPTIMIZER)
        self._region: Region | None = None  # the latest recorded part (the graph's, re-recorded)
        self._reused = False
        self._last: _Part | None = None

    def begin(self) -> Region | None:
        """At the boundary, inside the captured body (or a warm-up call of it)."""
        self._reused = self._timing.capturing()
        return self._timing.begin(in_graph=self._reused)

    def end(self, region: Region | None) -> None:
        if region is not None:
            self._timing.end(region)
            self._region = region

    def before_pass(self) -> None:
        """The next replay overwrites the graph's events: read the last pass's if finished."""
        if self._last is not None and self._last.reused:
            self._last.fold()

    def after_pass(self) -> None:
        """This training pass ran the optimizer part: move its time from fb to optimizer."""
        if self._region is None:
            return
        part = _Part(self._region, self._reused)
        self._opt.add_deferred(part.seconds)
        self._fb.add_deferred(lambda: -part.seconds())
        self._last = part


def make_phase_split(timers: Any) -> PhaseSplit:
    """:class:`EventSplit` when the timers time CUDA events and both timers are on, else
    :class:`NoSplit` (logging once that ``forward-backward`` holds the in-graph step)."""
    mode, device = getattr(timers, "mode", None), getattr(timers, "device", None)
    both = all(isinstance(timers(n), Timer) for n in (FORWARD_BACKWARD, OPTIMIZER))
    if not both:
        return NoSplit()
    cuda = isinstance(device, torch.device) and device.type == "cuda"
    if mode is TimingMode.EVENTS and cuda and event_supports_external():
        assert isinstance(device, torch.device)
        return EventSplit(timers, CudaEventTiming(device))
    logger.info(
        "timers: forward-backward includes the optimizer step inside the full-iteration graph "
        "(--cuda-graph-include-optimizer): one replay is split only with --timing-mode events on "
        "CUDA (torch >= 2.9); optimizer times only the steps run outside the graph"
    )
    return NoSplit()
