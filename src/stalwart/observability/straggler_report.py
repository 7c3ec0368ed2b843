"""The straggler detector's report: per-rank compute (and comm) time and GPU fields of one log
interval, the statistics over ranks, and its log fields (`stalwart.observability.straggler`
gathers the values; :func:`build_report` is the pure decision)."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

from stalwart.observability.log_lines import LogField
from stalwart.observability.straggler_gpu import GpuSample, gpu_fields, gpu_spread

COMM_MEDIAN_KEY = "straggler/comm-ms-median"


@dataclass(frozen=True)
class StragglerReport:
    """Per-rank compute time over one log interval, in milliseconds per iteration.

    Attributes:
        iteration: the iteration the report was taken at.
        compute_ms: ``compute_ms[r]`` is rank r's compute time per iteration.
        min_ms / median_ms / max_ms: statistics over ranks.
        slowest / fastest: ``(rank, ms)`` of the ``minmax_count`` slowest / fastest ranks.
        relative_throughput: ``median_ms / compute_ms[r]`` (1.0 = median rank, < 1 = slower).
        stragglers: ranks whose compute time exceeds ``threshold * median_ms``.
        threshold: the threshold used.
        comm_ms: per rank, the ``iteration_region`` time minus compute (exposed communication
            and waiting for peers); None when no rank timed an iteration region.
        num_iterations: iterations in the interval.
        source: ``events`` / ``graph-events`` (inside a captured graph) / ``iteration`` (only
            the whole iteration region was timed, e.g. a replay without graph events) /
            ``wall`` (host clock).
        gpu: per rank, its GPU sample (None: not measured, e.g. CPU); None when no rank
            measured one.
    """

    iteration: int
    compute_ms: list[float]
    min_ms: float
    median_ms: float
    max_ms: float
    slowest: list[tuple[int, float]]
    fastest: list[tuple[int, float]]
    relative_throughput: list[float]
    stragglers: list[int]
    threshold: float
    comm_ms: list[float] | None = None
    num_iterations: int = 1
    source: str = "wall"
    gpu: list[GpuSample | None] | None = None

    def fields(self) -> list[LogField]:
        """Fields for the training log line; keyed ones also go to the sinks and metrics file."""
        slow_rank = self.slowest[0][0]
        relative = self.relative_throughput[slow_rank]
        several = len(self.compute_ms) > 1  # the compact line: the slowest rank among several
        out = [
            _quiet("compute ms min", self.min_ms, "straggler/compute-ms-min"),
            _quiet("median", self.median_ms, "straggler/compute-ms-median"),
            _quiet("max", self.max_ms, "straggler/compute-ms-max"),
            LogField(
                "slowest rank",
                slow_rank,
                "{}",
                "straggler/slowest-rank",
                short=f"slowest rank {{}} ({relative:.2f}x)",
                compact=several,
            ),
            LogField(
                "slowest rel. throughput",
                relative,
                "{:.2f}",
                "straggler/slowest-relative-throughput",
                compact=False,
            ),
        ]
        if len(self.slowest) > 1:
            ranks = ",".join(f"{r}:{ms:.1f}" for r, ms in self.slowest)
            out.append(LogField("slowest ranks (ms)", ranks, "{}", compact=False))
            ranks = ",".join(f"{r}:{ms:.1f}" for r, ms in self.fastest)
            out.append(LogField("fastest ranks (ms)", ranks, "{}", compact=False))
        if self.comm_ms is not None:
            comm = self.comm_ms
            median = statistics.median(comm)
            out.append(_quiet("comm ms median", median, COMM_MEDIAN_KEY))
            out.append(_quiet("max", max(comm), "straggler/comm-ms-max"))
        out += gpu_fields(gpu_spread(self.gpu) if self.gpu else None)
        count = len(self.stragglers)
        out.append(
            LogField("stragglers", count, "{}", "straggler/num-stragglers", compact=count > 0)
        )
        if self.stragglers:
            out.append(LogField("straggler ranks", ",".join(map(str, self.stragglers)), "{}"))
        return out

    def scalars(self) -> dict[str, float]:
        """Scalars for metric sinks: the keyed fields of `fields`."""
        return {f.key: float(f.value) for f in self.fields() if f.key is not None}

    def to_record(self) -> dict[str, object]:
        """The JSON record appended to ``straggler.jsonl`` (one line per report, all ranks)."""
        record = asdict(self)
        record["time"] = time.time()
        return record


def _quiet(label: str, value: float, key: str) -> LogField:
    """A field in milliseconds that the compact line leaves to the sinks and the metrics file."""
    return LogField(label, value, "{:.1f}", key, compact=False)


def build_report(
    iteration: int,
    compute_ms: list[float],
    threshold: float,
    minmax_count: int = 1,
    comm_ms: list[float] | None = None,
    num_iterations: int = 1,
    source: str = "wall",
    gpu: list[GpuSample | None] | None = None,
) -> StragglerReport:
    """Pure decision: turn gathered per-rank times into a report (no I/O, no collectives)."""
    if not compute_ms:
        raise ValueError("build_report needs at least one rank's time")
    median = statistics.median(compute_ms)
    order = sorted(range(len(compute_ms)), key=lambda r: (compute_ms[r], r))
    k = min(max(minmax_count, 1), len(compute_ms))
    relative = [median / t if t > 0 else 0.0 for t in compute_ms]
    stragglers = [r for r, t in enumerate(compute_ms) if median > 0 and t > threshold * median]
    return StragglerReport(
        iteration=iteration,
        compute_ms=list(compute_ms),
        min_ms=compute_ms[order[0]],
        median_ms=median,
        max_ms=compute_ms[order[-1]],
        slowest=[(r, compute_ms[r]) for r in reversed(order[-k:])],
        fastest=[(r, compute_ms[r]) for r in order[:k]],
        relative_throughput=relative,
        stragglers=stragglers,
        threshold=threshold,
        comm_ms=None if comm_ms is None else list(comm_ms),
        num_iterations=num_iterations,
        source=source,
        gpu=list(gpu) if gpu is not None and any(s is not None for s in gpu) else None,
    )
