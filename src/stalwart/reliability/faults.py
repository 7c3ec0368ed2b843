"""Deterministic fault injection for testing the reliability machinery (off by default).

``--inject-fault KIND --inject-fault-iteration N [--inject-fault-rank R]
[--inject-fault-hang-seconds S] [--inject-fault-phase step|eval|checkpointing|commit]
[--inject-fault-repeat]``

Kinds, fired on rank R when the trainer calls ``maybe_inject(N, rank, phase)``:

* ``hang``: sleeps inside the step, forever or for S seconds (hang detection must kill it; the
  sleep wakes periodically, so a flag-only signal handler still runs but cannot end the hang).
* ``exception``: raises `InjectedFault` (a RuntimeError) out of the step.
* ``sigkill``: SIGKILL to its own process (exit status -9; torchrun restarts the job).
* ``sigterm``: a preemption drill. Under torchrun (``TORCHELASTIC_RUN_ID`` set) SIGTERM goes to the
  parent, the torchrun agent, which forwards SIGTERM to *every* local worker as a scheduler
  would; otherwise to this process itself. With ``--exit-signal-handler`` this exercises the
  graceful save-and-exit path; training continues until the next exit decision.
* ``bitflip``: silent data corruption: flips one bit of one weight on that rank only (through the
  ``corrupt_weights`` callback the trainer provides), so its replica drifts from the others
  without any error; ``--check-weight-hash-across-dp-replicas-interval`` must catch it.
* ``grad_corruption``: finite silent corruption of that rank's gradient: after the backward of
  iteration N (phase ``backward``: the gradients are all-reduced, the optimizer has not stepped)
  one high mantissa bit of one gradient element flips on that rank only (the ``corrupt_grads``
  callback). No check sees it; the replica fingerprints of the step must. With
  ``--inject-fault-repeat`` it fires at every pass of iteration N (a persistent fault).

Once per job: before firing, the injector atomically creates
``<marker_dir>/.stalwart_fault_fired_<kind>_<iteration>_<rank>`` (O_CREAT|O_EXCL) and keeps an
in-memory flag. A process restarted by torchrun, or by in-process restart, that reaches the same
iteration again finds the marker and does not fire, so the restarted job can make progress. Use
the checkpoint directory (``--save``) as ``marker_dir``. ``--inject-fault-repeat`` skips the marker
and fires at every attempt that reaches the iteration (a repeatable fault, e.g. an OOM, for testing
that restarts are bounded); without one, only the in-memory flag
protects against re-firing (a warning says so).

This module imports only the standard library.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from types import FrameType

logger = logging.getLogger(__name__)

MARKER_PREFIX = ".stalwart_fault_fired_"
# ``commit``: on rank 0 inside the checkpoint commit window (every rank's shards written, before
# the marker, rename and tracker update; N is the checkpoint's iteration). ``hang`` with
# ``--inject-fault-hang-seconds`` there widens the window so that a test can kill the job in it.
FAULT_PHASES: tuple[str, ...] = ("step", "eval", "checkpointing", "commit", "backward")


class FaultKind(Enum):
    """``--inject-fault`` values."""

    HANG = "hang"
    EXCEPTION = "exception"
    SIGKILL = "sigkill"
    SIGTERM = "sigterm"
    BITFLIP = "bitflip"
    GRAD_CORRUPTION = "grad_corruption"


class InjectedFault(RuntimeError):
    """Raised by the ``exception`` fault."""


def parse_fault_kind(value: str | FaultKind) -> FaultKind:
    """``--inject-fault`` value -> `FaultKind`; ValueError naming the flag and allowed values."""
    if isinstance(value, FaultKind):
        return value
    try:
        return FaultKind(str(value).strip().lower())
    except ValueError:
        allowed = ", ".join(k.value for k in FaultKind)
        raise ValueError(f"--inject-fault: got {value!r}, allowed: {allowed}") from None


@dataclass(frozen=True, kw_only=True)
class FaultInjectionConfig:
    """Fault-injection flags; ``inject_fault=None`` (the default) disables injection."""

    inject_fault: str | None = None
    inject_fault_iteration: int | None = None
    inject_fault_rank: int = 0
    inject_fault_hang_seconds: float | None = None
    inject_fault_phase: str = "step"
    inject_fault_repeat: bool = False  # fire at every run that reaches it (a repeatable fault)

    def __post_init__(self) -> None:
        if self.inject_fault is None:
            return
        parse_fault_kind(self.inject_fault)
        it = self.inject_fault_iteration
        if it is None or not isinstance(it, int) or it < 1:
            raise ValueError(
                "--inject-fault-iteration: required with --inject-fault, an integer >= 1, got "
                f"{it!r}"
            )
        if not isinstance(self.inject_fault_rank, int) or self.inject_fault_rank < 0:
            raise ValueError(
                f"--inject-fault-rank: must be an integer >= 0, got {self.inject_fault_rank!r}"
            )
        hang = self.inject_fault_hang_seconds
        if hang is not None and not hang > 0:
            raise ValueError(
                f"--inject-fault-hang-seconds: must be > 0 (unset hangs forever), got {hang!r}"
            )
        if self.inject_fault_phase not in FAULT_PHASES:
            raise ValueError(
                f"--inject-fault-phase: got {self.inject_fault_phase!r}, allowed: "
                f"{', '.join(FAULT_PHASES)}"
            )

    def build(
        self, marker_dir: str | os.PathLike[str] | None, world_size: int = 1
    ) -> FaultInjector | NullFaultInjector:
        """The injector (see :func:`build_fault_injector`)."""
        return build_fault_injector(self, marker_dir, world_size)


class NullFaultInjector:
    """Injection disabled: ``maybe_inject`` does nothing."""

    fired = False

    def maybe_inject(self, iteration: int, rank: int, phase: str = "step") -> None: ...


class FaultInjector:
    """Fires one fault of ``kind`` on ``rank`` at ``iteration`` (in ``phase``), once per job.

    ``iteration`` is the number the trainer logs for the step being run (1-based).
    """

    def __init__(
        self,
        kind: FaultKind | str,
        iteration: int,
        rank: int,
        marker_dir: str | os.PathLike[str] | None,
        *,
        hang_seconds: float | None = None,
        phase: str = "step",
        repeat: bool = False,
    ) -> None:
        self.kind = parse_fault_kind(kind)
        self.repeat = repeat
        self.iteration, self.rank, self.phase = iteration, rank, phase
        self.hang_seconds = hang_seconds
        self.marker_dir = Path(marker_dir) if marker_dir is not None else None
        self.fired = False
        # The bitflip fault needs the model; the owner of the weights sets this (keeps this
        # module free of torch).
        self.corrupt_weights: Callable[[], str] | None = None
        self.corrupt_grads: Callable[[], str] | None = None  # grad_corruption, likewise
        if self.marker_dir is None:
            logger.warning(
                "fault injection without a marker directory: a restarted job fires again"
            )

    @property
    def marker_path(self) -> Path | None:
        if self.marker_dir is None:
            return None
        return self.marker_dir / f"{MARKER_PREFIX}{self.kind.value}_{self.iteration}_{self.rank}"

    def maybe_inject(self, iteration: int, rank: int, phase: str = "step") -> None:
        """Fire if this is the target (iteration, rank, phase) and it has not fired in this job."""
        if self.fired or iteration != self.iteration or rank != self.rank or phase != self.phase:
            return
        if self.repeat:  # --inject-fault-repeat: no fired-once marker (a repeatable fault)
            self._fire()
            return
        self.fired = True
        if not self._claim_marker():
            logger.warning(
                "fault injection: %s already fired in an earlier run (%s); skipping",
                self.kind.value,
                self.marker_path,
            )
            return
        self._fire()

    def _claim_marker(self) -> bool:
        """Create the marker atomically; False if it already exists (fired before a restart)."""
        path = self.marker_path
        if path is None:
            return True
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
        except FileExistsError:
            return False
        record = {
            "kind": self.kind.value,
            "iteration": self.iteration,
            "rank": self.rank,
            "pid": os.getpid(),
            "time": time.time(),
        }
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(record, f)
            f.flush()
            os.fsync(f.fileno())  # the marker must survive the SIGKILL that may follow at once
        return True

    def _fire(self) -> None:
        where = f"at iteration {self.iteration} ({self.phase})"
        line = f"FAULT INJECTION: rank {self.rank} fires '{self.kind.value}' {where}"
        logger.error(line)
        print(line, file=sys.stderr, flush=True)  # visible even without logging configured
        if self.kind is FaultKind.EXCEPTION:
            raise InjectedFault(line)
        if self.kind is FaultKind.SIGKILL:
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.kind is FaultKind.SIGTERM:
            if "TORCHELASTIC_RUN_ID" in os.environ:
                _signal_agent_and_wait(signal.SIGTERM)
            else:
                os.kill(os.getpid(), signal.SIGTERM)
        elif self.kind is FaultKind.HANG:
            self._hang()
        elif self.kind is FaultKind.BITFLIP:
            if self.corrupt_weights is None:
                raise RuntimeError("--inject-fault bitflip: no corrupt_weights callback was set")
            logger.error("FAULT INJECTION: %s", self.corrupt_weights())
        elif self.kind is FaultKind.GRAD_CORRUPTION:
            if self.corrupt_grads is None:
                raise RuntimeError(
                    "--inject-fault grad_corruption: no corrupt_grads callback was set"
                )
            logger.error("FAULT INJECTION: %s", self.corrupt_grads())

    def _hang(self) -> None:
        deadline = None if self.hang_seconds is None else time.monotonic() + self.hang_seconds
        while deadline is None or time.monotonic() < deadline:
            remaining = 1.0 if deadline is None else deadline - time.monotonic()
            time.sleep(max(0.0, min(1.0, remaining)))


def build_fault_injector(
    config: FaultInjectionConfig, marker_dir: str | os.PathLike[str] | None, world_size: int = 1
) -> FaultInjector | NullFaultInjector:
    """The injector for ``config``; `NullFaultInjector` when ``--inject-fault`` is unset."""
    if config.inject_fault is None or config.inject_fault_iteration is None:
        return NullFaultInjector()
    if config.inject_fault_rank >= world_size:
        raise ValueError(
            f"--inject-fault-rank: {config.inject_fault_rank} is not a rank of a world of size "
            f"{world_size}"
        )
    kind = parse_fault_kind(config.inject_fault)
    # The gradients exist only after the backward: that kind fires there (the default phase
    # "step" means "where the kind fires"; any other phase is refused, not silently changed).
    phase = config.inject_fault_phase
    if kind is FaultKind.GRAD_CORRUPTION:
        if phase not in ("step", "backward"):
            raise ValueError(
                "--inject-fault-phase: grad_corruption fires after the backward (backward); "
                f"got {phase}"
            )
        phase = "backward"
    return FaultInjector(
        kind,
        config.inject_fault_iteration,
        config.inject_fault_rank,
        marker_dir,
        hang_seconds=config.inject_fault_hang_seconds,
        phase=phase,
        repeat=config.inject_fault_repeat,
    )


def _signal_agent_and_wait(signum: int, timeout_s: float = 30.0) -> None:
    """``signum`` to the torchrun agent, which forwards it to every local worker; returns once it
    has reached this process too (at most ``timeout_s``), so the drill's signal lands in the phase
    it names: on a loaded machine the agent's forward can outlast the phase. The handler in place
    still runs (the relay calls it); with none installed from Python there is nothing to wait
    for."""
    previous = signal.getsignal(signum)
    arrived: list[int] = []
    if callable(previous):

        def relay(number: int, frame: FrameType | None) -> None:
            arrived.append(number)
            previous(number, frame)

        signal.signal(signum, relay)
    os.kill(os.getppid(), signum)
    deadline = time.monotonic() + timeout_s
    while callable(previous) and not arrived and time.monotonic() < deadline:
        time.sleep(0.01)  # the handler runs in this (main) thread between the sleeps
    if callable(previous):
        signal.signal(signum, previous)
