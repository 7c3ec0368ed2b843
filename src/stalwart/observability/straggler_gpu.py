"""The straggler detector's per-rank GPU fields (Megatron's StragglerDetector): temperature,
power, utilisation and SM clock from NVML, read once per report on every rank, and the min/max
over ranks with the rank that holds each.

A hot, power-capped or throttled GPU is a typical straggler: its compute time is high and its
clock low. The reader is chosen once: `NvmlGpuStats` on a CUDA device with ``pynvml`` installed
(the ``nvml`` extra), else `NullGpuStats` (CPU, or no NVML), whose ranks contribute nothing, so
the fields are left out rather than made up::

    >>> samples = [GpuSample(61.0, 650.0, 99.0, 1980.0), None, GpuSample(74.0, 700.0, 97.0, 1755.0)]
    >>> spread = gpu_spread(samples)
    >>> spread["temperature_c"], spread["clock_mhz"]
    (((61.0, 0), (74.0, 2)), ((1755.0, 2), (1980.0, 0)))
    >>> [f"{f.label}: {f.fmt.format(f.value)}" for f in gpu_fields(spread)][:2]
    ['MnPwr/Rnk: 650.00W/0', 'MxPwr/Rnk: 700.00W/2']

Cost: four NVML queries (tens of microseconds, no device sync) per report, i.e. per log
interval; the values travel in the report's one ``all_gather``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import astuple, dataclass
from typing import Any, Protocol

import torch

from stalwart.observability.log_lines import LogField
from stalwart.observability.nvml import open_nvml_handle

logger = logging.getLogger(__name__)

GPU_FIELDS = ("temperature_c", "power_w", "utilization_pct", "clock_mhz")
# Megatron's labels and units, in its order: power, temperature, utilisation, clock.
_LABELS = (
    ("power_w", "Pwr", "W"),
    ("temperature_c", "Tmp", "C"),
    ("utilization_pct", "Utl", "%"),
    ("clock_mhz", "Clk", "MHz"),
)
_KEYS = {
    "temperature_c": "temperature-c",
    "power_w": "power-w",
    "utilization_pct": "utilization-percent",
    "clock_mhz": "clock-mhz",
}

ValueRank = tuple[float, int]
Spread = dict[str, tuple[ValueRank, ValueRank]]  # field -> ((min, rank), (max, rank))


@dataclass(frozen=True)
class GpuSample:
    """One rank's GPU at a report: °C, W, % busy (NVML's last sample period), SM clock MHz."""

    temperature_c: float
    power_w: float
    utilization_pct: float
    clock_mhz: float

    def values(self) -> list[float]:
        return [float(v) for v in astuple(self)]


class GpuStatsReader(Protocol):
    """Reads this rank's GPU once per report; None when there is nothing to read."""

    def read(self) -> GpuSample | None: ...
    def close(self) -> None: ...


class NullGpuStats:
    """No GPU fields (CPU, or no NVML): this rank contributes NaNs to the gather."""

    def read(self) -> None: ...
    def close(self) -> None: ...


class NvmlGpuStats:
    """NVML queries of one device (``pynvml``, imported lazily by `open_nvml_handle`)."""

    def __init__(self, device: torch.device, nvml: Any = None, handle: Any = None) -> None:
        if nvml is None:
            nvml, handle = open_nvml_handle(device)
        self._nvml, self._handle = nvml, handle
        self._warned = False

    def read(self) -> GpuSample | None:
        nvml, h = self._nvml, self._handle
        try:
            return GpuSample(
                temperature_c=float(nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)),
                power_w=float(nvml.nvmlDeviceGetPowerUsage(h)) / 1000.0,  # NVML reports mW
                utilization_pct=float(nvml.nvmlDeviceGetUtilizationRates(h).gpu),
                clock_mhz=float(nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM)),
            )
        except Exception as exc:  # a query the driver does not support: no fields, once said
            if not self._warned:
                logger.warning("straggler: NVML query failed (%s); no GPU fields", exc)
                self._warned = True
            return None

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except Exception:  # shutting down twice or after a driver error is harmless
            return


def make_gpu_stats(
    device: torch.device, log: Callable[[str], None] | None = None
) -> NvmlGpuStats | NullGpuStats:
    """`NvmlGpuStats` on a CUDA device with NVML, else `NullGpuStats` (a CUDA device without
    NVML says why once through ``log``; on CPU there is nothing to say)."""
    if device.type != "cuda":
        return NullGpuStats()
    try:
        return NvmlGpuStats(device)
    except RuntimeError as exc:
        (log or logger.warning)(f"straggler: no GPU fields ({exc})")
        return NullGpuStats()


def sample_values(sample: GpuSample | None) -> list[float]:
    """The floats this rank adds to the report's gather (NaN: not measured)."""
    return sample.values() if sample is not None else [math.nan] * len(GPU_FIELDS)


def gpu_spread(samples: Sequence[GpuSample | None]) -> Spread | None:
    """Pure: min and max of each field over the ranks that measured it, with their ranks (the
    lowest rank on a tie); None when no rank measured anything."""
    spread: Spread = {}
    for i, name in enumerate(GPU_FIELDS):
        got = [(s.values()[i], r) for r, s in enumerate(samples) if s is not None]
        got = [(v, r) for v, r in got if math.isfinite(v)]
        if got:
            spread[name] = (min(got), min(got, key=lambda vr: (-vr[0], vr[1])))
    return spread or None


def gpu_fields(spread: Spread | None) -> list[LogField]:
    """Megatron's ``MnPwr/Rnk: 650.00W/0 | MxPwr/Rnk: ...`` fields; the values go to the sinks
    as ``straggler/<field>-min`` / ``-max`` (the ranks are in the label and straggler.jsonl)."""
    if not spread:
        return []
    out = []
    for name, short, unit in _LABELS:
        if name not in spread:
            continue
        (lo, lo_rank), (hi, hi_rank) = spread[name]
        key = f"straggler/{_KEYS[name]}"
        for side, value, rank, end in (("Mn", lo, lo_rank, "min"), ("Mx", hi, hi_rank, "max")):
            fmt = f"{{:.2f}}{unit}/{rank}"  # the compact line leaves them to the sinks
            out.append(LogField(f"{side}{short}/Rnk", value, fmt, f"{key}-{end}", compact=False))
    return out


def samples_from_gather(rows: Sequence[Sequence[float]], offset: int) -> list[GpuSample | None]:
    """Each rank's sample from the gathered rows (``None`` where the rank sent NaNs)."""
    out: list[GpuSample | None] = []
    for row in rows:
        values = [float(v) for v in row[offset : offset + len(GPU_FIELDS)]]
        out.append(GpuSample(*values) if all(math.isfinite(v) for v in values) else None)
    return out
