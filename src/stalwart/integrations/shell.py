"""The shell around a training step that someone else runs: hang sections, the agreed exit,
the training log with its probes, and the goodput ledger, built from stalwart's component
configs (never the reference trainer's run config).

The Lightning callback and the Hugging Face ``TrainerCallback`` are thin mappings of their
framework's hooks onto this object; a hand-written loop can use it as well. Per iteration::

    shell = ShellConfig(train_iters=100, save_dir=save_dir).build(rank=rank, world_size=world)
    shell.resumed(start)                              # after the framework loaded (or not)
    shell.start()
    for it in range(start, 100):
        with shell.iteration(it):                     # goodput step + the watchdog's step section
            loss = train_one_step()                   # the framework's step (or a GuardedStep)
        shell.record(it + 1, losses={"lm loss": loss}, batch_size=32)   # the log line, sinks
        decision = shell.decide(it + 1, finished=it + 1 == 100)          # one agreed decision
        if decision.save is not SaveKind.NONE:
            with shell.saving(it + 1):                # the checkpointing section, save timing
                save_checkpoint()                     # the framework's save
        if decision.exit:
            code = shell.finish(decision, it + 1)     # exit_reason.json, barrier, goodput line
            break
    shell.close()

With a :class:`stalwart.loop.GuardedStep` built on :attr:`TrainingShell.machine` and
:attr:`TrainingShell.agreement`, pass its ``StepResult`` to :meth:`decide` (``result=``): the
rerun verdict and the exit inputs were agreed in the step's one collective. Without it,
:meth:`decide` agrees on the exit inputs itself (one all-reduce per iteration, and only when a
signal handler or ``--exit-duration-in-mins`` needs it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from stalwart.config.observability import ObservabilityConfig
from stalwart.observability.energy import make_energy_meter
from stalwart.observability.goodput import GOODPUT_FILE, Bucket, make_goodput_ledger
from stalwart.observability.memory import MemoryMonitor
from stalwart.observability.save_timing import SaveTiming
from stalwart.observability.sinks import build_sinks
from stalwart.observability.straggler import StragglerIdle, make_straggler_detector
from stalwart.observability.timers import INTERVAL_TIME, Timers
from stalwart.observability.train_log import LogConfig, TensorOrScalar, TrainingLog
from stalwart.reliability.exit import (
    ExitConfig,
    ExitDecision,
    ExitReason,
    decide,
    exit_inputs,
    leave,
)
from stalwart.reliability.hang.sections import (
    FaultToleranceConfig,
    Section,
    build_section_monitor,
)
from stalwart.reliability.rerun import RerunConfig, RerunMode, RerunVerdict

logger = logging.getLogger(__name__)


def _default_exit() -> ExitConfig:
    return ExitConfig(exit_signal_handler=True)


def _default_log() -> LogConfig:
    return LogConfig(log_interval=10, log_progress_bar=False)  # frameworks draw their own bar


def _default_rerun() -> RerunConfig:
    return RerunConfig(rerun_mode=RerunMode.DISABLED)  # the guarded step turns it on


@dataclass(kw_only=True)
class ShellConfig:
    """What the shell does, in the components' own configs (each validates itself).

    Attributes:
        train_iters: the run's iterations (the log line's total; the exit's ``finished``).
        save_dir: where ``exit_reason.json``, ``ft_state.json`` and ``rerun_verdict.json`` go
            (the framework's checkpoint directory). None: nothing is written there.
        exit: signal, duration and interval exits (default: the SIGTERM handler on).
        ft: hang detection (``enable_ft=True`` starts the per-rank monitor process).
        rerun: the rerun state machine's flags, used by a guarded step (default: disabled).
        log: the training-log flags (default: every 10 iterations, no progress bar).
        obs: sinks (``tensorboard_dir``, W&B), timers, straggler, memory, energy flags.
        run_dir: metrics.jsonl, goodput.jsonl, memory.json, straggler.jsonl (default:
            ``save_dir``).
        goodput: keep the goodput ledger (rank 0, needs a run directory).
        seq_length: tokens per sample (tokens/s on the progress bar).
    """

    train_iters: int
    save_dir: str | None = None
    exit: ExitConfig = field(default_factory=_default_exit)
    ft: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    rerun: RerunConfig = field(default_factory=_default_rerun)
    log: LogConfig = field(default_factory=_default_log)
    obs: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    run_dir: str | None = None
    goodput: bool = True
    seq_length: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.train_iters, bool) or not isinstance(self.train_iters, int):
            raise ValueError(f"ShellConfig.train_iters: an integer >= 1, got {self.train_iters!r}")
        if self.train_iters < 1:
            raise ValueError(f"ShellConfig.train_iters: an integer >= 1, got {self.train_iters}")

    @property
    def artefact_dir(self) -> str | None:
        return self.run_dir or self.obs.run_dir or self.save_dir

    def build(
        self,
        *,
        rank: int = 0,
        world_size: int = 1,
        device: torch.device | str = "cpu",
        print_fn: Callable[..., None] = print,
    ) -> TrainingShell:
        return TrainingShell(
            self, rank=rank, world_size=world_size, device=torch.device(device), print_fn=print_fn
        )


class TrainingShell:
    """Everything around a step (see the module docstring). Build it in the main thread (the
    signal handler); :meth:`close` releases the monitor process, the handler and the files."""

    def __init__(
        self,
        config: ShellConfig,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        print_fn: Callable[..., None] = print,
    ) -> None:
        self.config, self.rank, self.world_size, self.device = config, rank, world_size, device
        self.print = print_fn if rank == 0 else (lambda *a, **k: None)
        self.started = time.monotonic()
        self._exit = contextlib.ExitStack()
        self._finished: int | None = None
        # The framework's checkpoints (its own names) by completed iterations, and the latest.
        self._checkpoints: dict[int, str] = {}
        self._latest: str | None = None
        self._evaluated = False  # since the last decide: agree on the exit inputs again
        try:
            self._build_reliability()
            self._build_observability()
        except BaseException:
            self._exit.close()
            raise

    def _build_reliability(self) -> None:
        cfg, run_dir = self.config, self.config.artefact_dir
        cfg.obs.check_extras()  # before anything is built or written
        say = self.print
        self.ledger = make_goodput_ledger(
            cfg.goodput, run_dir, rank=self.rank, print_fn=lambda line: say(line, flush=True)
        )
        self._exit.callback(self.ledger.close, "fault", "the shell closed without an exit")
        goodput_file = os.path.join(run_dir, GOODPUT_FILE) if run_dir else None
        self.sections = build_section_monitor(
            cfg.ft, self.rank, cfg.save_dir, goodput_file=goodput_file
        )
        self._exit.callback(self.sections.close)
        # Installed by start(): a framework installs its own handlers when its run begins.
        self.signal_handler = cfg.exit.make_signal_handler() if cfg.exit.handles_signals else None
        self.agreement = cfg.exit.build(self.signal_handler, self.started)
        self.machine = cfg.rerun.build(self.device, agreement=self.agreement)

    def _build_observability(self) -> None:
        cfg, obs, run_dir = self.config, self.config.obs, self.config.artefact_dir
        self.timers = Timers(
            obs.timing_log_level, obs.timing_log_option, mode=obs.timing_mode,
            device=self.device,
        )  # fmt: skip
        self.sink = build_sinks(
            rank=self.rank, tensorboard_dir=obs.tensorboard_dir, wandb_project=obs.wandb_project,
            wandb_exp_name=obs.wandb_exp_name, wandb_save_dir=obs.wandb_save_dir,
            wandb_mode=obs.wandb_mode, grouped=obs.group_metric_tags,
            tensorboard_queue_size=obs.tensorboard_queue_size,
            wandb_resume_file=os.path.join(run_dir, "wandb_run_id.txt") if run_dir else None,
        )  # fmt: skip
        self._exit.callback(self.sink.close)
        self.straggler = make_straggler_detector(
            obs.log_straggler, self.device, self.rank, self.world_size,
            threshold=obs.straggler_threshold, minmax_count=obs.straggler_minmax_count,
            run_dir=run_dir, on_at_start=not obs.disable_straggler_on_startup,
        )  # fmt: skip
        self._exit.callback(self.straggler.close)
        memory = MemoryMonitor(
            self.device, None, run_dir=run_dir, rank=self.rank,
            log_interval=cfg.log.log_interval, log_memory_interval=obs.log_memory_interval or None,
            to_tensorboard=obs.log_memory_to_tensorboard, sink=self.sink, log=logger.info,
        )  # fmt: skip
        self.energy = make_energy_meter(obs.log_energy, self.device, log=logger.info)
        self._exit.callback(self.energy.close)
        self.saves = SaveTiming(self.timers, ledger=self.ledger)
        self._metrics_file = obs.metrics_file or (
            os.path.join(run_dir, "metrics.jsonl") if run_dir else None
        )
        self._providers = [
            self.straggler, memory, self.energy,
            StragglerIdle(self.straggler, self.ledger), self.saves, self.ledger,
        ]  # fmt: skip
        self._flops: float | None = None
        self._log: TrainingLog | None = None

    @property
    def log(self) -> TrainingLog:
        """The training log, built at its first use (after :meth:`set_flops`, if any)."""
        if self._log is None:
            cfg = self.config
            if cfg.log.log_throughput and self._flops is None:
                raise ValueError(
                    "LogConfig.log_throughput: the model's FLOPs are not known yet; call "
                    "TrainingShell.set_flops first (stalwart.observability.flop_count)"
                )
            self._log = TrainingLog(
                cfg.log, train_iters=cfg.train_iters, sink=self.sink, timers=self.timers,
                rank=self.rank, world_size=self.world_size, flops_per_iteration=self._flops,
                metrics_file=self._metrics_file if self.rank == 0 else None,
                extra_providers=self._providers, print_fn=self.print, seq_length=cfg.seq_length,
            )  # fmt: skip
            self._exit.callback(self._log.close)
        return self._log

    # ------------------------------------------------------------------------ the run
    def set_flops(self, flops_per_iteration: float) -> None:
        """The whole job's FLOPs of one iteration (``stalwart.observability.flop_count``), for
        TFLOP/s in the log line (``LogConfig.log_throughput``). Before the first :meth:`record`."""
        if self._log is not None:
            raise RuntimeError("TrainingShell.set_flops: the training log is already built")
        self._flops = float(flops_per_iteration)

    def resumed(self, iteration: int, *, persistent: bool = True) -> None:
        """After the framework loaded a checkpoint of ``iteration`` (0: a fresh start)."""
        if iteration:
            self.sections.on_checkpoint_loaded(persistent=persistent)
        self.ledger.resumed(iteration)

    def start(self) -> None:
        """Right before the first iteration (main thread): the exit-signal handler is installed
        (over any the framework installed: a signal only raises stalwart's flag), the interval
        timer and the energy meter start."""
        if self.signal_handler is not None:
            self._exit.enter_context(self.signal_handler)
        self.timers(INTERVAL_TIME).start(barrier=True)
        self.energy.start()

    @contextlib.contextmanager
    def iteration(self, index: int) -> Iterator[Any]:
        """Iteration ``index`` (0-based): a goodput step and the watchdog's step section."""
        with self.ledger.step(index + 1) as span, self.sections.step_section():
            yield span
        self.straggler.step()

    def record(
        self,
        iteration: int,
        *,
        losses: Mapping[str, TensorOrScalar],
        batch_size: int,
        consumed_samples: int | None = None,
        learning_rate: TensorOrScalar | None = None,
        grad_norm: TensorOrScalar | None = None,
        skipped: torch.Tensor | bool = False,
    ) -> None:
        """The completed ``iteration`` (1-based) into the log line, the sinks and the metrics
        file (collective at log steps)."""
        self.log.on_iteration(
            iteration,
            losses=losses,
            learning_rate=learning_rate,
            global_batch_size=batch_size,
            consumed_samples=batch_size * iteration
            if consumed_samples is None
            else consumed_samples,
            grad_norm=grad_norm,
            skipped=skipped,
        )

    def decide(
        self,
        iteration: int,
        *,
        result: Any = None,
        finished: bool = False,
        can_save: bool = True,
    ) -> ExitDecision:
        """The one save/exit decision after the completed ``iteration`` (1-based). ``result``:
        the guarded step's ``StepResult`` (its verdict and agreed inputs), else the inputs are
        agreed here."""
        if result is not None:
            agreed, verdict = result.agreed, result.verdict
            if self._evaluated:  # a signal during the evaluation stops at this iteration
                agreed = self.agreement.agree_again()
        else:
            self.agreement.begin()
            agreed, verdict = self.agreement.finish(), RerunVerdict()
        self._evaluated = False
        inputs = exit_inputs(agreed, rerun=verdict, finished=finished)
        return decide(iteration, inputs, self.config.exit, can_save=can_save)

    @contextlib.contextmanager
    def saving(self, iteration: int, *, non_persistent: bool = False) -> Iterator[None]:
        """Around the framework's save: the checkpointing section, save timing, goodput's
        checkpoint bucket; energy paused."""
        self.energy.pause()
        with (
            self.sections.section(Section.CHECKPOINTING),
            self.saves.blocking(iteration, non_persistent=non_persistent),
        ):
            yield
        self.energy.resume()
        self.sections.maybe_update_timeouts()

    def checkpoint_at(self, iteration: int, name: str) -> None:
        """The framework saved or loaded checkpoint ``name`` (its name in ``save_dir``, in the
        framework's layout) holding ``iteration`` completed iterations: the one a rerun verdict
        names for a launch on other hardware to train on from."""
        self._checkpoints[int(iteration)] = name
        self._latest = name

    def _verdict_checkpoint(self, decision: ExitDecision) -> str | None:
        diagnosis = decision.diagnosis
        if diagnosis is None:
            return None
        if diagnosis.checkpoint_iteration is None:  # "the latest checkpoint"
            return self._latest
        return self._checkpoints.get(diagnosis.checkpoint_iteration)

    @contextlib.contextmanager
    def evaluation(self) -> Iterator[None]:
        """Around an evaluation: goodput's evaluation bucket. The next :meth:`decide` agrees on
        the exit inputs again (one collective on evaluating iterations only): a signal received
        during the evaluation ends the run at this iteration."""
        with self.ledger.span(Bucket.EVALUATION):
            yield
        self._evaluated = True

    def finish(self, decision: ExitDecision, iteration: int) -> int:
        """The one exit path: learn timeouts, record why (``exit_reason.json``), wait for the
        other ranks, close the ledger (rank 0 prints the goodput line). Returns the exit code.
        Idempotent: a second call returns the first code."""
        if self._finished is not None:
            return self._finished
        self.sections.maybe_update_timeouts(closing=True)
        if decision.exit_code and decision.reason is not ExitReason.INTERRUPT:
            # Ctrl-C is the user's own stop: its one line is leave()'s, with the code.
            logger.error("%s; exiting with code %d", decision.detail, decision.exit_code)
        code = leave(decision, iteration, save_dir=self.config.save_dir, rank=self.rank,
                     log=self.print, checkpoint=self._verdict_checkpoint(decision))  # fmt: skip
        reason = decision.reason or ExitReason.FINISHED
        self.ledger.close(reason.value, decision.detail)
        self._finished = code
        return code

    @property
    def exit_code(self) -> int | None:
        """The code :meth:`finish` returned (None before)."""
        return self._finished

    def fault(self, error: BaseException) -> None:
        """The framework raised: the ledger records the fault (then :meth:`close`)."""
        self.ledger.close("fault", f"{type(error).__name__}: {error}"[:200])

    def close(self) -> None:
        """Release everything (idempotent)."""
        self._exit.close()


__all__ = ["ShellConfig", "TrainingShell"]
