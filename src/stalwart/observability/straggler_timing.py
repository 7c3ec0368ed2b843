"""How the straggler detector times a region: CUDA events (also inside a captured graph), or the
host clock. Kept apart from the detector so the graph logic can be tested on CPU.

Inside a CUDA graph capture an ordinary event record becomes an internal cross-stream dependency
(no timestamp on replay). An *external* event (``torch.cuda.Event(external=True)``, torch >= 2.9,
``cudaEventRecordExternal``) is captured as an event-record node instead, so every replay writes
its timestamp again: regions timed at capture keep timing each replay. Without ``external`` the
detector cannot time inside the graph and falls back to timing the whole replay from outside.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

logger = logging.getLogger(__name__)

Region = Any  # an opaque (start, end) pair owned by a timing backend


def event_supports_external() -> bool:
    """Whether this torch's ``torch.cuda.Event`` takes ``external=`` (graph-recordable events)."""
    try:
        return "external" in inspect.signature(torch.cuda.Event.__new__).parameters
    except (TypeError, ValueError):
        return False


class RegionTiming(Protocol):
    """A timing backend: begin/end regions, read their summed milliseconds at log steps."""

    graph_events: bool  # regions can be recorded inside a captured CUDA graph

    def capturing(self) -> bool: ...
    def begin(self, in_graph: bool) -> Region: ...
    def end(self, region: Region) -> None: ...
    def elapsed_ms(self, regions: list[Region]) -> float | None: ...
    def release(self, regions: list[Region]) -> None: ...


class WallTiming:
    """Host clock (CPU runs): a region is ``[t0, t1]``; nothing is ever captured. ``clock``:
    seconds (default ``time.perf_counter``; a test passes a clock it advances itself)."""

    graph_events = False

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock

    def capturing(self) -> bool:
        return False

    def begin(self, in_graph: bool) -> Region:
        return [self._clock(), None]

    def end(self, region: Region) -> None:
        region[1] = self._clock()

    def elapsed_ms(self, regions: list[Region]) -> float | None:
        return sum((r[1] - r[0]) * 1000.0 for r in regions if r[1] is not None)

    def release(self, regions: list[Region]) -> None:
        return None


class CudaEventTiming:
    """CUDA events on the current stream; external events for regions inside a capture."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.graph_events = event_supports_external()
        self._pool: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._warned = False

    def capturing(self) -> bool:
        return bool(torch.cuda.is_current_stream_capturing())

    def _pair(self, in_graph: bool) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        if in_graph:  # owned by the graph's capture: never pooled
            kwargs: dict[str, Any] = {"enable_timing": True, "external": True}
            return torch.cuda.Event(**kwargs), torch.cuda.Event(**kwargs)
        if self._pool:  # creating events every micro-batch costs more than recording them
            return self._pool.pop()
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def begin(self, in_graph: bool) -> Region:
        pair = self._pair(in_graph)
        pair[0].record()
        return pair

    def end(self, region: Region) -> None:
        region[1].record()

    def elapsed_ms(self, regions: list[Region]) -> float | None:
        if not regions:
            return 0.0
        try:
            # Deliberate sync: once per log interval, to read the recorded event times.
            regions[-1][1].synchronize()
            return float(sum(start.elapsed_time(end) for start, end in regions))
        except RuntimeError as exc:  # e.g. a graph whose events were never replayed
            if not self._warned:
                logger.warning("straggler: cannot read CUDA event times (%s)", exc)
                self._warned = True
            return None

    def release(self, regions: list[Region]) -> None:
        self._pool.extend(regions)


def make_timing(device: torch.device) -> RegionTiming:
    return CudaEventTiming(device) if device.type == "cuda" else WallTiming()
