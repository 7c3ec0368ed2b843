"""Hang detection with timed sections, enforced by a separate monitor process per rank.

A rank is *hung* when a section stays open longer than its timeout, or when, after warm-up, the
time spent outside any section exceeds the out-of-section timeout. The timeouts are enforced by
``stalwart/reliability/monitor.py``, a standard-library-only process started per rank; the worker
only writes an 88-byte slot of a two-slot heartbeat record into shared memory (a lock,
``time.monotonic()``, a ``struct.pack`` and a CRC-32 per call: microseconds, no syscalls, no
host-device sync; a write stopped half-way leaves the other, complete slot, and a record that
cannot be read at all counts as no progress, so detection never switches off). On a hang the
monitor logs rank, section and duration, dumps every thread's stack, kills the worker with
SIGKILL so that torchrun (``--max-restarts``) restarts the job, and exits. Disabled FT returns
`NullSectionMonitor`, whose methods do nothing.

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
``new = max(floor, safety_factor × max_observed)`` (NVRx: safety factor 5), blended with a
previously *learned* value as ``alpha × previous + (1 − alpha) × new`` (alpha 0.5, NVRx's EMA).
Sections qualify as in Megatron: setup only after a persistent checkpoint was loaded; step after
>= 16 timed steps; checkpointing after >= 1 real save and only with synchronous saves;
out-of-section only at closing when setup and step qualify and a save was seen. Rank 0 writes
``<save>/ft_state.json`` atomically; at start `build_section_monitor` loads it and uses the learned
values for the learned sections.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from stalwart.log_notice import NOTICE
from stalwart.reliability.hang import monitor as hb
from stalwart.reliability.hang.config import (
    _TIMEOUT_KEYS,
    FT_LOG_DIRNAME,
    FaultToleranceConfig,
    Section,
    SectionTimeouts,
    parse_ft_timeouts,
)
from stalwart.reliability.hang.monitor_client import MonitorClient
from stalwart.reliability.hang.timeouts import (
    FtState,
    ft_state_path,
    learn_timeouts,
    resolve_timeouts,
    save_ft_state,
    select_sections_to_update,
)

# The config lives in hang.config; its names a user's loop needs are re-exported here.
__all__ = [
    "FT_LOG_DIRNAME",
    "FaultToleranceConfig",
    "NullSectionMonitor",
    "Section",
    "SectionMonitor",
    "SectionTimeouts",
    "build_section_monitor",
    "parse_ft_timeouts",
]

logger = logging.getLogger(__name__)

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
    """Per-rank section bookkeeping; the monitor process (see `monitor_client.MonitorClient`)
    enforces it.

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
        goodput_file: str | os.PathLike[str] | None = None,
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
        self._in_eval = False  # the open step section is an evaluation step
        self._eval_max = 0.0  # longest evaluation step (warm-up ones included)
        self._num_timed_steps = self._num_checkpoints = 0
        self._persistent_loaded = False
        base = self._save_dir if self._save_dir is not None else Path(tempfile.gettempdir())
        self.log_dir = base / FT_LOG_DIRNAME
        self._client = MonitorClient(
            rank,
            str(self.log_dir),
            poll_s=config.poll_interval_s,
            dump_signal=int(config.dump_signal),
            dump_wait_s=config.stack_dump_wait_s,
            term_grace_s=config.kill_grace_s,
            fallback_timeout_s=max(timeouts.as_tuple()),
            abort_grace_s=config.abort_grace_s,
            goodput_file=None if goodput_file is None else os.fspath(goodput_file),
        )
        self._publish()

    @property
    def timeouts(self) -> SectionTimeouts:
        return self._timeouts

    @property
    def monitor_pid(self) -> int | None:
        return self._client.pid

    @property
    def heartbeat_path(self) -> str:
        """The memory-mapped heartbeat record the monitor process reads."""
        return self._client.heartbeat_path

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
        if self._in_eval:  # an evaluation step: its own timeout (never below the step's)
            timeouts = (timeouts[0], self._eval_step_timeout(), *timeouts[2:])
        self._client.publish(section, flags, self._section_start, self._last_close, timeouts)

    def _eval_step_timeout(self) -> float:
        """Evaluation steps are timed against the step timeout, raised to ``safety_factor`` ×
        the longest evaluation step seen: they are not learned into the training step's."""
        return max(self._timeouts.step, self.config.safety_factor * self._eval_max)

    def _close_locked(self, section: Section, now: float, *, is_async_finalization: bool) -> None:
        duration = now - self._section_start
        if section is Section.STEP and self._in_eval:
            # An evaluation step sizes the evaluation timeout, never the training step's.
            self._eval_max = max(self._eval_max, duration)
            self._in_eval = False
        else:
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
            started = time.monotonic()
            yield
            if is_eval:  # sizes the evaluation steps' timeout
                self._eval_max = max(self._eval_max, time.monotonic() - started)
            return
        if is_eval:
            with self._lock:
                self._in_eval = True  # published with the evaluation timeout when it opens
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
    config: FaultToleranceConfig,
    rank: int,
    save_dir: str | os.PathLike[str] | None,
    goodput_file: str | os.PathLike[str] | None = None,
) -> SectionMonitor | NullSectionMonitor:
    """The monitor for this rank: `NullSectionMonitor` unless ``enable_ft``.

    When enabled: loads learned timeouts from ``<save>/ft_state.json`` if present (and logs it),
    starts the monitor process and opens the ``setup`` section. ``--calc-ft-timeouts`` needs
    ``--save`` (ValueError otherwise). ``goodput_file``: the run's goodput ledger, which a hang
    gets a ``fault`` record in (hang-until-detected time).
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
            extra=NOTICE,  # shown by default: hang detection runs on these
        )
    elif rank == 0:
        logger.info("stalwart-ft: timeouts %s", timeouts.as_dict())
    monitor = SectionMonitor(
        config,
        rank,
        timeouts=timeouts,
        calculated=calculated,
        save_dir=save_dir,
        goodput_file=goodput_file,
    )
    monitor.start()
    monitor.start_section(Section.SETUP)
    return monitor
