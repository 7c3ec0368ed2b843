"""Theoretical vs measured memory for the reference GPT.

Usage in a hand-written loop::

    from stalwart.models.memory_model import theoretical_memory   # the reference GPT's formula

    est = theoretical_memory(cfg, micro_batch_size=8, dp_size=world, num_parameters=n_params)
    monitor = MemoryMonitor(device, est, run_dir=run_dir, log_memory_interval=100)
    ...
    if it % log_interval == 0:
        monitor.on_log_step(it)        # first call after optimizer.step(): writes memory.json
        sink.add_scalars(monitor.scalars(), it)

As a `TrainingLog` provider, ``monitor.log_fields(info)`` calls ``on_log_step(info.iteration)``;
pass ``to_tensorboard=True, sink=sink`` for ``--log-memory-to-tensorboard``.

The monitor takes any estimate with the three byte counts (`MemoryFootprint`): another model's
formula works as well as the reference GPT's. That formula (weights, optimizer, activations,
activation recompute) is ``stalwart.models.memory_model``. Checked on an H200 (torch
2.11, cuDNN SDPA, AdamW foreach, 4 micro-batches of 8): theoretical / ``max_memory_allocated`` =
0.99-1.0 for the tiny, small and gpt2-124m presets, bf16 and fp32, with dropout 0.1 and with 4
experts top-2 (tests/observability/test_memory_gpu.py); ``bench/memory_check.py`` covers the Llama
presets and recompute.

Measured: ``measured_memory(device)`` reads the CUDA caching allocator statistics; on CPU it reports
the process resident set size (RSS), which includes the Python heap and libraries and is only a
coarse upper bound.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import InitVar, dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from stalwart.atomic_file import Sync, write_text_atomic
from stalwart.observability.sinks import MetricSink
from stalwart.observability.train_log import IntervalInfo, LogField

__all__ = [
    "MEMORY_FILE",
    "MIB",
    "MemoryFootprint",
    "MemoryMonitor",
    "NullMemoryMonitor",
    "compare",
    "cpu_peak_allocated_bytes",
    "format_measured",
    "measured_memory",
    "validate_memory_args",
]

MIB = 1 << 20


class MemoryFootprint(Protocol):
    """A theoretical peak of one rank, in bytes, as the monitor reads it (read-only).

    ``stalwart.models.memory_model.MemoryEstimate`` is one; ``to_dict()`` is written to
    ``memory.json`` under ``"theoretical"`` (the report reads ``weights_optimizer_bytes``,
    ``activation_bytes``, ``total_bytes`` and, where present, ``breakdown``).
    """

    @property
    def weights_optimizer_bytes(self) -> float: ...
    @property
    def activation_bytes(self) -> float: ...
    @property
    def total_bytes(self) -> float: ...
    def to_dict(self) -> dict[str, object]: ...


MEMORY_FILE = "memory.json"


def measured_memory(device: torch.device) -> dict[str, float]:
    """Memory now and at peak, Megatron key names where they exist.

    CUDA: ``mem-allocated-bytes``, ``mem-max-allocated-bytes``, ``mem-reserved-bytes``,
    ``mem-max-reserved-bytes``, ``mem-allocated-count``, ``mem-alloc-retries``, ``mem-ooms``.
    CPU: ``mem-rss-bytes`` and ``mem-max-rss-bytes`` (process resident set size: Python, libraries
    and tensors together).
    """
    if device.type == "cuda" and torch.cuda.is_available():
        stats = torch.cuda.memory_stats(device)
        return {
            "mem-allocated-bytes": float(stats.get("allocated_bytes.all.current", 0)),
            "mem-max-allocated-bytes": float(stats.get("allocated_bytes.all.peak", 0)),
            "mem-reserved-bytes": float(stats.get("reserved_bytes.all.current", 0)),
            "mem-max-reserved-bytes": float(stats.get("reserved_bytes.all.peak", 0)),
            "mem-allocated-count": float(stats.get("allocation.all.current", 0)),
            "mem-alloc-retries": float(stats.get("num_alloc_retries", 0)),
            "mem-ooms": float(stats.get("num_ooms", 0)),
        }
    # ru_maxrss is KiB on Linux, bytes on macOS.
    max_rss = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    max_rss *= 1.0 if sys.platform == "darwin" else 1024.0
    return {"mem-rss-bytes": _current_rss(), "mem-max-rss-bytes": max_rss}


def cpu_peak_allocated_bytes(fn: Callable[[], object]) -> float:
    """Peak net bytes of CPU tensor memory allocated while ``fn()`` runs (a measurement tool).

    Reads the CPU allocator's events through ``torch.profiler`` (``profile_memory=True``): only
    tensors allocated inside ``fn`` count, so memory that exists before the call is the caller's
    baseline. Slow (the profiler records every op): for checks at small sizes, not for training.

    Example::

        >>> grow = lambda: torch.empty(1 << 20, dtype=torch.uint8).add_(1)
        >>> cpu_peak_allocated_bytes(grow) >= 1 << 20
        True
    """
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path, encoding="utf-8") as f:
            events = json.load(f).get("traceEvents", [])
    records = [
        e["args"]
        for e in events
        if e.get("name") == "[memory]" and e.get("args", {}).get("Device Type") == 0
    ]
    if not records:
        return 0.0
    # The allocator's running total carries what earlier profiled calls left counted: measure
    # from the total just before this call's first event.
    start = float(records[0]["Total Allocated"]) - float(records[0]["Bytes"])
    return max(float(r["Total Allocated"]) for r in records) - start


def _current_rss() -> float:
    try:
        import psutil  # optional: more exact than /proc parsing on every platform
    except ImportError:
        try:
            with open("/proc/self/statm", encoding="ascii") as f:
                return float(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            return 0.0
    return float(psutil.Process().memory_info().rss)


def compare(estimate: MemoryFootprint | None, measured: dict[str, float]) -> dict[str, object]:
    """Pure: the theoretical-vs-measured record written to ``memory.json`` (``theoretical``
    null for a model with no estimate: the measured memory alone)."""
    peak = measured.get("mem-max-allocated-bytes", measured.get("mem-max-rss-bytes", 0.0))
    source = "cuda-allocator" if "mem-max-allocated-bytes" in measured else "cpu-rss"
    ratio = estimate.total_bytes / peak if estimate is not None and peak > 0 else None
    return {
        "theoretical": estimate.to_dict() if estimate is not None else None,
        "measured": measured,
        "measured_source": source,
        "measured_peak_bytes": peak,
        "theoretical_over_measured": ratio,
    }


def validate_memory_args(
    log_interval: int,
    log_memory_interval: int | None,
    names: tuple[str, str] = ("--log-memory-interval", "--log-interval"),
) -> None:
    """``--log-memory-interval`` is off when None or 0, else a positive multiple of the log
    interval (``names``: the two settings as the caller's path spells them)."""
    if not log_memory_interval:
        return
    if log_memory_interval < 1 or log_memory_interval % log_interval != 0:
        raise ValueError(
            f"{names[0]} must be a positive multiple of {names[1]} ({log_interval}), got "
            f"{log_memory_interval}"
        )


@dataclass(eq=False)
class MemoryMonitor:
    """Theoretical-vs-measured report once, then periodic measured memory.

    ``on_log_step(iteration)`` runs at log steps *after* the optimizer step (so Adam states exist).
    The first call writes ``<run_dir>/memory.json`` (rank 0 only; the measured memory alone,
    ``"theoretical": null``, for a model with no estimate) and logs Megatron's two lines
    ("Theoretical memory footprints: ..." and "[Rank r] (after N iterations) memory (MB) | ...");
    later calls read memory every ``log_memory_interval`` iterations (``--log-memory-interval``).
    With ``to_tensorboard`` (``--log-memory-to-tensorboard``) the ``mem-*`` byte values go to
    ``sink.add_scalars`` (TensorBoard/W&B only, as Megatron). Each read is one allocator-statistics
    call: host only, no device sync.
    """

    device: torch.device
    estimate: MemoryFootprint | None
    run_dir: str | os.PathLike[str] | None = None
    rank: int = 0
    log_interval: InitVar[int] = 1
    log_memory_interval: int | None = None
    to_tensorboard: bool = False
    sink: MetricSink | None = None
    log: Callable[[str], None] = print
    _reported: bool = field(default=False, init=False, repr=False)
    _last: dict[str, float] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self, log_interval: int) -> None:
        validate_memory_args(log_interval, self.log_memory_interval)

    def on_log_step(self, iteration: int) -> dict[str, float] | None:
        """Read memory if due (first call or interval); returns the measured dict when read."""
        first = not self._reported
        due = bool(self.log_memory_interval) and iteration % (self.log_memory_interval or 1) == 0
        if not (first or due):
            self._last = {}
            return None
        measured = measured_memory(self.device)
        self._last = measured
        if self.to_tensorboard and self.sink is not None:
            self.sink.add_scalars(measured, iteration)
        if first:
            self._reported = True
            self._first_report(iteration, measured)
        return measured

    def _first_report(self, iteration: int, measured: dict[str, float]) -> None:
        if self.rank == 0 and self.estimate is not None:
            est = self.estimate
            self.log(
                f"Theoretical memory footprints: weight and optimizer="
                f"{est.weights_optimizer_bytes / MIB:.2f} MB, activation="
                f"{est.activation_bytes / MIB:.2f} MB, total={est.total_bytes / MIB:.2f} MB"
            )
        self.log(f"[Rank {self.rank}] (after {iteration} iterations) {format_measured(measured)}")
        if self.rank != 0 or self.run_dir is None:
            return
        record = compare(self.estimate, measured)
        record.update(iteration=iteration, time=time.time(), device=str(self.device))
        run_dir = Path(self.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        text = json.dumps(record, indent=1)
        write_text_atomic(run_dir / MEMORY_FILE, text, sync=Sync.NONE)

    def log_fields(self, info: IntervalInfo) -> list[LogField]:
        """`LogFieldProvider`: the peak-memory field at the steps that read memory."""
        measured = self.on_log_step(info.iteration)
        if not measured:
            return []
        if "mem-max-allocated-bytes" in measured:
            peak = measured["mem-max-allocated-bytes"]
            return [
                LogField("mem max allocated (MB)", peak / MIB, "{:.1f}", short="max alloc {} MB")
            ]
        rss = measured["mem-max-rss-bytes"] / MIB
        return [LogField("mem max RSS (MB)", rss, "{:.1f}", short="max RSS {} MB")]

    def scalars(self) -> dict[str, float]:
        """The latest ``mem-*`` values (empty at steps that did not read memory)."""
        return dict(self._last)


def format_measured(measured: dict[str, float]) -> str:
    """Megatron-style "memory (MB) | allocated: ... |" text (RSS on CPU)."""
    names = (
        ("mem-allocated-bytes", "allocated"),
        ("mem-max-allocated-bytes", "max allocated"),
        ("mem-reserved-bytes", "reserved"),
        ("mem-max-reserved-bytes", "max reserved"),
        ("mem-rss-bytes", "process RSS"),
        ("mem-max-rss-bytes", "max process RSS"),
    )
    parts = [f"{label}: {measured[k] / MIB:.1f}" for k, label in names if k in measured]
    return "memory (MB) | " + " | ".join(parts)


class NullMemoryMonitor:
    """Memory reporting off: no allocator reads, no file."""

    def on_log_step(self, iteration: int) -> None: ...

    def log_fields(self, info: IntervalInfo) -> list[LogField]:
        return []

    def scalars(self) -> dict[str, float]:
        return {}


@dataclass(kw_only=True, frozen=True)
class MemoryConfig:
    """``--log-memory-interval`` (0 off; a multiple of ``--log-interval``: the memory report
    and ``<run dir>/memory.json``) and ``--log-memory-to-tensorboard``
    (the log line's memory figures to the sinks)."""

    log_memory_interval: int = 0
    log_memory_to_tensorboard: bool = False

    def __post_init__(self) -> None:
        if self.log_memory_interval < 0:  # the multiple of --log-interval: at build
            raise ValueError(f"--log-memory-interval must be >= 0, got {self.log_memory_interval}")

    def build(
        self,
        device: torch.device,
        estimate: MemoryFootprint | None,
        *,
        run_dir: str | None,
        rank: int,
        log_interval: int,
        sink: MetricSink | None,
        log: Callable[[str], None],
    ) -> MemoryMonitor:
        return MemoryMonitor(
            device,
            estimate,
            run_dir=run_dir,
            rank=rank,
            log_interval=log_interval,
            log_memory_interval=self.log_memory_interval or None,
            to_tensorboard=self.log_memory_to_tensorboard,
            sink=sink,
            log=log,
        )
