"""Hang detection with timed sections, enforced by a separate monitor process per rank.

A rank is *hung* when a section stays open longer than its timeout, or when, after warm-up, the
time spent outside any section exceeds the out-of-section timeout. The timeouts are enforced by
``stalwart/reliability/monitor.py``, a standard-library-only process started per rank; the worker
only writes a 80-byte heartbeat record into shared memory (a lock, ``time.monotonic()`` and a
``struct.pack`` per call: microseconds, no syscalls, no host-device sync). On a hang the monitor logs
rank, section and duration, dumps every thread's stack, kills the worker with SIGKILL so that
torchrun (``--max-restarts``) restarts the job, and exits. Disabled FT returns `NullSectionMonitor`,
whose methods do nothing.

Section rules the trainer follows
---------------------------------
* ``setup``: opened by `build_section_monitor` and kept open through start-up, checkpoint load
  **and the first ``ft_num_warmup_iters`` train steps** (they are slow: allocator warm-up, compile,
  CUDA-graph capture). It closes when the first other section opens. A hang in warm-up is therefore
  caught by the setup timeout. (Megatron closes setup at the first step and leaves warm-up steps
  unguarded; NVRx skips the out-of-section check in warm-up. Keeping setup open guards them.)
* ``step``: every train step after warm-up, and every eval step after the first
  ``ft_num_warmup_iters`` steps of each evaluation: use ``with monitor.step_section(is_eval=...)``,
  which does the warm-up counting, and call `SectionMonitor.start_evaluation` before each
  evaluation. Data fetching inside the step is part of the step.
* ``checkpointing``: every save, and every async-save finalize (pass
  ``is_async_finalization=True`` for finalizes; only real saves count towards learning).
* Out-of-section: the time between sections (logging, the exit decision, GC). It is enforced from
  the first timed ``step`` on, so setup/warm-up gaps are never judged by it.
* Only one section is open at a time. Opening a section closes an open ``setup`` silently and any
  other open section with a warning; closing a section that is not open only warns. Monitoring
  mistakes never raise into the training loop.

Learned timeouts (``--calc-ft-timeouts``)
-----------------------------------------
The worker records the longest observed duration per section and the longest out-of-section gap.
`SectionMonitor.maybe_update_timeouts` (a collective: call it on every rank, after each save and
once before `close`) takes one all-reduce MAX of the four maxima and applies `learn_timeouts`:
``new = max(floor, safety_factor × max_observed)`` (NVRx: safety factor 5), blended with a previously
*learned* value as ``alpha × previous + (1 − alpha) × new`` (alpha 0.5, NVRx's EMA). Sections qualify
as in Megatron: setup only after a persistent checkpoint was loaded; step after >= 16 timed steps;
checkpointing after >= 1 real save and only with synchronous saves; out-of-section only at closing
when setup and step qualify and a save was seen. Rank 0 writes ``<save>/ft_state.json`` atomically;
at start `build_section_monitor` loads it and uses the learned values for the learned sections.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path

from stalwart.reliability import monitor as hb

logger = logging.getLogger(__name__)

FT_STATE_FILENAME = "ft_state.json"
FT_LOG_DIRNAME = "ft_logs"
FT_STATE_VERSION = 1
_TIMEOUT_KEYS = ("setup", "step", "checkpointing", "out_of_section")
_DUMP_SIGNALS = ("SIGUSR1", "SIGUSR2", "SIGQUIT", "SIGHUP")


class Section(Enum):
    """Timed sections. ``index`` is the section's id in the heartbeat record."""

    SETUP = "setup"
    STEP = "step"
    CHECKPOINTING = "checkpointing"

    @property
    def index(self) -> int:
        return hb.SECTION_NAMES.index(self.value)


