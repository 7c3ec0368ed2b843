"""Named wall-clock timers with Megatron-compatible API, cross-rank aggregation and one unit.

Contract summary:

* ``Timers(log_level, log_option)`` hands out timers by name. A timer whose level is above the
  configured ``--timing-log-level`` is the one shared :class:`NullTimer` (no registration, no cost).
* ``Timer.elapsed()`` returns **seconds** (Megatron's API). :meth:`Timers.log` strings are in
  **milliseconds** (as Megatron's stdout); :meth:`Timers.write` writes Megatron's dashboard keys,
  ``"<name>-time"`` in **seconds** (:meth:`TimerReport.megatron_scalars`). The metrics file and
  the run report keep ``"<name>-time-ms"`` in milliseconds (:meth:`TimerReport.scalars`).
* :meth:`Timers.log` / :meth:`Timers.write` / :meth:`Timers.report` are collectives: every rank must
  call them with the same names. One ``all_gather`` of a ``[world, len(names)]`` matrix serves both
  the string and the scalars. Only **rank 0** gets a string back and writes scalars.

Modes (:class:`TimingMode`):

* ``SYNC``: Megatron's behaviour: ``torch.cuda.synchronize`` on start/stop when the device is CUDA,
  then the host clock. Measures wall time including host gaps and communication waits.
* ``EVENTS``: CUDA events recorded on the current stream; start/stop never block the host. The
  elapsed time is resolved lazily when it is read (log steps). On a non-CUDA device there are no
  events, so ``EVENTS`` falls back to the host clock (identical to ``SYNC`` there).

What the guarded step's timers hold (``stalwart.loop.GuardedStep``): ``forward-backward`` every
pass's work once, eager or a graph's replay, rerun passes included; the look-ahead's launch of
the next iteration's first micro-batch (or whole replay) is timed when it is queued, so a log
interval holds one launch it did not start with and lacks one it ended with (the same work in
steady state). ``optimizer`` the clip and step, eager or the optimizer graph's replay; in
``EVENTS`` mode an overlapped replay's end event is recorded on its second stream. With the
step inside the full-iteration graph (``--cuda-graph-include-optimizer``) one replay holds both:
in ``EVENTS`` mode on CUDA an external event pair captured around the step splits it
(``forward-backward`` = graph start -> boundary, ``optimizer`` = boundary -> graph end, read
lazily: ``stalwart.observability.timer_split``); in ``SYNC`` mode (host clock) a replay cannot
be split, so ``forward-backward`` holds the step and ``optimizer`` only the steps the host held
out of the graph, which the log states once at start. Tested with injected per-phase delays:
``tests/loop/test_timer_phases.py`` (CPU), ``tests/gpu/test_timer_phases_gpu.py`` (device).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from stalwart.distributed import collectives
from stalwart.observability.timer_names import STANDARD_TIMER_LEVELS
from stalwart.observability.timer_report import TimerReport, TimingLogOption, check_log_option

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from stalwart.observability.sinks import MetricSink

MAX_LOG_LEVEL = 2

# Fold finished CUDA event pairs once this many are pending, so long intervals stay bounded.
_MAX_PENDING_EVENTS = 64


class TimingMode(enum.Enum):
    """How a timer measures: see the module docstring."""

    SYNC = "sync"
    EVENTS = "events"


def validate_timing_flags(log_level: int, log_option: TimingLogOption) -> None:
    """Check ``--timing-log-level``/``--timing-log-option`` as a config holds them.

    Raises:
        ValueError: naming ``--timing-log-level`` when the level is not 0-2.
        TypeError: ``log_option`` is not a :class:`TimingLogOption`.
    """
    if isinstance(log_level, bool) or not isinstance(log_level, int):
        raise ValueError(
            f"--timing-log-level must be an integer 0-{MAX_LOG_LEVEL}, got {log_level!r}"
        )
    if not 0 <= log_level <= MAX_LOG_LEVEL:
        raise ValueError(f"--timing-log-level must be one of 0, 1, 2, got {log_level}")
    check_log_option(log_option)


class NullTimer:
    """Timer for names above the configured level: every call is a no-op.

    Reading it is a programming error (the caller asked for a timer it disabled), so
    ``elapsed``/``active_time`` raise ``RuntimeError`` rather than return a misleading 0.
    """

    name = "null timer"

    def start(self, barrier: bool = False) -> None: ...
    def stop(self, barrier: bool = False) -> None: ...
    def reset(self) -> None: ...
    def set_barrier_group(self, barrier_group: ProcessGroup | None) -> None: ...
    def set_elapsed(self, value: float) -> None: ...

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        raise RuntimeError(
            "null timer cannot report elapsed time; its log_level is above --timing-log-level"
        )

    def active_time(self) -> float:
        raise RuntimeError(
            "null timer cannot report active time; its log_level is above --timing-log-level"
        )


class Timer:
    """One named timer. Accumulates across start/stop pairs until reset; times are in seconds.

    ``elapsed`` on a running timer stops it, reads, optionally resets, and restarts it (as
    Megatron). ``reset`` clears the elapsed accumulator but not ``active_time`` (cumulative since
    creation).
    """

    def __init__(
        self,
        name: str,
        log_level: int,
        mode: TimingMode,
        device: torch.device,
        barrier_group: ProcessGroup | None = None,
    ) -> None:
        self.name = name
        self.log_level = log_level
        self._device = device
        self._sync = mode is TimingMode.SYNC and device.type == "cuda"
        self._use_events = mode is TimingMode.EVENTS and device.type == "cuda"
        self._barrier_group = barrier_group
        self._elapsed_s = 0.0
        self._active_s = 0.0
        self._running = False
        self._start_wall = 0.0
        self._start_event: torch.cuda.Event | None = None
        # (start, end) event pairs not yet converted to seconds; counted in elapsed and active.
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        # Pairs dropped by reset() before being resolved: they still count in active_time().
        self._pending_active_only: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        # Seconds read when the timer is (add_deferred); the same split as the pairs above.
        self._deferred: list[Callable[[], float]] = []
        self._deferred_active_only: list[Callable[[], float]] = []

    @property
    def is_running(self) -> bool:
        return self._running

    def set_barrier_group(self, barrier_group: ProcessGroup | None) -> None:
        """The group that ``barrier=True`` waits for in :meth:`start`, :meth:`stop` and
        :meth:`elapsed` (Megatron's API; None: the default world group). A timer of a phase that
        only some ranks run (one pipeline stage, one replica group) barriers with its peers
        only, so the ranks outside it are not held up."""
        self._barrier_group = barrier_group

    def set_elapsed(self, value: float) -> None:
        """Set the accumulated seconds since the last reset to ``value`` (Megatron's API).

        Work timed but not yet read (CUDA event pairs, deferred figures) is replaced: it still
        counts in :meth:`active_time`, like a :meth:`reset`. A running timer keeps running.
        """
        self._pending_active_only.extend(self._pending)
        self._pending = []
        self._deferred_active_only.extend(self._deferred)
        self._deferred = []
        self._elapsed_s = float(value)

    def start(self, barrier: bool = False) -> None:
        if self._running:
            raise RuntimeError(f"timer {self.name!r} has already been started")
        if barrier:
            collectives.barrier(self._barrier_group)
        if self._use_events:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self._device))
            self._start_event = event
        else:
            if self._sync:
                # Deliberate sync (SYNC mode only): wall time must include queued device work.
                torch.cuda.synchronize(self._device)
            self._start_wall = time.perf_counter()
        self._running = True

    def stop(self, barrier: bool = False) -> None:
        if not self._running:
            raise RuntimeError(f"timer {self.name!r} is not started")
        if barrier:
            collectives.barrier(self._barrier_group)
        if self._use_events:
            end = torch.cuda.Event(enable_timing=True)
            end.record(torch.cuda.current_stream(self._device))
            assert self._start_event is not None
            self._pending.append((self._start_event, end))
            self._start_event = None
            if len(self._pending) >= _MAX_PENDING_EVENTS:
                self._fold_finished()
        else:
            if self._sync:
                # Deliberate sync (SYNC mode only): see start().
                torch.cuda.synchronize(self._device)
            delta = time.perf_counter() - self._start_wall
            self._elapsed_s += delta
            self._active_s += delta
        self._running = False

    def _fold_finished(self) -> None:
        """Convert event pairs whose end already completed (non-blocking ``query``)."""
        still: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        for start, end in self._pending:
            if end.query():
                seconds = start.elapsed_time(end) / 1000.0
                self._elapsed_s += seconds
                self._active_s += seconds
            else:
                still.append((start, end))
        self._pending = still

    def add_deferred(self, seconds: Callable[[], float]) -> None:
        """Add ``seconds()`` (may be negative) when the timer is next read, not now: a figure
        of events the caller owns (``stalwart.observability.timer_split``)."""
        self._deferred.append(seconds)

    def _resolve(self) -> None:
        for read in self._deferred:
            seconds = read()
            self._elapsed_s += seconds
            self._active_s += seconds
        for read in self._deferred_active_only:
            self._active_s += read()
        self._deferred, self._deferred_active_only = [], []
        if not self._pending and not self._pending_active_only:
            return
        for start, end in self._pending:
            # Deliberate sync: EVENTS mode resolves lazily, only when a value is read (log step).
            end.synchronize()
            seconds = start.elapsed_time(end) / 1000.0
            self._elapsed_s += seconds
            self._active_s += seconds
        for start, end in self._pending_active_only:
            end.synchronize()  # Deliberate sync: same as above, for active_time().
            self._active_s += start.elapsed_time(end) / 1000.0
        self._pending = []
        self._pending_active_only = []

    def reset(self) -> None:
        """Zero the elapsed accumulator and mark the timer stopped (active time is kept)."""
        self._elapsed_s = 0.0
        self._pending_active_only.extend(self._pending)
        self._pending = []
        self._deferred_active_only.extend(self._deferred)
        self._deferred = []
        self._start_event = None
        self._running = False

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        """Accumulated seconds since the last reset (a running timer is stopped and restarted)."""
        was_running = self._running
        if was_running:
            self.stop(barrier=barrier)
        self._resolve()
        value = self._elapsed_s
        if reset:
            self.reset()
        if was_running:
            self.start(barrier=barrier)
        return value

    def active_time(self) -> float:
        """Seconds this timer has been running since creation, across resets."""
        self._resolve()
        return self._active_s


@dataclass(kw_only=True, frozen=True)
class TimerConfig:
    """``--timing-log-level``, ``--timing-log-option``, ``--timing-mode``: enums from
    construction on (a string is converted once, naming the flag on anything else)."""

    timing_log_level: int = 0
    timing_log_option: TimingLogOption = TimingLogOption.MINMAX
    timing_mode: TimingMode = TimingMode.SYNC

    def __post_init__(self) -> None:
        for name, kind, flag in (
            ("timing_log_option", TimingLogOption, "--timing-log-option"),
            ("timing_mode", TimingMode, "--timing-mode"),
        ):
            value = getattr(self, name)
            try:
                object.__setattr__(self, name, kind(value))
            except ValueError:
                allowed = ", ".join(str(m.value) for m in kind)
                raise ValueError(f"{flag}: got {value!r}, allowed: {allowed}") from None
        validate_timing_flags(self.timing_log_level, self.timing_log_option)

    def build(self, device: torch.device) -> Timers:
        return Timers(
            self.timing_log_level, self.timing_log_option, mode=self.timing_mode, device=device
        )


class Timers:
    """Registry of named timers (one per process; pass it to whoever times something).

    Args:
        log_level: ``--timing-log-level`` (0-2). Timers above it are the shared :class:`NullTimer`.
        log_option: ``--timing-log-option``, a :class:`TimingLogOption`.
        mode: :class:`TimingMode`; ``EVENTS`` needs a CUDA ``device`` (else it uses the host clock).
        device: device whose work is timed; default: the current CUDA device if any, else CPU.
        group: process group for aggregation and barriers (None: world).
    Raises:
        ValueError: naming ``--timing-log-level``.
        TypeError: ``mode`` is not a :class:`TimingMode` (a string would silently time on the
            host clock: parse it once, ``TimingMode("events")``), or ``log_option`` is not a
            :class:`TimingLogOption`.
    """

    def __init__(
        self,
        log_level: int = 0,
        log_option: TimingLogOption = TimingLogOption.MINMAX,
        mode: TimingMode = TimingMode.SYNC,
        device: torch.device | None = None,
        group: ProcessGroup | None = None,
    ) -> None:
        validate_timing_flags(log_level, log_option)
        if not isinstance(mode, TimingMode):
            raise TypeError(f"Timers mode must be a TimingMode, got {mode!r}")
        if device is None:
            device = (
                torch.device("cuda", torch.cuda.current_device())
                if torch.cuda.is_available()
                else torch.device("cpu")
            )
        self.log_level = log_level
        self.log_option = log_option
        self.mode = mode
        self.device = device
        self._group = group
        self._timers: dict[str, Timer] = {}
        self._null = NullTimer()
        self._null_names: set[str] = set()  # names asked without a level that are disabled

    def __call__(self, name: str, log_level: int | None = None) -> Timer | NullTimer:
        """The timer ``name``; the shared NullTimer when its level exceeds ``--timing-log-level``.

        ``log_level=None`` means: the existing timer's level, else the standard level of a known
        name (:data:`STANDARD_TIMER_LEVELS`), else 0. An explicit level must match an existing one.
        """
        existing = self._timers.get(name)
        if existing is None and log_level is None and name in self._null_names:
            return self._null  # the hot path asks for disabled timers on every step
        if existing is not None:
            if log_level is not None and log_level != existing.log_level:
                raise ValueError(
                    f"timer {name!r} exists with log level {existing.log_level}, asked for "
                    f"{log_level}"
                )
            return existing
        level = STANDARD_TIMER_LEVELS.get(name, 0) if log_level is None else log_level
        if not 0 <= level <= MAX_LOG_LEVEL:
            raise ValueError(f"timer log level must be 0-{MAX_LOG_LEVEL}, got {level} for {name!r}")
        if level > self.log_level:
            if log_level is None:
                self._null_names.add(name)
            return self._null
        timer = Timer(name, level, self.mode, self.device, self._group)
        self._timers[name] = timer
        return timer

    @property
    def names(self) -> list[str]:
        """Registered (real) timer names, in creation order."""
        return list(self._timers)

    def enabled_names(self, candidates: Sequence[str]) -> list[str]:
        """Those of ``candidates`` whose standard level is within ``--timing-log-level``."""
        return [n for n in candidates if STANDARD_TIMER_LEVELS.get(n, 0) <= self.log_level]

    def _rank(self) -> int:
        return dist.get_rank(self._group) if collectives.is_initialized() else 0

    def report(
        self,
        names: Sequence[str] | None = None,
        normalizer: float = 1.0,
        reset: bool = True,
        barrier: bool = False,
    ) -> TimerReport | None:
        """Collective: gather every rank's ``elapsed`` (ms / normalizer) in one all_gather.

        Every rank must call this with the same ``names`` (``None`` = this rank's registered names,
        safe only when all ranks registered the same ones). Returns None when ``names`` is empty.
        """
        if normalizer <= 0.0:
            raise ValueError(f"timer normalizer must be > 0, got {normalizer}")
        selected = list(self._timers) if names is None else list(names)
        if not selected:
            return None
        if barrier:
            collectives.barrier(self._group)
        local = []
        for name in selected:
            timer = self._timers.get(name)
            local.append(timer.elapsed(reset=reset) * 1000.0 if timer is not None else 0.0)
        # Deliberate sync: one all_gather of the [world, len(names)] matrix, at log steps only.
        rows = collectives.all_gather_floats(local, self._group)
        ms = tuple(tuple(v / normalizer for v in row) for row in rows)
        return TimerReport(tuple(selected), ms)

    def log(
        self,
        names: Sequence[str] | None = None,
        normalizer: float = 1.0,
        reset: bool = True,
        barrier: bool = False,
    ) -> str | None:
        """Collective. Megatron's timer text (ms) on **rank 0**; None on other ranks or if empty.

        The caller prints it (the training log prints it right after its iteration line).
        """
        rep = self.report(names, normalizer, reset, barrier)
        if rep is None or self._rank() != 0:
            return None
        return rep.format(self.log_option)

    def write(
        self,
        names: Sequence[str] | None,
        writer: MetricSink,
        iteration: int,
        normalizer: float = 1.0,
        reset: bool = True,
        barrier: bool = False,
    ) -> None:
        """Collective. On rank 0, write the max over ranks as ``"<name>-time"`` (seconds,
        Megatron)."""
        rep = self.report(names, normalizer, reset, barrier)
        if rep is None or self._rank() != 0:
            return
        scalars = rep.megatron_scalars()
        if scalars:
            writer.add_scalars(scalars, iteration)


__all__ = [
    "MAX_LOG_LEVEL",
    "NullTimer",
    "Timer",
    "TimerConfig",
    "TimerReport",
    "Timers",
    "TimingLogOption",
    "TimingMode",
    "validate_timing_flags",
]
