"""The text of the training log: Megatron's iteration line and validation block.

`stalwart.observability.train_log.TrainingLog` builds an :class:`IntervalSummary` at each log
step and prints :func:`format_iteration_line` of it; evaluation prints
:func:`format_validation_lines`. Pure functions: nothing here reads a device or a clock.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class LogField:
    """One extra field of the iteration line.

    ``label``/``fmt`` render `` <label>: <fmt.format(value)> |``; ``key`` (optional) is the sink and
    metrics-file key of the value (None: stdout only).
    """

    label: str
    value: Any
    fmt: str = "{:.3f}"
    key: str | None = None


@dataclass(frozen=True)
class IntervalSummary:
    """Everything one iteration line shows (host values, after the log-step read)."""

    iteration: int
    train_iters: int
    consumed_samples: int
    elapsed_ms: float
    global_batch_size: int
    loss_averages: Mapping[str, float]
    skipped: int
    nan: int
    learning_rate: float | None = None
    throughput: float | None = None
    loss_scale: float | None = None
    grad_norm: float | None = None
    num_zeros: float | None = None
    params_norm: float | None = None
    extra_fields: Sequence[LogField] = field(default_factory=tuple)
    timestamp: str | None = None
    # Ours, after Megatron's fields (torchtitan's three): None leaves the field out.
    tokens_per_second: float | None = None
    tokens_per_second_per_gpu: float | None = None
    tflops_per_gpu: float | None = None  # printed here only when Megatron's field is not
    mfu_percent: float | None = None


def format_iteration_line(s: IntervalSummary) -> str:
    """Megatron's iteration line, field for field (see the module docstring for the differences)."""
    line = f" [{s.timestamp}]" if s.timestamp is not None else ""
    line += f" iteration {s.iteration:8d}/{s.train_iters:8d} |"
    line += f" consumed samples: {s.consumed_samples:12d} |"
    line += f" elapsed time per iteration (ms): {s.elapsed_ms:.1f} |"
    if s.throughput is not None:
        line += f" throughput per GPU (TFLOP/s/GPU): {s.throughput:.1f} |"
    if s.learning_rate is not None:
        line += f" learning rate: {s.learning_rate:.6E} |"
    line += f" global batch size: {s.global_batch_size:5d} |"
    for key, avg in s.loss_averages.items():
        line += f" {key}: {avg:.6E} |"
    if s.loss_scale is not None:
        line += f" loss scale: {s.loss_scale:.1f} |"
    if s.grad_norm is not None:
        line += f" grad norm: {s.grad_norm:.3f} |"
    if s.num_zeros is not None:
        zeros = int(s.num_zeros) if math.isfinite(s.num_zeros) else s.num_zeros
        line += f" num zeros: {zeros} |"
    if s.params_norm is not None:
        line += f" params norm: {s.params_norm:.3f} |"
    for f in s.extra_fields:
        line += f" {f.label}: {f.fmt.format(f.value)} |"
    line += f" number of skipped iterations: {s.skipped:3d} |"
    line += f" number of nan iterations: {s.nan:3d} |"
    return line + _throughput_tail(s)


def _throughput_tail(s: IntervalSummary) -> str:
    """Tokens/s, TFLOP/s/GPU (unless Megatron's field already shows it) and MFU, after
    Megatron's last field so that a Megatron log parser reads the line unchanged."""
    tail = ""
    if s.tokens_per_second is not None:
        tail += f" tokens per second: {s.tokens_per_second:.0f} |"
    if s.tokens_per_second_per_gpu is not None:
        tail += f" tokens per second per GPU: {s.tokens_per_second_per_gpu:.0f} |"
    if s.tflops_per_gpu is not None and s.throughput is None:
        tail += f" TFLOP/s/GPU: {s.tflops_per_gpu:.2f} |"
    if s.mfu_percent is not None:
        tail += f" MFU: {s.mfu_percent:.1f}% |"
    return tail


def format_validation_lines(
    iteration: int, losses: Mapping[str, float], suffix: str = ""
) -> list[str]:
    """Megatron's validation block: dashes, the loss/PPL line, dashes. PPL = exp(min(20, loss))."""
    text = f" validation{suffix} loss at iteration {iteration} | "
    for key, value in losses.items():
        text += f"{key} value: {value:.6E} | {key} PPL: {ppl(value):.6E} | "
    dashes = "-" * (len(text) + 1)
    return [dashes, text, dashes]


def ppl(loss: float) -> float:
    """Megatron's perplexity: exp(min(20, loss)); NaN stays NaN."""
    return math.exp(min(20.0, loss)) if not math.isnan(loss) else math.nan