@dataclass(frozen=True)
class SectionTimeouts:
    """Timeouts in seconds per section, plus the out-of-section timeout."""

    setup: float = 600.0
    step: float = 180.0
    checkpointing: float = 420.0
    out_of_section: float = 600.0

    def __post_init__(self) -> None:
        for key in _TIMEOUT_KEYS:
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(
                    f"--ft-timeouts: {key} must be a finite number of seconds > 0, got {value!r}"
                )

    def as_tuple(self) -> tuple[float, float, float, float]:
        return (self.setup, self.step, self.checkpointing, self.out_of_section)

    def as_dict(self) -> dict[str, float]:
        return dict(zip(_TIMEOUT_KEYS, self.as_tuple()))


def parse_ft_timeouts(text: str, base: SectionTimeouts | None = None) -> SectionTimeouts:
    """Parse ``--ft-timeouts`` (``"setup=600,step=180,checkpointing=420,out_of_section=600"``).

    Keys may be given in any order and subset (missing keys keep ``base``, default the built-in
    timeouts); ``key:seconds`` (NVRx's spelling) is accepted too. Raises ValueError naming the flag,
    the allowed keys and the format on anything else.
    """
    usage = f"expected comma-separated key=seconds with keys {', '.join(_TIMEOUT_KEYS)}"
    values: dict[str, float] = {}
    items = [item.strip() for item in text.split(",")]
    if not text.strip() or any(not item for item in items):
        raise ValueError(f"--ft-timeouts: empty entry in {text!r}; {usage}")
    for item in items:
        key, sep, raw = item.replace(":", "=", 1).partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in _TIMEOUT_KEYS:
            raise ValueError(f"--ft-timeouts: bad entry {item!r}; {usage}")
        if key in values:
            raise ValueError(f"--ft-timeouts: {key} given twice in {text!r}")
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(
                f"--ft-timeouts: {key}={raw.strip()!r} is not a number; {usage}"
            ) from None
        values[key] = value
    return replace(base or SectionTimeouts(), **values)


@dataclass(frozen=True)
class FaultToleranceConfig:
    """Hang-detection settings (Megatron/NVRx flag spelling in error messages).

    Attributes:
        enable_ft: start a monitor process per rank (``--enable-ft``).
        timeouts: per-section timeouts (``--ft-timeouts``).
        calc_ft_timeouts: learn timeouts from observed durations (``--calc-ft-timeouts``).
        ft_num_warmup_iters: train/eval steps per phase that are not ``step`` sections.
        safety_factor: learned timeout = factor × observed max (NVRx default 5).
        blend_alpha: weight of the previous learned value when re-learning (NVRx EMA 0.5).
        min_learned_timeout_s: floor for learned timeouts (a 0.1 s step must not yield 0.5 s).
        min_steps_for_step_update: timed steps needed before ``step`` is learned (Megatron: 16).
        poll_interval_s: monitor polling period; detection latency is timeout + this.
        stack_dump_signal: signal the monitor sends for a faulthandler stack dump. It must
            differ from ``--exit-signal`` (see `check_exit_signal`); SIGUSR1 is often SLURM's
            pre-timeout warning, hence SIGUSR2.
        kill_grace_s: SIGTERM grace before SIGKILL. 0 kills at once: a hung rank cannot run a
            SIGTERM handler usefully, and a flag-only handler would just waste the grace.
        stack_dump_wait_s: how long the monitor waits for the dump to arrive.
    """

    enable_ft: bool = False
    timeouts: SectionTimeouts = field(default_factory=SectionTimeouts)
    calc_ft_timeouts: bool = False
    ft_num_warmup_iters: int = 5
    safety_factor: float = 5.0
    blend_alpha: float = 0.5
    min_learned_timeout_s: float = 30.0
    min_steps_for_step_update: int = 16
    poll_interval_s: float = 1.0
    stack_dump_signal: str = "SIGUSR2"
    kill_grace_s: float = 0.0
    stack_dump_wait_s: float = 1.0

    def __post_init__(self) -> None:
        checks = (
            (self.ft_num_warmup_iters >= 0, "--ft-num-warmup-iters", "an integer >= 0"),
            (self.safety_factor >= 1.0, "--ft-safety-factor", "a number >= 1"),
            (0.0 <= self.blend_alpha < 1.0, "--ft-blend-alpha", "a number in [0, 1)"),
            (self.min_learned_timeout_s >= 0, "--ft-min-learned-timeout", "a number >= 0"),
            (self.min_steps_for_step_update >= 1, "--ft-min-steps-for-update", "an integer >= 1"),
            (0 < self.poll_interval_s <= 60, "--ft-poll-interval", "a number in (0, 60]"),
            (self.kill_grace_s >= 0, "--ft-kill-grace", "a number >= 0"),
            (self.stack_dump_wait_s >= 0, "--ft-stack-dump-wait", "a number >= 0"),
        )
        for ok, flag, allowed in checks:
            if not ok:
                raise ValueError(f"{flag}: must be {allowed}")
        if self.stack_dump_signal not in _DUMP_SIGNALS:
            allowed = ", ".join(_DUMP_SIGNALS)
            raise ValueError(
                f"--ft-stack-dump-signal: got {self.stack_dump_signal!r}, allowed: {allowed}"
            )

    @property
    def dump_signal(self) -> signal.Signals:
        return signal.Signals[self.stack_dump_signal]

    def check_exit_signal(self, exit_signal: signal.Signals) -> None:
        """Raise ValueError if ``--exit-signal`` collides with the stack-dump signal."""
        if self.enable_ft and exit_signal == self.dump_signal:
            raise ValueError(
                f"--exit-signal: {exit_signal.name} is used by hang detection for stack dumps "
                f"(--ft-stack-dump-signal); choose another exit or dump signal"
            )


