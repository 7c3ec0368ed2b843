"""The text of the training log, in one of two formats (:class:`LogFormat`, ``--log-format``).

* ``compact`` (the default): one short line per log step, for a person at a terminal::

      [21:56:30] iteration 20/150 | lm loss 4.744 | lr 1.98e-03 | grad norm 1.43 | 908 ms/it | 1.13k tok/s | goodput 85.5%

  numbers with three or four significant digits (a CPU's 0.00245 TFLOP/s is not 0.0), the
  skipped/NaN counts only when not zero, the timers on one line, the validation on one line.
* ``megatron``: Megatron-LM's iteration line and validation block, field for field, for log
  scrapers written against Megatron (stalwart's own fields come after Megatron's last one).

`stalwart.observability.train_log.TrainingLog` builds an :class:`IntervalSummary` at each log
step and prints :func:`format_compact_line` or :func:`format_iteration_line` of it; evaluation
prints :func:`format_compact_validation` or :func:`format_validation_lines`. Pure functions:
nothing here reads a device or a clock.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


class LogFormat(enum.Enum):
    """``--log-format``: the terminal's lines (the metrics file and the sinks are the same)."""

    COMPACT = "compact"
    MEGATRON = "megatron"


@dataclass(frozen=True)
class LogField:
    """One extra field of the iteration line.

    ``label``/``fmt`` render `` <label>: <fmt.format(value)> |`` in Megatron's line; ``key``
    (optional) is the sink and metrics-file key of the value (None: stdout only). The compact
    line shows ``short`` with the formatted value at its ``{}`` (default: ``<label> <value>``),
    or leaves the field out when ``compact`` is False (its value still reaches the sinks and
    the metrics file).
    """

    label: str
    value: Any
    fmt: str = "{:.3f}"
    key: str | None = None
    short: str | None = None
    compact: bool = True


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
        line += f" throughput per GPU (TFLOP/s/GPU): {significant(s.throughput, 1)} |"
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
    if s.tflops_per_gpu is not None and s.throughput is None:  # Megatron's spelling, here too
        tail += f" throughput per GPU (TFLOP/s/GPU): {significant(s.tflops_per_gpu, 1)} |"
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


# ----------------------------------------------------------------------------- compact format
def significant(value: float, decimals: int = 1, digits: int = 3) -> str:
    """``value`` with ``decimals`` decimals (Megatron's ``{:.1f}``) unless that rounds a
    non-zero value below 1 to zero or near it: then ``digits`` significant digits
    (0.00245 TFLOP/s on a CPU, not 0.0)."""
    if not math.isfinite(value) or value == 0 or abs(value) >= 1:
        return f"{value:.{decimals}f}"
    return f"{value:.{digits}g}"


def _sig(value: float, digits: int = 3) -> str:
    """``digits`` significant digits, never an exponent at 1,000 and above (2,539 ms)."""
    if math.isfinite(value) and abs(value) >= 10**digits:
        return f"{value:,.0f}"
    return f"{value:.{digits}g}"


def _si(value: float) -> str:
    """A rate with three significant digits and k/M/G (1.13k, 534k, 2.1M)."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{unit}"
    return f"{value:.3g}"


def format_compact_line(s: IntervalSummary) -> str:
    """The compact iteration line (module docstring): what a person reads at a terminal."""
    parts = [f"iteration {s.iteration}/{s.train_iters}"]
    parts += [f"{key} {avg:.4g}" for key, avg in s.loss_averages.items()]
    if s.learning_rate is not None:
        parts.append(f"lr {s.learning_rate:.2e}")
    if s.grad_norm is not None:
        parts.append(f"grad norm {_sig(s.grad_norm)}")
    if s.loss_scale is not None and s.loss_scale != 1.0:  # fp16's dynamic scale
        parts.append(f"loss scale {_sig(s.loss_scale)}")
    if s.num_zeros is not None:
        parts.append(f"zeros {_sig(s.num_zeros)}")
    if s.params_norm is not None:
        parts.append(f"params norm {_sig(s.params_norm)}")
    parts.append(f"{_sig(s.elapsed_ms)} ms/it")
    parts += _compact_rates(s)
    parts += [compact_field(f) for f in s.extra_fields if f.compact]
    if s.skipped:
        parts.append(f"skipped {s.skipped}")
    if s.nan:
        parts.append(f"nan {s.nan}")
    stamp = f"[{s.timestamp}] " if s.timestamp is not None else ""
    return stamp + " | ".join(parts)


def compact_field(f: LogField) -> str:
    """A provider's field as the compact line shows it (see :class:`LogField`)."""
    value = f.fmt.format(f.value)
    return f.short.format(value) if f.short is not None else f"{f.label} {value}"


def _compact_rates(s: IntervalSummary) -> list[str]:
    """Tokens/s (per GPU too when there are several), TFLOP/s per GPU where the log was asked
    for it (``--log-throughput``), MFU where a peak is known."""
    out = []
    if s.tokens_per_second is not None:
        out.append(f"{_si(s.tokens_per_second)} tok/s")
        per_gpu = s.tokens_per_second_per_gpu
        if per_gpu is not None and per_gpu != s.tokens_per_second:
            out.append(f"{_si(per_gpu)} tok/s/GPU")
    if s.throughput is not None:
        out.append(f"{_sig(s.throughput)} TFLOP/s/GPU")
    if s.mfu_percent is not None:
        out.append(f"MFU {s.mfu_percent:.1f}%")
    return out


def format_compact_timers(pairs: Mapping[str, tuple[float, float]], *, minmax: bool) -> str | None:
    """The interval's timers on one line (ms per iteration): the max over ranks, or min-max
    where they differ (``minmax``); None when nothing was timed."""
    if not pairs:
        return None
    shown = []
    for name, (lo, hi) in pairs.items():
        value = f"{_sig(lo)}-{_sig(hi)}" if minmax and _sig(lo) != _sig(hi) else _sig(hi)
        shown.append(f"{name} {value}")
    where = "min-max over ranks" if minmax else "max over ranks"
    return f"  time (ms, {where}): " + " | ".join(shown)


def format_compact_validation(iteration: int, losses: Mapping[str, float], suffix: str = "") -> str:
    """One line per evaluation: each loss and its perplexity."""
    parts = [f"validation{suffix} at iteration {iteration}"]
    parts += [f"{key} {value:.4g} (ppl {_sig(ppl(value))})" for key, value in losses.items()]
    return " | ".join(parts)


def throughput_scalars(s: IntervalSummary) -> dict[str, float]:
    """Dashboard keys of the interval's rates, at every log step: Megatron's ``throughput``
    (TFLOP/s/GPU; Megatron writes it only with --log-throughput and --log-timers-to-tensorboard)
    and ours (``tokens-per-second``, ``tokens-per-second-per-gpu``, ``mfu-percent``)."""
    named = {
        "throughput": s.tflops_per_gpu,
        "tokens-per-second": s.tokens_per_second,
        "tokens-per-second-per-gpu": s.tokens_per_second_per_gpu,
        "mfu-percent": s.mfu_percent,
    }
    return {k: v for k, v in named.items() if v is not None}
