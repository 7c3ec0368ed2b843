"""The training log's settings (`LogConfig`, Megatron's flag names) and the protocol of the
objects that add fields to its log steps (`LogFieldProvider`: stragglers, memory, energy,
goodput, saves). `stalwart.observability.train_log` re-exports them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from stalwart.observability.log_lines import LogField, LogFormat
from stalwart.observability.throughput import validate_peak_tflops


@dataclass(kw_only=True)
class LogConfig:
    """Logging flags (Megatron spelling in the CLI: ``--log-interval`` etc.)."""

    log_interval: int = 10
    tensorboard_log_interval: int = 1
    log_throughput: bool = False
    log_num_zeros_in_grad: bool = False
    log_params_norm: bool = False
    log_timers_to_tensorboard: bool = False
    log_loss_scale_to_tensorboard: bool = True
    log_world_size_to_tensorboard: bool = False  # Megatron's flag and default
    log_validation_ppl_to_tensorboard: bool = False
    log_progress_bar: bool | None = None  # None: only when stdout is a TTY
    # the iteration line starts with its time: "[HH:MM:SS]" (Megatron's: the date, microseconds)
    log_timestamp: bool = True
    # --log-format: the compact line, or Megatron's line field for field (log_lines)
    log_format: LogFormat = LogFormat.COMPACT
    # --peak-tflops: the per-GPU peak MFU divides by, over the device table's (None: the table's;
    # no MFU where the table has no entry, e.g. on CPU).
    peak_tflops: float | None = None
    # every iteration's row (<metrics stem>.iterations.jsonl, the dashboards' per-iteration keys)
    # kept on the device and read once per log interval (iteration_log); off: --no-log-every-
    # iteration (the dashboards' keys are then read at each --tensorboard-log-interval step).
    log_every_iteration: bool = True

    def __post_init__(self) -> None:
        validate_peak_tflops(self.peak_tflops)
        try:  # the one conversion: an enum from here on
            self.log_format = LogFormat(self.log_format)
        except ValueError:
            allowed = ", ".join(f.value for f in LogFormat)
            raise ValueError(f"--log-format: got {self.log_format!r}, allowed: {allowed}") from None
        if self.log_interval < 1:
            raise ValueError(f"--log-interval must be >= 1, got {self.log_interval}")
        if self.tensorboard_log_interval < 1:
            raise ValueError(
                f"--tensorboard-log-interval must be >= 1, got {self.tensorboard_log_interval}"
            )


@dataclass(frozen=True)
class IntervalInfo:
    """What a provider knows about the interval being logged."""

    iteration: int
    num_iterations: int
    elapsed_ms_per_iteration: float
    consumed_samples: int
    is_first: bool


class LogFieldProvider(Protocol):
    """Adds fields to log steps (straggler, memory, energy, ...).

    Called at every log step on **every rank**, in list order, so it may run collectives; only rank
    0's fields are printed and written. Must not read the device outside log steps.
    """

    def log_fields(self, info: IntervalInfo) -> Sequence[LogField]: ...
