"""Graceful exit: one agreed input vector per iteration, one pure decision, one side effect.

Per-iteration recipe (after the step and its logging, every rank, same place)::

    agreement = IterationAgreement(ExitProbe(config, signal_handler, started))
    machine = RerunConfig(...).build(device, agreement=agreement)  # rides on its collective
    ...
    result = step.run(it)                      # the step's one collective carries the inputs
    inputs = exit_inputs(result.agreed, rerun=result.verdict, finished=...)
    decision = decide(iteration, inputs, config, can_save=save_dir is not None)
    saving = decision.save is not SaveKind.NONE    # the replica check, also before every save
    if check.due(iteration, saving=saving):        # machine.replicas (a ReplicaCheck)
        decision = replica_exit(iteration, check.check(model)) or decision
    if decision.save is not SaveKind.NONE: save(..., non_persistent=decision.save is NON_PERSISTENT)
    if decision.exit: return leave(decision, iteration, save_dir=...)   # records, barriers

Because the inputs are agreed first (a single all-reduce MAX over ``[rerun flags, signal,
elapsed_minutes]``, see :class:`IterationAgreement`) and `decide` is a pure function of them and
of values every rank shares, ranks never disagree on whether to save or exit, and so never
deadlock in a save that only some ranks entered. :func:`leave` is the one place that writes
``exit_reason.json`` and waits for the other ranks.

Priority (Megatron's ``checkpoint_and_decide_exit``, with the validation exits first):
0. replica mismatch (``--check-weight-hash-across-dp-replicas-interval``): exit 17, no save (never
   write a checkpoint from diverged replicas). Then the rerun machine's verdict: exit 16 (after
   saving the completed iterations, so the failed one is rerun elsewhere) or 17, or a spike
   rewind (``--rewind-on-spike``: no save, no exit; the next iteration agrees on the rest).
1. exit signal (``--exit-signal-handler``, any rank): save, exit. Ctrl-C (SIGINT, with
   ``exit_on_interrupt``): save, exit **130** (the shell's code for an interrupted command).
2. ``--save-interval`` (persistent) or else ``--non-persistent-save-interval``: save, continue.
3. ``--exit-duration-in-mins`` (elapsed minutes MAX-reduced over ranks): save unless saved, exit.
4. ``--exit-interval`` or ``--phase-transition-iterations``: save unless saved, exit.
5. the last iteration (``finished``): save unless saved, exit.

Deliberate deviation: when exiting, a non-persistent save of the same iteration does not count as
"saved" (Megatron counts it). A local/in-memory checkpoint does not survive the job ending, so the
exit save is upgraded to persistent.

Every graceful exit uses exit code 0 (what launchers and Megatron expect), except Ctrl-C: a user
who interrupts a command expects 130, and a script must not mistake it for a finished run.
``exit_reason.json`` tells the reasons apart; `ExitDecision.exit_code` carries the code. On a
signal, the save must finish inside torchrun's 30 s SIGTERM-to-SIGKILL window (see
`stalwart.reliability.signals`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from stalwart.atomic_file import Sync, write_text_atomic
from stalwart.distributed import collectives
from stalwart.regular_file import open_regular
from stalwart.reliability.agreement import Agreed, ExitProbe, IterationAgreement
from stalwart.reliability.rerun.attribution.fingerprints import ReplicaCheckResult
from stalwart.reliability.rerun.types import (
    EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
    Diagnosis,
    RerunVerdict,
    SpikeRewind,
)
from stalwart.reliability.signals import DistributedSignalHandler, parse_exit_signal

logger = logging.getLogger(__name__)

EXIT_REASON_FILENAME = "exit_reason.json"
EXIT_CODE_GRACEFUL = 0  # signal, duration, interval, phase and finished all exit 0
EXIT_CODE_INTERRUPTED = 128 + signal.SIGINT  # 130: Ctrl-C, as a shell reports it


class ExitReason(Enum):
    """Why training stopped (the ``reason`` field of ``exit_reason.json``)."""

    SIGNAL = "signal"
    INTERRUPT = "interrupt"
    DURATION = "duration"
    INTERVAL = "interval"
    PHASE = "phase"
    FINISHED = "finished"
    RERUN = "rerun"
    REPLICA_MISMATCH = "replica_mismatch"
    FAILED = "failed"


class SaveKind(Enum):
    """Which checkpoint, if any, to write at this iteration."""

    NONE = "none"
    PERSISTENT = "persistent"
    NON_PERSISTENT = "non_persistent"


def _positive_or_off(value: float | None, flag: str) -> None:
    if value is not None and (not math.isfinite(value) or value < 0):
        raise ValueError(f"{flag}: must be > 0 (0 or unset disables), got {value!r}")


@dataclass(frozen=True, kw_only=True)
class ExitConfig:
    """Exit and save-cadence settings (Megatron flags). Intervals of 0 or None are disabled.

    Attributes:
        exit_signal_handler: install `DistributedSignalHandler` (``--exit-signal-handler``). On
            unless turned off by name: a preempted job saves whatever else a loop configures
            (the CLI passes Megatron's default, off, unless ``--exit-signal-handler``).
        exit_signal: the signal it handles (``--exit-signal``; a name or `signal.Signals`).
        exit_duration_in_mins: wall-clock budget of this run in minutes.
        exit_interval: exit when ``iteration % exit_interval == 0``.
        phase_transition_iterations: exit (after saving) at these iterations.
        save_interval: persistent save cadence (``--save-interval``).
        non_persistent_save_interval: non-persistent save cadence.
        exit_on_interrupt: SIGINT (Ctrl-C) saves and exits 130 (``--exit-on-interrupt``; the
            CLI turns it on for a single-process run on a terminal). Every rank must share it.
    """

    exit_signal_handler: bool = True
    exit_signal: signal.Signals | str = signal.SIGTERM
    exit_duration_in_mins: float | None = None
    exit_interval: int | None = None
    phase_transition_iterations: tuple[int, ...] = field(default_factory=tuple)
    save_interval: int | None = None
    non_persistent_save_interval: int | None = None
    exit_on_interrupt: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "exit_signal", parse_exit_signal(self.exit_signal))
        _positive_or_off(self.exit_duration_in_mins, "--exit-duration-in-mins")
        for value, flag in (
            (self.exit_interval, "--exit-interval"),
            (self.save_interval, "--save-interval"),
            (self.non_persistent_save_interval, "--non-persistent-save-interval"),
        ):
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(
                    f"{flag}: must be an integer >= 0 (0 or unset disables), got {value!r}"
                )
        phases = tuple(self.phase_transition_iterations)
        if any(not isinstance(i, int) or i <= 0 for i in phases) or len(set(phases)) != len(phases):
            raise ValueError(
                "--phase-transition-iterations: must be distinct positive integers, got "
                f"{list(phases)}"
            )
        object.__setattr__(self, "phase_transition_iterations", tuple(sorted(phases)))

    @property
    def signal_enum(self) -> signal.Signals:
        """``exit_signal`` as `signal.Signals` (validated in ``__post_init__``)."""
        return parse_exit_signal(self.exit_signal)

    @property
    def needs_agreement(self) -> bool:
        """Whether any input must be agreed across ranks (else no collective is needed)."""
        return (
            self.exit_signal_handler or self.exit_on_interrupt or bool(self.exit_duration_in_mins)
        )

    @property
    def handles_signals(self) -> bool:
        """Whether a `DistributedSignalHandler` must be installed."""
        return self.exit_signal_handler or self.exit_on_interrupt

    def make_signal_handler(self) -> DistributedSignalHandler:
        """The handler for these settings (not installed yet: enter it in the main thread)."""
        return DistributedSignalHandler(self.signal_enum, interrupt=self.exit_on_interrupt)

    def build(
        self, signal_handler: DistributedSignalHandler | None = None, started: float | None = None
    ) -> IterationAgreement:
        """The iteration's agreement over this config's inputs (give it to the rerun machine)."""
        return IterationAgreement(ExitProbe(self, signal_handler, started))


@dataclass(frozen=True)
class ExitInputs:
    """The per-iteration inputs, already agreed across ranks.

    ``signal_number``: the highest signal number any rank received (0: none), so a scheduler's
    SIGTERM (15) wins over a Ctrl-C (2) that reached some ranks. ``rerun``: the rerun machine's
    verdict on the iteration; ``replica``: the replica check's result when it ran;
    ``finished``: the last training iteration is done.
    """

    signal_received: bool = False
    elapsed_minutes_max: float = 0.0
    signal_number: int = 0
    rerun: RerunVerdict = field(default_factory=RerunVerdict)
    replica: ReplicaCheckResult | None = None
    finished: bool = False


@dataclass(frozen=True)
class ExitDecision:
    """What to do now: ``save`` a checkpoint (or not), then ``exit`` (or not), and why.

    ``diagnosis``: a finished attribution (suspect devices) that :func:`leave` records in
    ``<save>/rerun_verdict.json`` for the launcher; ``rewind``: a spike rewind to do instead
    (no save, no exit: ``stalwart.loop.Shell.act`` restores the snapshot)."""

    save: SaveKind = SaveKind.NONE
    exit: bool = False
    reason: ExitReason | None = None
    detail: str = ""
    exit_code: int = EXIT_CODE_GRACEFUL
    diagnosis: Diagnosis | None = None
    rewind: SpikeRewind | None = None


def flag_spelling(name: str) -> str:
    """The CLI's name of an :class:`ExitConfig` field (or ``train_iters``, ``save_dir``)."""
    return "--save" if name == "save_dir" else "--" + name.replace("_", "-")


def _every(interval: int | None, iteration: int) -> bool:
    return bool(interval) and iteration % int(interval or 1) == 0


def decide(
    iteration: int,
    inputs: ExitInputs,
    config: ExitConfig,
    *,
    can_save: bool = True,
    already_saved: bool = False,
    finished: bool = False,
    spell: Callable[[str], str] = flag_spelling,
) -> ExitDecision:
    """The save/exit decision for the completed ``iteration`` (pure; see the module priority list).

    Args:
        iteration: completed iterations, the number the log line shows.
        inputs: agreed across ranks (`gather_exit_inputs`).
        can_save: a checkpoint directory exists (``--save``).
        already_saved: a persistent checkpoint of this iteration was already written (e.g. by the
            rerun machine); no second save is requested.
        finished: this was the last training iteration.
        spell: how the caller's path names a setting in a reason (an :class:`ExitConfig`
            field, ``train_iters``, ``save_dir``): the flag by default.
    """
    validation = _validation_exit(iteration, inputs, can_save, spell)
    if validation is not None:
        return validation
    if inputs.rerun.rewind is not None:
        # The iteration was not trained: nothing to save; a signal or a time budget received
        # meanwhile is agreed again after the rewind (the handler keeps the signal).
        return ExitDecision(rewind=inputs.rerun.rewind, detail="spike rewind")
    finished = finished or inputs.finished
    # Exits always save persistently: a non-persistent save of the same iteration would not
    # survive the end of the job (deliberate deviation from Megatron, see the module docstring).
    exit_save = SaveKind.PERSISTENT if can_save and not already_saved else SaveKind.NONE
    signal_decision = _signal_decision(inputs, config, exit_save)
    if signal_decision is not None:
        return signal_decision
    regular = SaveKind.NONE
    if can_save and not already_saved:
        if _every(config.save_interval, iteration):
            regular = SaveKind.PERSISTENT
        elif _every(config.non_persistent_save_interval, iteration):
            regular = SaveKind.NON_PERSISTENT
    limit = config.exit_duration_in_mins
    if limit and inputs.elapsed_minutes_max > limit:
        elapsed = inputs.elapsed_minutes_max
        detail = f"{elapsed:.1f} minutes elapsed > {spell('exit_duration_in_mins')} {limit:g}"
        return ExitDecision(exit_save, True, ExitReason.DURATION, detail)
    if _every(config.exit_interval, iteration):
        detail = f"{spell('exit_interval')} {config.exit_interval}"
        return ExitDecision(exit_save, True, ExitReason.INTERVAL, detail)
    if iteration in config.phase_transition_iterations:
        detail = spell("phase_transition_iterations")
        return ExitDecision(exit_save, True, ExitReason.PHASE, detail)
    if finished:
        return ExitDecision(exit_save, True, ExitReason.FINISHED, f"reached {spell('train_iters')}")
    return ExitDecision(regular, False, None, "")


def _validation_exit(
    iteration: int, inputs: ExitInputs, can_save: bool, spell: Callable[[str], str]
) -> ExitDecision | None:
    """Replica mismatch (exit 17, never saved), then the rerun machine's verdict (16/17)."""
    mismatch = replica_exit(iteration, inputs.replica)
    if mismatch is not None:
        return mismatch
    verdict = inputs.rerun
    if not verdict.exit:
        return None
    reason, detail = ExitReason.RERUN, f"rerun state machine exit code {verdict.exit_code}"
    if verdict.replica_detail:  # the step's replica fingerprints: a replica mismatch
        reason, detail = ExitReason.REPLICA_MISMATCH, verdict.replica_detail
    if verdict.diagnosis is not None and verdict.diagnosis.suspects:
        detail += "; suspect " + ", ".join(s.describe() for s in verdict.diagnosis.suspects)
    save = SaveKind.NONE
    if verdict.checkpoint:
        if can_save:
            save = SaveKind.PERSISTENT
        else:
            detail += f" (it needs a checkpoint to resume from but {spell('save_dir')} is not set)"
    return ExitDecision(save, True, reason, detail, verdict.exit_code, verdict.diagnosis)


def replica_exit(iteration: int, replica: ReplicaCheckResult | None) -> ExitDecision | None:
    """Priority 0: the weights differ across the replicas: exit 17, never saved (a
    ``replica_corruption`` diagnosis when a majority names the ranks); None when they agree or
    were not compared. It outranks every other decision of the iteration."""
    if replica is None or replica.consistent:
        return None
    detail = f"iteration {iteration}: {replica.describe()}"
    code, diagnosis = EXIT_CODE_FAILED_ON_RESULT_VALIDATION, replica.diagnosis(iteration)
    return ExitDecision(SaveKind.NONE, True, ExitReason.REPLICA_MISMATCH, detail, code, diagnosis)


def _signal_decision(
    inputs: ExitInputs, config: ExitConfig, exit_save: SaveKind
) -> ExitDecision | None:
    """Priority 1: the exit signal (exit 0), or Ctrl-C with ``exit_on_interrupt`` (exit 130)."""
    if not inputs.signal_received:
        return None
    number = inputs.signal_number or int(config.signal_enum)  # older callers: the exit signal
    interrupt = number == signal.SIGINT and config.signal_enum is not signal.SIGINT
    if interrupt and config.exit_on_interrupt:
        return ExitDecision(
            exit_save, True, ExitReason.INTERRUPT, "received SIGINT", EXIT_CODE_INTERRUPTED
        )
    if config.exit_signal_handler and not interrupt:
        return ExitDecision(
            exit_save, True, ExitReason.SIGNAL, f"received {config.signal_enum.name}"
        )
    return None


def gather_exit_inputs(
    config: ExitConfig,
    signal_handler: DistributedSignalHandler | None,
    elapsed_minutes: float,
    group: Any = None,
) -> ExitInputs:
    """Agree on the signal flag and the elapsed time in ONE all-reduce MAX (or none at all).

    Every rank must call it at the same point of every iteration. Without
    ``--exit-signal-handler``, ``exit_on_interrupt`` and ``--exit-duration-in-mins`` nothing needs
    agreeing and no collective runs (all ranks share the config, so all skip it together).
    """
    if not config.needs_agreement:
        return ExitInputs(False, elapsed_minutes)
    received = signal_handler.received_signal if signal_handler is not None else None
    import torch.distributed as dist

    from stalwart.distributed.collectives import all_reduce_floats

    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        # One process: nothing to agree on, and no device round trip per iteration (an
        # interactive single-GPU run handles Ctrl-C by default).
        return ExitInputs(received is not None, elapsed_minutes, int(received or 0))

    # Deliberate sync: the one per-iteration exit agreement (signal MAX, time budget MAX).
    number, elapsed = all_reduce_floats(
        [float(int(received or 0)), elapsed_minutes], dist.ReduceOp.MAX, group
    )
    return ExitInputs(number > 0.5, elapsed, int(number))


def exit_message(decision: ExitDecision, iteration: int) -> str:
    """One line saying why the program exits (Megatron's wording where it exists)."""
    reason = decision.reason
    if reason is ExitReason.INTERRUPT:
        code = decision.exit_code
        return f"interrupted (Ctrl-C): exiting program at iteration {iteration} with code {code}"
    if reason is ExitReason.SIGNAL:
        signal = decision.detail.removeprefix("received ")
        return f"exiting program after {signal} at iteration {iteration}"
    if reason is ExitReason.DURATION:
        return f"exiting program after {decision.detail} at iteration {iteration}"
    why = reason.value if reason else "unknown"
    return f"exiting program at iteration {iteration} ({why}: {decision.detail})"


def write_exit_reason(
    save_dir: str | os.PathLike[str],
    reason: ExitReason,
    iteration: int,
    detail: str = "",
    exit_code: int = EXIT_CODE_GRACEFUL,
) -> Path | None:
    """Write ``<save>/exit_reason.json`` atomically (call on rank 0 only) and log one line.

    Fields: reason, iteration, detail, exit_code, time (UTC ISO 8601), hostname, pid. A file that
    cannot be written (e.g. ``exit_reason.json`` is a directory) is logged as one error line and
    None returned: the checkpoint is already saved, the exit must go on.
    """
    payload = {
        "reason": reason.value,
        "iteration": int(iteration),
        "detail": detail,
        "exit_code": int(exit_code),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
    }
    target = Path(save_dir) / EXIT_REASON_FILENAME
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(target, json.dumps(payload, indent=2), sync=Sync.FILE)
    except OSError as exc:
        logger.error("stalwart: cannot write %s: %s", target, exc.strerror or exc)
        return None
    # DEBUG: the exit line (exit_message) already says why; the file is the record.
    logger.debug(
        "stalwart: exit reason %s at iteration %d%s",
        reason.value,
        iteration,
        f" ({detail})" if detail else "",
    )
    return target


def read_exit_reason(save_dir: str | os.PathLike[str]) -> tuple[dict[str, Any] | None, str]:
    """``(record, "")`` from ``<save>/exit_reason.json``, or ``(None, why)`` when it is missing,
    not UTF-8 JSON, not an object, or its ``iteration``/``exit_code`` are not integers. Plain
    JSON: reading it runs nothing."""
    path = Path(save_dir) / EXIT_REASON_FILENAME
    try:
        with open_regular(path) as f:
            record = json.loads(f.read(1 << 20))
    except FileNotFoundError:
        return None, f"no {EXIT_REASON_FILENAME}"
    except (OSError, ValueError, RecursionError) as exc:
        return None, f"{path} unreadable: {type(exc).__name__}"
    if not isinstance(record, dict):
        return None, f"{path} holds a JSON {type(record).__name__}, not an object"
    for key in ("iteration", "exit_code"):
        value = record.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            return None, f"{path}: {key} is not an integer"
    return record, ""


def exit_inputs(
    agreed: Agreed,
    *,
    rerun: RerunVerdict | None = None,
    replica: ReplicaCheckResult | None = None,
    finished: bool = False,
) -> ExitInputs:
    """:class:`ExitInputs` from an iteration's agreement and the other exit inputs."""
    return ExitInputs(
        agreed.signal_received,
        agreed.elapsed_minutes_max,
        agreed.signal_number,
        rerun or RerunVerdict(),
        replica,
        finished,
    )


def leave(
    decision: ExitDecision,
    iteration: int,
    *,
    save_dir: str | os.PathLike[str] | None,
    rank: int = 0,
    log: Any = logger.info,
    checkpoint: str | None = None,
) -> int:
    """Act on an exit decision: the one place that records and waits. Returns the exit code.

    ``checkpoint``: the name in ``save_dir`` of the checkpoint the diagnosis' verdict trains on
    from, in the saver's layout (``write_verdict``; None: the reference trainer's).

    Logs :func:`exit_message`, writes ``exit_reason.json`` (and ``rerun_verdict.json`` when
    the decision carries a diagnosis) on rank 0 (when ``save_dir`` is set) and waits at a
    barrier, so that no rank leaves (and a launcher kills the others on a non-zero code) before
    rank 0 has written why. Finalize a pending async save before.
    """
    reason = decision.reason or ExitReason.FINISHED
    log(exit_message(decision, iteration))
    if save_dir and rank == 0:
        if decision.diagnosis is not None:
            from stalwart.reliability.rerun.attribution.verdict_file import write_verdict

            write_verdict(os.fspath(save_dir), decision.diagnosis, checkpoint=checkpoint)
        write_exit_reason(save_dir, reason, iteration, decision.detail, decision.exit_code)
    collectives.barrier()
    return decision.exit_code