# ---------------------------------------------------------------------------------------------
# Timeout learning: pure functions plus the ft_state.json file.


def select_sections_to_update(
    *,
    closing: bool,
    num_timed_steps: int,
    num_checkpoints: int,
    persistent_checkpoint_loaded: bool,
    async_save: bool,
    min_steps: int = 16,
) -> frozenset[str]:
    """Which timeouts have enough evidence to be learned (Megatron's rules, see module doc)."""
    chosen: set[str] = set()
    if persistent_checkpoint_loaded:
        chosen.add("setup")  # in-memory/local loads are too fast to size a persistent load
    if num_timed_steps >= min_steps:
        chosen.add("step")
    if num_checkpoints >= 1 and not async_save:
        chosen.add("checkpointing")  # async saves only time the staging, not the write
    if closing and {"setup", "step"} <= chosen and num_checkpoints >= 1:
        chosen.add("out_of_section")
    return frozenset(chosen)


def learn_timeouts(
    previous: SectionTimeouts,
    observed_max: Mapping[str, float],
    *,
    previously_calculated: frozenset[str],
    safety_factor: float,
    blend_alpha: float = 0.5,
    floor_s: float = 0.0,
) -> tuple[SectionTimeouts, frozenset[str]]:
    """New timeouts from observed maxima (seconds); keys absent or <= 0 keep their previous value.

    ``new = max(floor_s, safety_factor * observed)``; a key learned before is blended as
    ``blend_alpha * previous + (1 - blend_alpha) * new``. Returns the timeouts and the set of
    learned keys.
    """
    updates: dict[str, float] = {}
    for key in _TIMEOUT_KEYS:
        seen = observed_max.get(key, -1.0)
        if seen <= 0:
            continue
        new = max(floor_s, safety_factor * seen)
        if key in previously_calculated:
            new = blend_alpha * getattr(previous, key) + (1.0 - blend_alpha) * new
        updates[key] = max(new, floor_s, 1e-3)
    return replace(previous, **updates), previously_calculated | frozenset(updates)


@dataclass(frozen=True)
class FtState:
    """Contents of ``<save>/ft_state.json``."""

    timeouts: SectionTimeouts
    calculated_sections: frozenset[str]
    observed_max_s: dict[str, float] = field(default_factory=dict)


def ft_state_path(save_dir: str | os.PathLike[str]) -> Path:
    return Path(save_dir) / FT_STATE_FILENAME


