"""The per-iteration training log: a stdout line, TensorBoard/W&B keys and a JSONL file.

The line is compact by default, or Megatron's line field for field with
``LogConfig(log_format=LogFormat.MEGATRON)`` (``--log-format megatron``, for log scrapers; see
`stalwart.observability.log_lines`); the sinks and the metrics file are the same either way.

Call protocol (every rank, once per completed iteration)::

    timers(INTERVAL_TIME).start(barrier=True)          # once, before the first iteration
    for it in range(start, train_iters):
        ... train step ...
        train_log.on_iteration(it + 1, losses=..., learning_rate=..., ...)

``iteration`` is the **1-based number of the iteration just completed** (the count of completed
iterations), so ``iteration % log_interval == 0`` selects Megatron's log steps.

Host syncs: on an iteration that is neither a log step nor a sink step nothing is read from the
device (losses and the advanced/skipped/NaN counters are accumulated in device tensors). A log step
reads everything in one ``.tolist()``; so does a sink-only step (``--tensorboard-log-interval``)
on rank 0, which needs that iteration's values. Only **rank 0** prints and writes; other ranks
take part in the log-step collectives (interval-time barrier, timer all_gather, providers).

Differences from Megatron (deliberate): every log line resets the interval (including the first
iteration's line), timers and losses are averaged over the iterations actually in the interval,
"nan iterations" counts every iteration with a non-finite loss (not only skipped ones), negative
and undefined averages are printed (an interval with no advanced iteration prints ``NAN``). An
iteration skipped by ``--iterations-to-skip`` (``losses={}``) is one of the "skipped iterations"
(Megatron's dummy step skips the log; its counter then misses it), never a NaN one, and adds no
loss: an interval of only such iterations prints none.

Units: the dashboards (sink) get Megatron's keys and units: ``iteration-time`` and
``<timer>-time`` in seconds, ``world-size`` with ``--log-world-size-to-tensorboard`` and
``loss-scale`` (1.0 without fp16) as Megatron; flat, or grouped by a ``<group>/`` prefix with
``--group-metric-tags`` (`stalwart.observability.metric_names`). The metrics file keeps
``elapsed_ms`` and ``<timer>-time-ms`` in milliseconds (what ``stalwart report`` reads).

On a terminal, rank 0 also draws a progress bar (`stalwart.observability.progress`) with rate,
tokens/s (when ``seq_length`` is given), ETA, the last logged loss and the last validation loss;
the log lines are printed above it.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from stalwart.observability.interval_losses import IntervalLosses, TensorOrScalar
from stalwart.observability.iteration_log import IterationLog, iteration_scalars
from stalwart.observability.log_config import IntervalInfo, LogConfig, LogFieldProvider
from stalwart.observability.log_lines import (
    IntervalSummary,
    LogField,
    LogFormat,
    format_compact_line,
    format_compact_timers,
    format_compact_validation,
    format_iteration_line,
    format_validation_lines,
    ppl,
    throughput_scalars,
)
from stalwart.observability.progress import ProgressBar
from stalwart.observability.sinks import JsonlSink, MetricSink, NullSink, is_null_sink
from stalwart.observability.throughput import interval_throughput
from stalwart.observability.timer_names import INTERVAL_TIME, TRAINING_TIMERS
from stalwart.observability.timers import TimerReport, Timers, TimingLogOption

# Name of the main loss (Megatron's "lm loss"): reported as "loss" in the metrics file.
MAIN_LOSS_KEY = "lm loss"

__all__ = [
    "MAIN_LOSS_KEY",
    "IntervalInfo",
    "LogConfig",
    "LogField",
    "LogFieldProvider",
    "LogFormat",
    "TensorOrScalar",
    "TrainingLog",
    "format_validation_lines",
]


@dataclass
class _IterationInputs:
    """The current iteration's optional values, kept only until the step's read (if any)."""

    losses: Mapping[str, TensorOrScalar]
    global_batch_size: int
    learning_rate: TensorOrScalar | None
    grad_norm: TensorOrScalar | None
    loss_scale: TensorOrScalar | None
    num_zeros: TensorOrScalar | None
    params_norm: TensorOrScalar | None


class TrainingLog:
    """Megatron-style training log for one run (see the module docstring for the call protocol).

    Args:
        config: logging flags.
        train_iters: total iterations (the ``/TOTAL`` of the line).
        sink: metric sink (only used on rank 0; pass ``build_sinks(...)``).
        timers: the run's timers; ``interval-time`` is read at log steps and the standard training
            timers up to ``--timing-log-level`` are printed (and written if
            ``log_timers_to_tensorboard``).
        rank, world_size: this process's place in the job.
        flops_per_iteration: model FLOPs of one iteration, whole job; required by
            ``log_throughput``. With it every log line and metrics record has TFLOP/s per GPU,
            and MFU when a peak is known; with ``seq_length`` they have tokens/s
            (`stalwart.observability.throughput`).
        metrics_file: JSONL path (``--metrics-file``); one object per log step and per evaluation.
        extra_providers: :class:`LogFieldProvider` objects (fields appear before the counters).
        print_fn: where rank 0's lines go (printed above the progress bar when it is shown).
        seq_length: tokens per sample; with it the log, metrics and progress bar show tokens/s.
        peak_tflops_per_gpu: the device's dense peak for MFU (``device_peak_tflops``);
            ``config.peak_tflops`` (``--peak-tflops``) wins over it; None and no flag: no MFU.
    """

    def __init__(
        self,
        config: LogConfig,
        *,
        train_iters: int,
        sink: MetricSink,
        timers: Timers,
        rank: int,
        world_size: int,
        flops_per_iteration: float | None = None,
        metrics_file: str | None = None,
        extra_providers: Sequence[LogFieldProvider] = (),
        print_fn: Callable[[str], None] = print,
        seq_length: int | None = None,
        peak_tflops_per_gpu: float | None = None,
    ) -> None:
        if config.log_throughput and flops_per_iteration is None:
            raise ValueError("--log-throughput needs the model's FLOPs per iteration")
        self.config = config
        self.train_iters = train_iters
        self.rank = rank
        self.world_size = world_size
        self._is_writer = rank == 0
        self.sink: MetricSink = sink if self._is_writer else NullSink()
        self._sink_active = self._is_writer and not is_null_sink(self.sink)
        self.timers = timers
        self.flops_per_iteration = flops_per_iteration
        self.providers = tuple(extra_providers)
        self._print = print_fn
        self._metrics = JsonlSink(metrics_file) if metrics_file and self._is_writer else None
        self.seq_length = seq_length
        self.peak_tflops = (
            config.peak_tflops if config.peak_tflops is not None else peak_tflops_per_gpu
        )
        # Every iteration's row, kept on the device until the log step's read (iteration_log).
        self._every = IterationLog(
            config, writer=self._is_writer, sink=self.sink, sink_active=self._sink_active,
            metrics_file=metrics_file, seq_length=seq_length, world_size=world_size,
        )  # fmt: skip
        self._progress = ProgressBar(
            train_iters, enabled=config.log_progress_bar if self._is_writer else False
        )
        # The interval's loss sums and counters: one copy per device loss per iteration, read
        # and summed at the log step (stalwart.observability.interval_losses).
        self._losses = IntervalLosses()
        self._iters_in_interval = 0
        self._logged_once = False
        self._pending: tuple[int, _IterationInputs] | None = None  # the unlogged last iteration
        self._consumed_samples = 0
        self.total_skipped = 0
        self.total_nan = 0

    # ----------------------------------------------------------------- per iteration (hot path)
    def on_iteration(
        self,
        iteration: int,
        *,
        losses: Mapping[str, TensorOrScalar],
        learning_rate: TensorOrScalar | None,
        global_batch_size: int,
        consumed_samples: int,
        grad_norm: TensorOrScalar | None,
        skipped: torch.Tensor | bool,
        loss_scale: TensorOrScalar | None = None,
        num_zeros: TensorOrScalar | None = None,
        params_norm: TensorOrScalar | None = None,
    ) -> Mapping[str, Any] | None:
        """Record the iteration just completed (1-based ``iteration``); log/write when due.
        Returns, on rank 0 at a log step, the step's metrics-file record (host values, no
        further read: what a framework's own loggers can be offered); None otherwise.

        Collective at log steps (every rank must call with the same ``iteration``). Tensors may live
        on the training device; nothing is read from it except at log/sink steps. ``losses``
        empty with ``skipped=True``: an iteration skipped without a pass (``--iterations-to-skip``,
        as Megatron's dummy step): counted as skipped, not as a NaN iteration, and averaged into
        no loss (an interval of only such iterations prints no loss).
        """
        self._losses.add(losses, skipped)
        self._iters_in_interval += 1
        self._consumed_samples = consumed_samples
        if self.seq_length:
            self._progress.tokens_per_iteration = global_batch_size * self.seq_length
        self._progress.update(iteration)
        is_log = (
            not self._logged_once
            or iteration % self.config.log_interval == 0
            or iteration == self.train_iters  # the last one too: the run's end is on the charts
        )
        inputs = _IterationInputs(
            losses, global_batch_size, learning_rate, grad_norm, loss_scale, num_zeros, params_norm
        )
        # With every iteration kept, the dashboards' per-iteration keys come from the ring at
        # the log step: no read at a sink step.
        is_sink = (
            self._sink_active
            and not self._every.enabled
            and iteration % self.config.tensorboard_log_interval == 0
        )
        self._every.keep(
            iteration, {**_named(inputs), "skipped": skipped},
            consumed_samples=consumed_samples, global_batch_size=global_batch_size,
        )  # fmt: skip
        self._pending = None if is_log else (iteration, inputs)  # references only: no read
        if not (is_log or is_sink):
            return None
        values = self._read(inputs, interval=is_log) if self._is_writer else {}
        if is_sink:
            self._write_iteration_scalars(iteration, inputs, values)
        if is_log:
            return self._log_interval(iteration, global_batch_size, values)
        return None

    def flush(self) -> None:
        """Log the iterations since the last log step now (an exit between log steps), so the
        run's last iteration has its line and record; nothing when none are pending.

        Collective, like a log step: call on every rank, at the same (agreed) exit.
        """
        if self._pending is None or self._iters_in_interval == 0:
            return
        iteration, inputs = self._pending
        self._pending = None
        values = self._read(inputs, interval=True) if self._is_writer else {}
        self._log_interval(iteration, inputs.global_batch_size, values)

    # ----------------------------------------------------------------- log / sink steps
    def _read(self, inputs: _IterationInputs, *, interval: bool) -> dict[str, float | None]:
        """Read every device value this step needs in ONE transfer; host scalars pass through."""
        named = _named(inputs)
        ring = None
        if interval:
            named.update(self._losses.to_read())
            ring = self._every.to_read()  # every iteration's row rides on this read
        device = self._losses.device or torch.device("cpu")
        tensors = {k: v for k, v in named.items() if isinstance(v, torch.Tensor)}
        tensor_names = list(tensors)
        out: dict[str, float | None] = {
            k: (None if v is None else float(v))
            for k, v in named.items()
            if not isinstance(v, torch.Tensor)
        }
        parts = [t.detach().reshape(()).to(device, torch.float64) for t in tensors.values()]
        flat: list[float] = []
        if parts or ring is not None:
            stacked = torch.stack(parts) if parts else torch.empty(0, dtype=torch.float64)
            if ring is not None:
                stacked = torch.cat([stacked.to(ring.device), ring])
            # Deliberate sync: the one device read of a log/sink step.
            flat = stacked.tolist()
            out.update(zip(tensor_names, flat))
        if interval:
            self._every.took(flat[len(tensor_names) :])
            out.update(self._losses.totals(out))
        return out

    def _write_iteration_scalars(
        self, iteration: int, inputs: _IterationInputs, values: Mapping[str, float | None]
    ) -> None:
        """Megatron's per-iteration keys, each with its "vs samples" twin (x = consumed samples)."""
        scalars = iteration_scalars(
            self.config, values, inputs.global_batch_size, inputs.losses, self.world_size
        )
        self.sink.add_scalars(scalars, iteration)
        self.sink.add_scalars(
            {f"{k} vs samples": v for k, v in scalars.items()}, self._consumed_samples
        )

    def _log_interval(
        self, iteration: int, global_batch_size: int, values: Mapping[str, float | None]
    ) -> dict[str, Any] | None:
        """Log step on every rank: collectives first, then rank 0 prints/writes (and returns
        the metrics record), then reset."""
        n = max(self._iters_in_interval, 1)
        interval_timer = self.timers(INTERVAL_TIME)
        # barrier=True: the interval ends at the same moment on every rank (as Megatron).
        elapsed_ms = interval_timer.elapsed(reset=True, barrier=True) * 1000.0 / n
        report = self.timers.report(self.timers.enabled_names(TRAINING_TIMERS), normalizer=n)
        info = IntervalInfo(iteration, n, elapsed_ms, self._consumed_samples, not self._logged_once)
        with self._progress.external_write():  # a provider may print (the memory report)
            fields = [f for p in self.providers for f in p.log_fields(info)]
        record = None
        if self._is_writer:
            self._every.emit()  # the interval's iterations first: the files stay in order
            summary = self._summarize(iteration, global_batch_size, elapsed_ms, values, fields)
            record = self._emit(summary, report, is_first=not self._logged_once)
        self._reset_interval()
        return record

    def _summarize(
        self,
        iteration: int,
        global_batch_size: int,
        elapsed_ms: float,
        values: Mapping[str, float | None],
        fields: Sequence[LogField],
    ) -> IntervalSummary:
        advanced = int(values.get("count:advanced") or 0)
        without_pass = self._losses.skipped_without_pass
        averages = {
            k: (values[f"sum:{k}"] or 0.0) / advanced if advanced > 0 else math.nan
            for k in self._losses.keys
        }
        if without_pass == self._iters_in_interval:
            averages = {}  # only --iterations-to-skip: no loss was computed, none is shown
        rates = interval_throughput(
            flops_per_iteration=self.flops_per_iteration,
            tokens_per_iteration=global_batch_size * self.seq_length if self.seq_length else None,
            elapsed_ms=elapsed_ms,
            world_size=self.world_size,
            peak_tflops_per_gpu=self.peak_tflops,
        )
        throughput = rates.tflops_per_gpu if self.config.log_throughput else None  # Megatron's
        stamp = None
        if self.config.log_timestamp:
            megatron = self.config.log_format is LogFormat.MEGATRON
            stamp = datetime.datetime.now().strftime(
                "%Y-%m-%d %H:%M:%S.%f" if megatron else "%H:%M:%S"
            )
        return IntervalSummary(
            iteration=iteration,
            train_iters=self.train_iters,
            consumed_samples=self._consumed_samples,
            elapsed_ms=elapsed_ms,
            global_batch_size=global_batch_size,
            loss_averages=averages,
            skipped=int(values.get("count:skipped") or 0) + without_pass,
            nan=int(values.get("count:nan") or 0),
            learning_rate=values.get("lr"),
            throughput=throughput,
            loss_scale=values.get("loss_scale"),
            grad_norm=values.get("grad_norm"),
            num_zeros=values.get("num_zeros"),
            params_norm=values.get("params_norm"),
            extra_fields=tuple(fields),
            timestamp=stamp,
            tokens_per_second=rates.tokens_per_second,
            tokens_per_second_per_gpu=rates.tokens_per_second_per_gpu,
            tflops_per_gpu=rates.tflops_per_gpu,
            mfu_percent=rates.mfu_percent,
        )

    def _emit(
        self, s: IntervalSummary, report: TimerReport | None, *, is_first: bool
    ) -> dict[str, Any]:
        """Rank 0: print the line and the timers, write log-step scalars and the metrics
        record (returned)."""
        self.total_skipped += s.skipped
        self.total_nan += s.nan
        with self._progress.external_write():
            for line in self._lines(s, report):
                self._print(line)
        timer_scalars = report.scalars() if report is not None else {}
        scalars = {f.key: float(f.value) for f in s.extra_fields if f.key is not None}
        if self.config.log_timers_to_tensorboard:
            if not is_first:  # the first interval includes start-up time (as Megatron)
                scalars["iteration-time"] = s.elapsed_ms / 1000.0  # seconds, as Megatron
            if report is not None:
                scalars.update(report.megatron_scalars())
        scalars.update(throughput_scalars(s))
        if scalars:
            self.sink.add_scalars(scalars, s.iteration)
        record = self._metrics_record(s, timer_scalars)
        if self._metrics is not None:
            self._metrics.write_record(record)
        main = s.loss_averages.get(MAIN_LOSS_KEY)
        self._progress.set_stats(loss=main, loss_name=MAIN_LOSS_KEY)
        self._progress.update(s.iteration)
        return record

    def _lines(self, s: IntervalSummary, report: TimerReport | None) -> list[str]:
        """The log step's lines in the configured format: the iteration line, then the timers
        (one line in the compact format, unless every rank's value was asked for)."""
        option = self.timers.log_option
        if self.config.log_format is LogFormat.MEGATRON or option is TimingLogOption.ALL:
            timers = report.format(option) if report is not None else None
        else:
            pairs = report.min_max() if report is not None else {}
            timers = format_compact_timers(pairs, minmax=option is TimingLogOption.MINMAX)
        if self.config.log_format is LogFormat.MEGATRON:
            line = format_iteration_line(s)
        else:
            line = format_compact_line(s)
        return [line] if timers is None else [line, timers]

    def _metrics_record(self, s: IntervalSummary, timer_scalars: Mapping[str, float]) -> dict:
        main_key = (
            MAIN_LOSS_KEY if MAIN_LOSS_KEY in s.loss_averages else next(iter(s.loss_averages), None)
        )
        record: dict[str, Any] = dict(
            split="train",
            iteration=s.iteration,
            consumed_samples=s.consumed_samples,
            loss=s.loss_averages[main_key] if main_key is not None else None,
            lr=s.learning_rate,
            grad_norm=s.grad_norm,
            elapsed_ms=s.elapsed_ms,
            global_batch_size=s.global_batch_size,
            loss_scale=s.loss_scale,
            num_zeros=s.num_zeros,
            params_norm=s.params_norm,
            throughput_tflops_per_gpu=s.tflops_per_gpu,
            tokens_per_second=s.tokens_per_second,
            tokens_per_second_per_gpu=s.tokens_per_second_per_gpu,
            mfu_percent=s.mfu_percent,
            skipped_iterations=s.skipped,
            nan_iterations=s.nan,
            total_skipped_iterations=self.total_skipped,
            total_nan_iterations=self.total_nan,
            world_size=self.world_size,
        )
        record.update(s.loss_averages)
        record.update({f.key: f.value for f in s.extra_fields if f.key is not None})
        record.update(timer_scalars)
        return record

    def _reset_interval(self) -> None:
        self._losses.reset()
        self._iters_in_interval = 0
        self._logged_once = True

    # ----------------------------------------------------------------- evaluation / shutdown
    def on_eval(
        self,
        iteration: int,
        losses: Mapping[str, TensorOrScalar],
        *,
        consumed_samples: int | None = None,
        suffix: str = "",
    ) -> None:
        """Print Megatron's validation block and write ``"<key> validation<suffix>"`` keys (rank 0).

        ``losses`` are the averaged validation losses. ``consumed_samples`` defaults to the value of
        the last ``on_iteration``. ``suffix`` is ``-<name>`` for extra validation sets.
        """
        if not self._is_writer:
            return
        # Deliberate sync: evaluation has finished; its averaged losses are read once here.
        host = {k: float(v) for k, v in losses.items()}
        samples = self._consumed_samples if consumed_samples is None else consumed_samples
        if self.config.log_format is LogFormat.MEGATRON:
            lines = format_validation_lines(iteration, host, suffix)
        else:
            lines = [format_compact_validation(iteration, host, suffix)]
        with self._progress.external_write():
            for line in lines:
                self._print(line)
        if not suffix and MAIN_LOSS_KEY in host:
            self._progress.set_stats(val_loss=host[MAIN_LOSS_KEY])
        by_iter: dict[str, float] = {}
        for key, value in host.items():
            by_iter[f"{key} validation{suffix}"] = value
            if self.config.log_validation_ppl_to_tensorboard:
                by_iter[f"{key} validation{suffix} ppl"] = ppl(value)
        self.sink.add_scalars(by_iter, iteration)
        self.sink.add_scalars({f"{k} vs samples": v for k, v in by_iter.items()}, samples)
        if self._metrics is not None:
            record: dict[str, Any] = dict(
                split=f"validation{suffix}", iteration=iteration, consumed_samples=samples
            )
            record.update(by_iter)
            record.update({f"{k} validation{suffix} ppl": ppl(v) for k, v in host.items()})
            self._metrics.write_record(record)

    def end_progress(self) -> None:
        """Leave the progress bar for good (idempotent): training is over, so the lines that
        follow (final save, exit, goodput) print below it and it is not drawn again."""
        self._progress.close()

    def close(self) -> None:
        """Flush the sink, close the metrics file and the progress bar (the sink's owner closes
        it)."""
        self._progress.close()
        self.sink.flush()
        self._every.close()
        if self._metrics is not None:
            self._metrics.close()


def _named(i: _IterationInputs) -> dict[str, TensorOrScalar | None]:
    """An iteration's values under the names of the log's read (``cur:<loss>`` for losses)."""
    named: dict[str, TensorOrScalar | None] = dict(
        lr=i.learning_rate, grad_norm=i.grad_norm, loss_scale=i.loss_scale,
        num_zeros=i.num_zeros, params_norm=i.params_norm,
    )  # fmt: skip
    named.update({f"cur:{k}": v for k, v in i.losses.items()})
    return named
