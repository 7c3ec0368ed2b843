"""Straggler detection: per-rank *compute* time, gathered once per log interval.

A slow rank is invisible in iteration time because every rank waits for it in the gradient
all-reduce. So the detector times only the regions the trainer marks as compute (forward and
backward of each micro-batch, never a collective) with CUDA events on GPU, or ``time.perf_counter``
on CPU, and at each log step gathers one float per rank with a single ``all_gather``.

The detector is also an observer of ``stalwart.loop.GuardedStep`` (``observer=detector``):
compute regions per micro-batch, an iteration region around every forward-backward call, and
the regions inside a full-iteration graph (``graph_safe``). Usage in a hand-written loop::

    detector = StragglerDetector(device, rank, world_size, threshold=1.2, run_dir=run_dir)
    for it in range(1, iters + 1):
        for mb in micro_batches:
            with detector.compute():
                loss = model(mb).loss
                loss.backward()
        all_reduce_grads(model)              # NOT inside compute(): waiting here is not compute
        optimizer.step()
        if it % log_interval == 0:
            report = detector.report(it)     # collective: call on every rank
            print(report.fields())           # rank 0 also appends to <run_dir>/straggler.jsonl

With `stalwart.observability.TrainingLog`, pass the detector as a log-field provider instead:
its ``log_fields(info)`` runs ``report(info.iteration, info.num_iterations)`` at each log step.

Disabled: ``NullStragglerDetector`` has the same methods and does nothing (``compute()`` returns a
shared no-op context manager, ``report`` returns ``None`` and issues no collective).

Cost: two ``cudaEventRecord`` per marked region (a few microseconds of host time, no sync); one
event synchronisation plus one ``all_gather`` of one float per rank per log interval.

Communication: wrap the whole forward-backward (compute + gradient all-reduce) in
``detector.iteration_region()``; the report then also gives each rank's *comm* time, the
iteration region minus compute: the exposed communication and the wait for peers. A slow rank
has the highest compute and the lowest comm (everyone else waits for it); a slow link raises
comm on every rank while compute stays flat.

GPU fields (Megatron's): each report also carries every rank's GPU temperature, power,
utilisation and SM clock from NVML (`stalwart.observability.straggler_gpu`), with the min and
max over ranks and the rank that holds each (``MnPwr/Rnk: 650.00W/0 | MxPwr/Rnk: ...``); on CPU
or without ``pynvml`` these fields are left out.

Runtime toggle (Megatron's): ``enabled=False`` (``--disable-straggler-on-startup``) starts the
detector off (no timing; a report is still a collective, which carries the toggle); ``touch
<run dir>/straggler.toggle`` flips it on every rank at the next log step
(`stalwart.observability.straggler_toggle`). Regions captured into a graph while it is off are
not timed after it is turned on (the replay is then timed as a whole).

Full-iteration CUDA graphs: ``compute()`` regions entered while the graph is captured record
*external* CUDA events (``torch.cuda.Event(external=True)``, see ``straggler_timing``), which
every replay re-records; the report reads the last replay's times at the log step. Keep
``iteration_region()`` outside the graph (around the replay). Without external events (older
torch) the captured regions are skipped and compute is the whole replay (``source:
iteration``).
With DDP the last bucket's all-reduce wait lands in the backward of the last micro-batch; wrap
only forward/backward for precise numbers.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed import ProcessGroup

from stalwart.distributed import collectives
from stalwart.observability.goodput import straggler_idle_seconds
from stalwart.observability.sinks import append_line
from stalwart.observability.straggler_gpu import (
    GpuStatsReader,
    make_gpu_stats,
    sample_values,
    samples_from_gather,
)
from stalwart.observability.straggler_report import StragglerReport, build_report
from stalwart.observability.straggler_timing import Region, RegionTiming, make_timing
from stalwart.observability.straggler_toggle import TOGGLE_FILE, FileToggle
from stalwart.observability.train_log import IntervalInfo, LogField

STRAGGLER_FILE = "straggler.jsonl"


def validate_straggler_args(threshold: float, minmax_count: int) -> None:
    """Raise ``ValueError`` naming the flag when a straggler option is out of range."""
    if not (math.isfinite(threshold) and threshold > 1.0):
        raise ValueError(f"--straggler-threshold must be a finite number > 1.0, got {threshold}")
    if minmax_count < 1:
        raise ValueError(f"--straggler-minmax-count must be an integer >= 1, got {minmax_count}")


@dataclass
class _Interval:
    """What the detector recorded since the last report (host side)."""

    compute: list[Region] = field(default_factory=list)  # eager compute regions
    steps: list[Region] = field(default_factory=list)  # iteration regions
    iterations: int = 0
    eager_iterations: int = 0  # iterations whose compute regions ran in Python
    replays: int = 0  # iterations whose compute ran inside a captured graph


@dataclass(frozen=True)
class _Local:
    compute_ms: float
    comm_ms: float  # -1: not measured
    source: str


class StragglerDetector:
    """Times marked compute regions and reports stragglers at log steps.

    Args:
        device: this rank's compute device; CUDA uses events, anything else wall clock.
        rank: global rank (only rank 0 writes ``straggler.jsonl``).
        world_size: number of ranks (for messages only; the gather uses ``group``).
        threshold: a rank is a straggler when its compute time > threshold × median.
        minmax_count: how many slowest/fastest ranks to name.
        run_dir: where rank 0 appends ``straggler.jsonl``; ``None`` disables the file.
        group: process group for the gather (default group when ``None``).
        timing: the timing backend (default: CUDA events on CUDA, the host clock otherwise).
        enabled: on at start (``--disable-straggler-on-startup``: False).
        gpu_stats: the GPU field reader (default: NVML on CUDA, nothing on CPU).
        toggle_file: the runtime toggle's file (default: ``<run_dir>/straggler.toggle``).
    """

    def __init__(
        self,
        device: torch.device,
        rank: int = 0,
        world_size: int = 1,
        threshold: float = 1.2,
        minmax_count: int = 1,
        run_dir: str | os.PathLike[str] | None = None,
        group: ProcessGroup | None = None,
        timing: RegionTiming | None = None,
        enabled: bool = True,
        gpu_stats: GpuStatsReader | None = None,
        toggle_file: str | os.PathLike[str] | None = None,
    ) -> None:
        validate_straggler_args(threshold, minmax_count)
        self.device = device
        self.rank = rank
        self.world_size = world_size
        self.threshold = threshold
        self.minmax_count = minmax_count
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.group = group
        self._timing = timing or make_timing(device)
        self._interval = _Interval()
        self._graph_compute: list[Region] = []  # the latest capture's regions (re-recorded)
        self._in_capture = False
        self._eager_regions = 0
        self._last: StragglerReport | None = None
        self.enabled = enabled
        self._gpu = gpu_stats if gpu_stats is not None else make_gpu_stats(device)
        if toggle_file is None and self.run_dir is not None:
            toggle_file = self.run_dir / TOGGLE_FILE
        self._toggle = FileToggle(toggle_file, rank)

    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        """Mark a compute region (forward and/or backward). Nesting is not supported."""
        timing = self._timing
        in_graph = self.enabled and timing.capturing()
        if not self.enabled or (in_graph and not timing.graph_events):
            yield  # off, or a graph that cannot be timed inside: its replay is timed as a whole
            return
        if in_graph and not self._in_capture:  # a new capture replaces the last graph's regions
            self._graph_compute, self._in_capture = [], True
        region = timing.begin(in_graph=in_graph)
        try:
            yield
        finally:
            timing.end(region)
            if in_graph:
                self._graph_compute.append(region)
            else:
                self._interval.compute.append(region)
                self._eager_regions += 1

    @contextlib.contextmanager
    def iteration_region(self) -> Iterator[None]:
        """A forward-backward call incl. its collectives (outside any captured graph): wrap
        every call (look-ahead launches, rerun passes); comm per iteration = regions / iterations
        minus compute."""
        if self._timing.capturing() or not self.enabled:
            yield
            return
        region = self._timing.begin(in_graph=False)
        try:
            yield
        finally:
            self._timing.end(region)
            self._interval.steps.append(region)

    def on_microbatch(self, index: int, is_last: bool) -> None:
        """Observer hook of ``stalwart.loop.GuardedStep`` (regions come from ``compute``)."""
        del index, is_last

    def graph_safe(self) -> StragglerDetector:
        """What may run inside a captured graph: this detector (external events there)."""
        return self

    def step(self) -> None:
        """Count one finished iteration (call once per iteration, outside compute regions)."""
        interval = self._interval
        interval.iterations += 1
        if self._in_capture or (self._eager_regions == 0 and self._graph_compute):
            interval.replays += 1
        elif self._eager_regions:
            interval.eager_iterations += 1
        self._in_capture, self._eager_regions = False, 0

    def _local(self, num_iterations: int) -> _Local:
        """This rank's compute and comm ms per iteration over the interval (resets it)."""
        interval, timing = self._interval, self._timing
        n = max(num_iterations, 1)
        eager = timing.elapsed_ms(interval.compute) or 0.0
        graph = timing.elapsed_ms(self._graph_compute) if interval.replays else None
        # Per iteration: a look-ahead launch runs (part of) the next iteration's forward-backward
        # inside this one's step, so the calls of an interval add up to its iterations' work.
        steps_total = timing.elapsed_ms(interval.steps) if interval.steps else None
        steps = None if steps_total is None else steps_total / n
        timing.release(interval.compute + interval.steps)
        self._interval = _Interval()
        source = "events" if self.device.type == "cuda" else "wall"
        counted = interval.eager_iterations + (interval.replays if graph is not None else 0)
        if graph is not None and counted:
            # The graph's events hold the last replay only: weight it by the replays.
            compute = (eager + graph * interval.replays) / counted
            source = "graph-events"
        elif interval.compute:
            compute = eager / (interval.eager_iterations or n)
        elif steps is not None:  # nothing timed inside: the whole (replayed) iteration
            return _Local(steps, -1.0, "iteration")
        else:
            compute = 0.0
        comm = max(steps - compute, 0.0) if steps is not None else -1.0
        return _Local(compute, comm, source)

    def report(self, iteration: int, num_iterations: int | None = None) -> StragglerReport | None:
        """Gather compute time and GPU fields from every rank (ONE all_gather) and build the
        report; None while the detector is off. Then apply a toggle request (rank 0's, carried
        in the same gather) on every rank.

        Collective: every rank of ``group`` must call it at the same iteration, on or off.
        ``num_iterations`` defaults to the number of ``step()`` calls since the last report.
        """
        n = num_iterations if num_iterations is not None else self._interval.iterations
        was_on = self.enabled
        local = self._local(n) if was_on else _Local(0.0, -1.0, "off")
        gpu = sample_values(self._gpu.read() if was_on else None)
        toggle = 1.0 if self._toggle.requested() else 0.0
        row = [local.compute_ms, local.comm_ms, *gpu, toggle]
        gathered = collectives.all_gather_floats(row, self.group)
        report = self._build(iteration, max(n, 1), local.source, gathered) if was_on else None
        if gathered[0][-1] > 0:  # rank 0 asked: every rank flips at this same report
            self._flip(iteration)
        return report

    def _build(
        self, iteration: int, n: int, source: str, gathered: list[list[float]]
    ) -> StragglerReport:
        comm = [g[1] for g in gathered]
        report = build_report(
            iteration,
            [g[0] for g in gathered],
            self.threshold,
            self.minmax_count,
            comm_ms=comm if all(c >= 0 for c in comm) else None,
            num_iterations=n,
            source=source,
            gpu=samples_from_gather(gathered, offset=2),
        )
        self._last = report
        if self.rank == 0 and self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            append_line(self.run_dir / STRAGGLER_FILE, json.dumps(report.to_record()))
        return report

    def _flip(self, iteration: int) -> None:
        """Turn on or off (every rank, at the same report): the next interval starts clean."""
        self.enabled = not self.enabled
        self._interval = _Interval()
        self._graph_compute, self._in_capture, self._eager_regions = [], False, 0
        if self.rank == 0:
            state = "on" if self.enabled else "off"
            logging.getLogger(__name__).info(
                "straggler detection turned %s at iteration %d (%s)",
                state,
                iteration,
                self._toggle.path,
            )

    @property
    def last_report(self) -> StragglerReport | None:
        return self._last

    def log_fields(self, info: IntervalInfo) -> list[LogField]:
        """`LogFieldProvider`: report at this log step (collective on every rank) and return
        fields."""
        report = self.report(info.iteration, info.num_iterations)
        return report.fields() if report is not None else []

    def scalars(self) -> dict[str, float]:
        """Metric-sink provider: scalars of the latest report (empty before the first)."""
        return self._last.scalars() if self._last is not None else {}

    def close(self) -> None:
        self._interval = _Interval()
        self._graph_compute = []
        self._gpu.close()


