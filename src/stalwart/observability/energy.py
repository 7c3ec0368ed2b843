"""GPU energy and power from NVML's total-energy counter (``--log-energy``).

Usage in a hand-written loop::

    meter = EnergyConfig(log_energy=True).build(device)   # logs "energy: not available" once
    meter.start()
    for it in range(1, iters + 1):
        step.run(it)
        if it % log_interval == 0:
            lap = meter.lap(num_iterations=log_interval)     # collective when distributed
            print(meter.scalars())       # {"iter-energy/gpu": J/iter/GPU, "power/gpu": W/GPU}

As a `TrainingLog` provider, ``meter.log_fields(info)`` runs ``lap(info.num_iterations)``.
    # around checkpoint saves: meter.pause(); save(); meter.resume()

Each rank reads ``nvmlDeviceGetTotalEnergyConsumption`` (millijoules since driver load) for its own
device; ``lap`` sums joules and GPU counts over ranks in ONE all-reduce and reports the mean per
GPU. ``pynvml`` (package ``nvidia-ml-py``) is imported lazily; ``--log-energy`` without it is
refused before start-up (``ShellConfig.check_extras``: ``pip install 'stalwart[nvml]'``).
Without NVML's driver library or a CUDA device the meter logs "energy: not available (<reason>)"
once and reports nothing, but still joins the all-reduce so that mixed ranks cannot deadlock. Cost:
one NVML call (~10 µs) per lap, no device sync.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from stalwart.distributed import collectives
from stalwart.observability.nvml import open_nvml_handle
from stalwart.observability.train_log import IntervalInfo, LogField


@dataclass(frozen=True)
class EnergyLap:
    """Energy over one log interval, averaged over the GPUs that reported."""

    joules_per_iteration_per_gpu: float
    watts_per_gpu: float


def _nvml_handle(device: torch.device) -> tuple[Any, Any]:
    """Open NVML and return (module, handle) for ``device``; raise RuntimeError with a reason."""
    pynvml, handle = open_nvml_handle(device)
    try:
        pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
    except Exception as exc:
        raise RuntimeError(f"total-energy counter unsupported: {exc}") from exc
    return pynvml, handle


class EnergyMeter:
    """Per-rank NVML energy counter with per-interval laps.

    Args:
        device: this rank's device.
        log: where the one-time "not available" message goes (default: this module's logger).
        group: process group for the per-lap all-reduce.
    """

    def __init__(
        self,
        device: torch.device,
        log: Callable[[str], None] | None = None,
        group: ProcessGroup | None = None,
    ) -> None:
        self.device = device
        self.group = group
        self._log = log if log is not None else logging.getLogger(__name__).warning
        self._nvml: Any = None
        self._handle: Any = None
        self.reason: str | None = None
        try:
            self._nvml, self._handle = _nvml_handle(device)
        except RuntimeError as exc:
            self.reason = str(exc)
            self._log(f"energy: not available ({self.reason})")
        self._last_mj = 0.0
        self._last_t = 0.0
        self._paused_mj = 0.0
        self._paused_s = 0.0
        self._pause_start: tuple[float, float] | None = None
        self._lap: EnergyLap | None = None

    @property
    def available(self) -> bool:
        return self.reason is None

    def _read(self) -> tuple[float, float]:
        now = time.perf_counter()
        if self._handle is None:
            return 0.0, now
        return float(self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)), now

    def start(self) -> None:
        """Begin the first interval (call right before the training loop)."""
        self._last_mj, self._last_t = self._read()
        self._paused_mj = self._paused_s = 0.0

    def pause(self) -> None:
        """Exclude what follows (e.g. a checkpoint save) from the current interval."""
        if self._pause_start is None:
            self._pause_start = self._read()

    def resume(self) -> None:
        if self._pause_start is not None:
            mj, t = self._read()
            self._paused_mj += mj - self._pause_start[0]
            self._paused_s += t - self._pause_start[1]
            self._pause_start = None

    def lap(self, num_iterations: int) -> EnergyLap | None:
        """Close the interval: mean J/iter/GPU and W/GPU over ranks (one all-reduce).

        Collective when a process group exists: every rank calls it at the same iteration.
        Returns ``None`` when no rank has a counter.
        """
        mj, t = self._read()
        joules = (mj - self._last_mj - self._paused_mj) / 1000.0
        seconds = t - self._last_t - self._paused_s
        self._last_mj, self._last_t = mj, t
        self._paused_mj = self._paused_s = 0.0
        flag = 1.0 if self.available else 0.0
        values = [joules * flag, seconds * flag, flag]
        if collectives.is_initialized():
            values = collectives.all_reduce_floats(values, dist.ReduceOp.SUM, self.group)
        total_j, total_s, gpus = values
        if gpus < 0.5:
            self._lap = None
            return None
        n = round(gpus)
        mean_s = total_s / n
        self._lap = EnergyLap(
            joules_per_iteration_per_gpu=total_j / n / max(num_iterations, 1),
            watts_per_gpu=(total_j / n) / mean_s if mean_s > 0 else 0.0,
        )
        return self._lap

    def log_fields(self, info: IntervalInfo) -> list[LogField]:
        """`LogFieldProvider`: lap (collective) and return Megatron's energy/power fields."""
        lap = self.lap(info.num_iterations)
        if lap is None:
            return []
        return [
            LogField(
                "energy per GPU (J/iter/GPU)",
                lap.joules_per_iteration_per_gpu,
                "{:.1f}",
                "iter-energy/gpu",
                compact=False,
            ),
            LogField(
                "power per GPU (W/GPU)", lap.watts_per_gpu, "{:.1f}", "power/gpu", short="{} W/GPU"
            ),
        ]

    def scalars(self) -> dict[str, float]:
        """Metric-sink provider: ``iter-energy/gpu`` and ``power/gpu`` (Megatron keys)."""
        if self._lap is None:
            return {}
        return {
            "iter-energy/gpu": self._lap.joules_per_iteration_per_gpu,
            "power/gpu": self._lap.watts_per_gpu,
        }

    def close(self) -> None:
        if self._nvml is not None:
            # Shutting down twice or after a driver error is harmless.
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()
            self._nvml = self._handle = None


class NullEnergyMeter:
    """``--log-energy`` off: no NVML, no collectives."""

    available = False
    reason: str | None = "disabled"

    def start(self) -> None: ...
    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def lap(self, num_iterations: int) -> None: ...

    def log_fields(self, info: IntervalInfo) -> list[LogField]:
        return []

    def scalars(self) -> dict[str, float]:
        return {}

    def close(self) -> None: ...


@dataclass(kw_only=True, frozen=True)
class EnergyConfig:
    """``--log-energy``: joules and watts per GPU in the log line (NVML; ``stalwart[nvml]``)."""

    log_energy: bool = False

    def check_extras(self, spell: Callable[[str], str] | None = None) -> None:
        """``pynvml`` is importable when the setting is on (``ValueError`` naming it as
        ``spell`` writes a field's name, the flag by default, otherwise)."""
        if self.log_energy:
            from stalwart.observability.sinks import flag_name, require_extra

            require_extra((spell or flag_name)("log_energy"), "pynvml", "nvidia-ml-py", "nvml")

    def build(
        self,
        device: torch.device,
        log: Callable[[str], None] | None = None,
        group: ProcessGroup | None = None,
    ) -> EnergyMeter | NullEnergyMeter:
        """``log_energy``: the meter (its all-reduce on ``group``), else the null one."""
        return EnergyMeter(device, log, group) if self.log_energy else NullEnergyMeter()