def save_ft_state(path: str | os.PathLike[str], state: FtState, safety_factor: float) -> None:
    """Write the state atomically (temp file, fsync, rename) so a crash never leaves half a file."""
    payload = {
        "version": FT_STATE_VERSION,
        "timeouts": state.timeouts.as_dict(),
        "calculated_sections": sorted(state.calculated_sections),
        "observed_max_s": state.observed_max_s,
        "safety_factor": safety_factor,
        "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp.{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)


def load_ft_state(path: str | os.PathLike[str]) -> FtState | None:
    """Read ``ft_state.json``; None when absent. A corrupt file is logged and ignored."""
    target = Path(path)
    if not target.exists():
        return None
    try:
        data = json.loads(target.read_text(encoding="utf-8"))
        timeouts = SectionTimeouts(**{k: float(data["timeouts"][k]) for k in _TIMEOUT_KEYS})
        calculated = frozenset(str(k) for k in data["calculated_sections"]) & frozenset(
            _TIMEOUT_KEYS
        )
        observed = {str(k): float(v) for k, v in data.get("observed_max_s", {}).items()}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.warning("stalwart-ft: ignoring unreadable %s (%s)", target, exc)
        return None
    return FtState(timeouts, calculated, observed)


def resolve_timeouts(
    config: FaultToleranceConfig, save_dir: str | os.PathLike[str] | None
) -> tuple[SectionTimeouts, frozenset[str]]:
    """Configured timeouts, with the learned sections of ``<save>/ft_state.json`` substituted."""
    state = load_ft_state(ft_state_path(save_dir)) if save_dir is not None else None
    if state is None or not state.calculated_sections:
        return config.timeouts, frozenset()
    learned = {k: getattr(state.timeouts, k) for k in state.calculated_sections}
    return replace(config.timeouts, **learned), state.calculated_sections


# ---------------------------------------------------------------------------------------------
# Monitors.


class NullSectionMonitor:
    """FT disabled: same API as `SectionMonitor`, every call a no-op, no process, no collective."""

    _null = contextlib.nullcontext()

    def start_section(self, section: Section) -> None: ...
    def end_section(self, section: Section, *, is_async_finalization: bool = False) -> None: ...
    def start_evaluation(self) -> None: ...
    def on_checkpoint_loaded(self, *, persistent: bool) -> None: ...
    def close(self) -> None: ...

    def section(
        self, section: Section, *, is_async_finalization: bool = False
    ) -> contextlib.AbstractContextManager[None]:
        return self._null

    def step_section(self, *, is_eval: bool = False) -> contextlib.AbstractContextManager[None]:
        return self._null

    def maybe_update_timeouts(
        self, *, closing: bool = False, async_save: bool = False
    ) -> SectionTimeouts | None:
        return None

    def __enter__(self) -> NullSectionMonitor:
        return self

    def __exit__(self, *exc: object) -> None: ...


class SectionMonitor:
    """Per-rank section bookkeeping; the monitor process (see `monitor.MonitorClient`) enforces it.

    Build it with `build_section_monitor`. Methods are cheap, thread-safe and never raise for
    misuse (see the module docstring for the section rules). `maybe_update_timeouts` is the only
    collective.
    """

    def __init__(
        self,
        config: FaultToleranceConfig,
        rank: int,
        *,
        timeouts: SectionTimeouts,
        calculated: frozenset[str],
        save_dir: str | os.PathLike[str] | None,
    ) -> None:
        self.config, self.rank = config, rank
        self._timeouts, self._calculated = timeouts, calculated
        self._save_dir = Path(save_dir) if save_dir is not None else None
        self._lock = threading.Lock()
        self._section: Section | None = None
        self._section_start = self._last_close = time.monotonic()
        self._armed = self._closed = False
        self._max: dict[str, float] = {}
        self._warmup_seen = {False: 0, True: 0}  # train / eval steps seen in this phase
        self._num_timed_steps = self._num_checkpoints = 0
        self._persistent_loaded = False
        base = self._save_dir if self._save_dir is not None else Path(tempfile.gettempdir())
        self.log_dir = base / FT_LOG_DIRNAME
        self._client = hb.MonitorClient(
            rank,
            str(self.log_dir),
            poll_s=config.poll_interval_s,
            dump_signal=int(config.dump_signal),
            dump_wait_s=config.stack_dump_wait_s,
            term_grace_s=config.kill_grace_s,
        )
        self._publish()

    @property
    def timeouts(self) -> SectionTimeouts:
        return self._timeouts

    @property
    def monitor_pid(self) -> int | None:
        return self._client.pid

    def start(self) -> None:
        """Start the monitor process (once)."""
        self._client.start()

    def close(self, timeout_s: float = 5.0) -> None:
        """Tell the monitor to stop, reap it, remove the heartbeat. Idempotent; local only."""
        with self._lock:
            if self._closed:
                return
            if self._section is not None:
                self._close_locked(self._section, time.monotonic(), is_async_finalization=False)
            self._closed = True
            self._publish()
        self._client.stop(timeout_s)

    def __enter__(self) -> SectionMonitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- sections ----------------------------------------------------------------------------

    def _publish(self) -> None:
        """Hand the current state to the monitor; caller holds the lock (or is __init__)."""
        flags = (hb.FLAG_CLOSED if self._closed else 0) | (
            hb.FLAG_OUT_OF_SECTION_ARMED if self._armed else 0
        )
        section = self._section.index if self._section is not None else hb.NO_SECTION
        timeouts = self._timeouts.as_tuple()
        self._client.publish(section, flags, self._section_start, self._last_close, timeouts)

    def _close_locked(self, section: Section, now: float, *, is_async_finalization: bool) -> None:
        duration = now - self._section_start
        self._max[section.value] = max(self._max.get(section.value, 0.0), duration)
        if section is Section.STEP:
            self._num_timed_steps += 1
        elif section is Section.CHECKPOINTING and not is_async_finalization:
            self._num_checkpoints += 1
        self._section = None
        self._last_close = now

    def start_section(self, section: Section) -> None:
        """Open ``section`` (closing an open one, see the module rules)."""
        now = time.monotonic()
        with self._lock:
            if self._closed:
                return
            current = self._section
            if current is not None:
                if current is not Section.SETUP:
                    logger.warning(
                        "stalwart-ft: %s opened while %s open; closing %s",
                        section.value,
                        current.value,
                        current.value,
                    )
                self._close_locked(current, now, is_async_finalization=False)
            elif self._armed:
                gap = now - self._last_close
                self._max["out_of_section"] = max(self._max.get("out_of_section", 0.0), gap)
            self._section, self._section_start = section, now
            if section is Section.STEP:
                self._armed = True
            self._publish()

    def end_section(self, section: Section, *, is_async_finalization: bool = False) -> None:
        """Close ``section``; ``is_async_finalization`` marks an async-save finalize."""
        now = time.monotonic()
        with self._lock:
            if self._closed:
                return
            if self._section is not section:
                open_name = self._section.value if self._section else "none"
                logger.warning(
                    "stalwart-ft: end of %s but open section is %s", section.value, open_name
                )
                return
            self._close_locked(section, now, is_async_finalization=is_async_finalization)
            self._publish()

    @contextlib.contextmanager
    def section(self, section: Section, *, is_async_finalization: bool = False) -> Iterator[None]:
        """``with monitor.section(Section.CHECKPOINTING): save(...)``; closes on exceptions too."""
        self.start_section(section)
        try:
            yield
        finally:
            self.end_section(section, is_async_finalization=is_async_finalization)

    @contextlib.contextmanager
    def step_section(self, *, is_eval: bool = False) -> Iterator[None]:
        """A train (or eval) step: untimed for the first ``ft_num_warmup_iters`` of its phase."""
        if self._warmup_seen[is_eval] < self.config.ft_num_warmup_iters:
            self._warmup_seen[is_eval] += 1
            yield
            return
        with self.section(Section.STEP):
            yield

    def start_evaluation(self) -> None:
        """Restart eval warm-up counting (the first eval steps of each evaluation are slow)."""
        self._warmup_seen[True] = 0

    def on_checkpoint_loaded(self, *, persistent: bool) -> None:
        """Record a resume; only a persistent load makes the setup duration worth learning."""
        self._persistent_loaded = self._persistent_loaded or persistent

    # -- learning ----------------------------------------------------------------------------

    def maybe_update_timeouts(
        self, *, closing: bool = False, async_save: bool = False
    ) -> SectionTimeouts | None:
        """Learn timeouts if ``--calc-ft-timeouts`` (collective: every rank must call it).

        Returns the new timeouts (also applied to the live monitor and, on rank 0, written to
        ``<save>/ft_state.json``), or None when disabled or nothing qualified.
        """
        if not self.config.calc_ft_timeouts or self._closed:
            return None
        chosen = select_sections_to_update(
            closing=closing,
            num_timed_steps=self._num_timed_steps,
            num_checkpoints=self._num_checkpoints,
            persistent_checkpoint_loaded=self._persistent_loaded,
            async_save=async_save,
            min_steps=self.config.min_steps_for_step_update,
        )
        local = self._local_maxima(closing)
        vector = [local.get(k, -1.0) if k in chosen else -1.0 for k in _TIMEOUT_KEYS]
        # Imported here so that importing this module (e.g. in a test worker) stays torch-free.
        import torch.distributed as dist

        from stalwart.distributed.collectives import all_reduce_floats

        # Deliberate sync: one all-reduce MAX per save so that every rank learns the same values.
        agreed = dict(zip(_TIMEOUT_KEYS, all_reduce_floats(vector, dist.ReduceOp.MAX)))
        observed = {k: v for k, v in agreed.items() if v > 0}
        if not observed:
            return None
        new, calculated = learn_timeouts(
            self._timeouts,
            observed,
            previously_calculated=self._calculated,
            safety_factor=self.config.safety_factor,
            blend_alpha=self.config.blend_alpha,
            floor_s=self.config.min_learned_timeout_s,
        )
        with self._lock:
            self._timeouts, self._calculated = new, calculated
            self._publish()
        if self.rank == 0 and self._save_dir is not None:
            save_ft_state(
                ft_state_path(self._save_dir),
                FtState(new, calculated, observed),
                self.config.safety_factor,
            )
        logger.info(
            "stalwart-ft: learned timeouts %s (from observed max %s)", new.as_dict(), observed
        )
        return new

    def _local_maxima(self, closing: bool) -> dict[str, float]:
        with self._lock:
            maxima = dict(self._max)
            if closing and self._armed and self._section is None:
                gap = time.monotonic() - self._last_close  # NVRx bumps the open gap at the end
                maxima["out_of_section"] = max(maxima.get("out_of_section", 0.0), gap)
        return maxima


def build_section_monitor(
    config: FaultToleranceConfig, rank: int, save_dir: str | os.PathLike[str] | None
) -> SectionMonitor | NullSectionMonitor:
    """The monitor for this rank: `NullSectionMonitor` unless ``enable_ft``.

    When enabled: loads learned timeouts from ``<save>/ft_state.json`` if present (and logs it),
    starts the monitor process and opens the ``setup`` section. ``--calc-ft-timeouts`` needs
    ``--save`` (ValueError otherwise).
    """
    if not config.enable_ft:
        return NullSectionMonitor()
    if config.calc_ft_timeouts and save_dir is None:
        raise ValueError(
            "--calc-ft-timeouts: requires --save (learned timeouts live in <save>/ft_state.json)"
        )
    timeouts, calculated = resolve_timeouts(config, save_dir)
    if calculated:
        logger.info(
            "stalwart-ft: using learned timeouts for %s from %s: %s",
            ", ".join(sorted(calculated)),
            ft_state_path(save_dir or "."),
            timeouts.as_dict(),
        )
    elif rank == 0:
        logger.info("stalwart-ft: timeouts %s", timeouts.as_dict())
    monitor = SectionMonitor(
        config, rank, timeouts=timeouts, calculated=calculated, save_dir=save_dir
    )
    monitor.start()
    monitor.start_section(Section.SETUP)
    return monitor