class NullStragglerDetector:
    """Disabled detector: same surface, no timing, no collectives, no files."""

    def __init__(self) -> None:
        self._noop = contextlib.nullcontext()

    def compute(self) -> contextlib.AbstractContextManager[None]:
        return self._noop

    def iteration_region(self) -> contextlib.AbstractContextManager[None]:
        return self._noop

    def on_microbatch(self, index: int, is_last: bool) -> None: ...

    def graph_safe(self) -> None:
        return None  # nothing to run inside a captured graph

    def step(self) -> None: ...
    def report(self, iteration: int, num_iterations: int | None = None) -> None: ...

    @property
    def last_report(self) -> None:
        return None

    def log_fields(self, info: IntervalInfo) -> list[LogField]:
        return []

    def scalars(self) -> dict[str, float]:
        return {}

    def close(self) -> None: ...


class StragglerIdle:
    """Log provider after the straggler detector: each new report's idle time (ranks waiting on
    the slowest) moves from productive to the goodput ledger's straggler bucket."""

    def __init__(self, straggler: StragglerDetector | NullStragglerDetector, ledger: Any) -> None:
        self.straggler, self.ledger = straggler, ledger
        self._seen: object = None

    def log_fields(self, info: IntervalInfo) -> list[LogField]:
        del info
        report = self.straggler.last_report
        if report is not None and report is not self._seen:
            self._seen = report
            idle = straggler_idle_seconds(report.compute_ms, report.num_iterations)
            self.ledger.add_straggler_idle(idle)
        return []


@dataclass(kw_only=True, frozen=True)
class StragglerConfig:
    """``--log-straggler`` and its settings: ``disable_straggler_on_startup`` starts it off (on
    with ``touch <run dir>/straggler.toggle``), ``straggler_threshold`` (> 1: slower than this
    times the median is a straggler), ``straggler_minmax_count`` (the slowest/fastest named)."""

    log_straggler: bool = False
    disable_straggler_on_startup: bool = False
    straggler_threshold: float = 1.2
    straggler_minmax_count: int = 1

    def __post_init__(self) -> None:
        validate_straggler_args(self.straggler_threshold, self.straggler_minmax_count)
        if self.disable_straggler_on_startup and not self.log_straggler:
            raise ValueError("--disable-straggler-on-startup needs --log-straggler")

    def build(
        self,
        device: torch.device,
        rank: int = 0,
        world_size: int = 1,
        run_dir: str | None = None,
        group: ProcessGroup | None = None,
    ) -> StragglerDetector | NullStragglerDetector:
        """``log_straggler``: the detector (off at start with ``disable_straggler_on_startup``:
        on with ``touch <run dir>/straggler.toggle``), else the null one."""
        if not self.log_straggler:
            return NullStragglerDetector()
        return StragglerDetector(
            device,
            rank,
            world_size,
            self.straggler_threshold,
            self.straggler_minmax_count,
            run_dir,
            group,
            enabled=not self.disable_straggler_on_startup,
        )
