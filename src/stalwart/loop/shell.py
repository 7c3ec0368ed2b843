"""The shell around a training step, for any loop: one object that owns everything an
iteration needs besides the step itself, wired once.

It owns the goodput ledger, the hang watchdog's sections, the exit-signal handler, the
iteration agreement, the rerun state machine, the timers, the sinks, the probes (stragglers,
memory, energy, tensor dumps, the profiler window, the memory release, ``progress.txt``), the
save timing, the training log and the after-step replica check. :meth:`Shell.step` builds the
:class:`stalwart.loop.GuardedStep` on the shell's machine, agreement, timers, observer and
ledger. The reference trainer, the Lightning and Hugging Face adapters and the README's loop
are all this sequence (a framework that owns its step skips ``shell.step``)::

    with ShellConfig(train_iters=n, save_dir=save_dir).build(device=device) as shell:
        step = shell.step(model, optimizer, forward_step, RerunDataIterator(batches))
        shell.start()
        for it in range(n):
            with shell.iteration(it):                    # goodput step, watchdog, probes
                result = step.run(it)
            shell.record(it + 1, result, batch_size=gbs)     # log line, sinks
            decision = shell.decide(it + 1, result, finished=it + 1 == n)
            if decision.exit:                            # (a rejected iteration exits too)
                raise SystemExit(shell.finish(decision, it + 1))  # 0, 16 or 17

The README's "Using the parts in your own loop" adds the checkpointer (``shell.saving``,
``shell.maybe_finalize``, ``shell.finish(..., ckpt)``) and is run by its test.
Without a guarded step (a framework's own), :meth:`decide` agrees on the exit inputs itself
(one all-reduce per iteration, only when a signal handler or a duration needs it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from stalwart.loop.observer import StepObserver
from stalwart.loop.shell_config import ShellConfig
from stalwart.loop.step import GuardedStep, StepResult
from stalwart.observability.dumps import NullTensorDumper
from stalwart.observability.goodput import GOODPUT_FILE, Bucket, CompileSource, make_goodput_ledger
from stalwart.observability.run_dir import EventKind, RunPaths, append_event
from stalwart.observability.save_timing import SaveTiming
from stalwart.observability.straggler import StragglerIdle
from stalwart.observability.timer_names import INTERVAL_TIME
from stalwart.observability.train_log import TensorOrScalar, TrainingLog
from stalwart.reliability.exit import ExitDecision, ExitReason, SaveKind, decide, exit_inputs, leave
from stalwart.reliability.hang.sections import Section, build_section_monitor
from stalwart.reliability.replica_check import ReplicaConsistencyChecker
from stalwart.reliability.rerun import RerunVerdict

logger = logging.getLogger(__name__)


def _flushed(say: Callable[[str], None], line: str) -> None:
    say(line)
    sys.stdout.flush()


class Shell:
    """Everything around a step (see the module docstring); built by :meth:`ShellConfig.build`.
    :meth:`close` releases the monitor process, the handler, the files and the step."""

    def __init__(
        self, config: ShellConfig, *, rank: int, world_size: int, device: torch.device,
        print_fn: Callable[..., None] = print, attempt: int = 0, loss_scaler: Any = None,
        run_config: Mapping[str, Any] | None = None, memory_estimate: Any = None,
    ) -> None:  # fmt: skip
        self.config, self.rank, self.world_size, self.device = config, rank, world_size, device
        self.print = print_fn if rank == 0 else (lambda *a, **k: None)
        self.started = time.monotonic()
        self._exit = contextlib.ExitStack()
        self._finished: int | None = None
        self._checkpoints: dict[int, str] = {}  # a framework's checkpoint names by iteration
        self._latest: str | None = None
        self._evaluated = False  # since the last decide: agree on the exit inputs again
        self._step: GuardedStep | None = None
        self._model: nn.Module | None = None  # the unwrapped model (replica check, norms)
        self._consumed = 0
        try:
            config.check_extras()  # before anything is built or written
            # The sinks first: a W&B run that cannot start (no login) fails before the ledger
            # writes the run directory, so such a start leaves nothing behind.
            self.sink = config.sinks.build(
                rank=rank, run_dir=config.artefact_dir, config=run_config
            )
            self._exit.callback(self.sink.close)
            self._build_reliability(attempt, loss_scaler)
            self._build_probes(memory_estimate)
        except BaseException:
            self._exit.close()
            raise

    def _build_reliability(self, attempt: int, loss_scaler: Any) -> None:
        cfg, run_dir = self.config, self.config.artefact_dir
        try:
            self.ledger = make_goodput_ledger(
                cfg.goodput, run_dir, rank=self.rank, attempt=attempt,
                print_fn=functools.partial(_flushed, self.print),
            )  # fmt: skip
        except OSError as exc:
            raise ValueError(f"{run_dir}: cannot write the goodput ledger ({exc})") from None
        self._exit.callback(self.ledger.close, "fault", "the shell closed without an exit")
        goodput_file = os.path.join(run_dir, GOODPUT_FILE) if run_dir else None
        self.sections = build_section_monitor(
            cfg.ft, self.rank, cfg.save_dir, goodput_file=goodput_file
        )
        self._exit.callback(self.sections.close)
        self.signal_handler = cfg.exit.make_signal_handler() if cfg.exit.handles_signals else None
        self.agreement = cfg.exit.build(self.signal_handler, self.started)
        scaler = {} if loss_scaler is None else {
            "state_save_func": loss_scaler.state_dict,
            "state_restore_func": loss_scaler.load_state_dict,
        }  # fmt: skip
        self.machine = cfg.rerun.build(
            self.device, agreement=self.agreement, marker_dir=cfg.save_dir, **scaler
        )
        interval = cfg.rerun.check_weight_hash_across_dp_replicas_interval
        self.replicas = ReplicaConsistencyChecker(interval)

    def _build_probes(self, estimate: Any) -> None:
        cfg, run_dir, on_close = self.config, self.config.artefact_dir, self._exit.callback
        self.timers = cfg.timers.build(self.device)
        self.straggler = cfg.straggler.build(self.device, self.rank, self.world_size, run_dir)
        on_close(self.straggler.close)
        memory = cfg.memory.build(
            self.device, estimate, run_dir=run_dir, rank=self.rank,
            log_interval=cfg.log.log_interval, sink=self.sink, log=logger.info,
        )  # fmt: skip
        self.energy = cfg.energy.build(self.device, log=logger.info)
        on_close(self.energy.close)
        self.saves = SaveTiming(self.timers, ledger=self.ledger)
        self.memory_release = cfg.memory_release.build(self.device)
        self.profiler = cfg.profiler.build(
            rank=self.rank, world_size=self.world_size, device=self.device, run_dir=run_dir
        )
        on_close(self.profiler.close)
        self.progress = cfg.progress.build(cfg.save_dir, self.world_size, self.rank)
        self.observer = StepObserver(self.straggler, NullTensorDumper(), self.memory_release)
        self._providers = [
            self.straggler, memory, self.energy,
            StragglerIdle(self.straggler, self.ledger), self.saves, self.ledger,
        ]  # fmt: skip
        self._flops: float | None = None
        self._peak_tflops: float | None = None
        self._log: TrainingLog | None = None

    # ------------------------------------------------------------------------ the step
    def step(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, forward_step: Any, data: Any,
        *, num_microbatches: int = 1, faults: Any = None, **options: Any,
    ) -> GuardedStep:  # fmt: skip
        """The guarded step on the shell's machine, agreement, timers, observer (stragglers,
        dumps of the unwrapped ``model``, the memory release, a ``backward`` fault injector)
        and ledger. ``options``: the rest of :class:`GuardedStep`'s arguments (``plan``,
        ``clip_grad``, ``autocast``, ``lookahead``, ...). One step per shell."""
        if self._step is not None:
            raise RuntimeError("Shell.step: this shell already built its step")
        cfg, raw = self.config, getattr(model, "module", model)  # DDP's wrapped module
        dumper = cfg.dumps.build(
            raw, run_dir=cfg.artefact_dir, log_interval=cfg.log.log_interval, rank=self.rank
        )
        self._exit.callback(dumper.close)
        self.observer = StepObserver(self.straggler, dumper, self.memory_release, faults, self.rank)  # fmt: skip
        self._step = GuardedStep(
            model=model, optimizer=optimizer, forward_step=forward_step, machine=self.machine,
            data=data, num_microbatches=num_microbatches, agreement=self.agreement,
            timers=self.timers, observer=self.observer if self.observer.enabled else None,
            log_num_zeros=cfg.log.log_num_zeros_in_grad, goodput=self.ledger, **options,
        )  # fmt: skip
        self._exit.callback(self._step.close)
        self.watch(raw)
        return self._step

    def watch(self, model: nn.Module) -> None:
        """The (unwrapped) model whose parameters ``--log-params-norm`` and the replica check
        read: :meth:`step` sets it; a framework's own step sets it here."""
        self._model = model

    def set_flops(self, flops_per_iteration: float, peak_tflops_per_gpu: float | None = None) -> None:  # fmt: skip
        """The whole job's FLOPs of one iteration (``stalwart.observability.flop_count``), for
        TFLOP/s (``LogConfig.log_throughput``) and MFU; before the first :meth:`record`."""
        if self._log is not None:
            raise RuntimeError("Shell.set_flops: the training log is already built")
        self._flops, self._peak_tflops = float(flops_per_iteration), peak_tflops_per_gpu

    @property
    def log(self) -> TrainingLog:
        """The training log, built at its first use (after :meth:`set_flops`, if any)."""
        if self._log is None:
            cfg = self.config
            if cfg.log.log_throughput and self._flops is None:
                raise ValueError(
                    "LogConfig.log_throughput: the model's FLOPs are not known yet; call "
                    "Shell.set_flops first (stalwart.observability.flop_count)"
                )
            metrics = cfg.sinks.metrics_path(cfg.artefact_dir) if self.rank == 0 else None
            self._log = TrainingLog(
                cfg.log, train_iters=cfg.train_iters, sink=self.sink, timers=self.timers,
                rank=self.rank, world_size=self.world_size, flops_per_iteration=self._flops,
                metrics_file=metrics, extra_providers=self._providers, print_fn=self.print,
                seq_length=cfg.seq_length, peak_tflops_per_gpu=self._peak_tflops,
            )  # fmt: skip
            self._exit.callback(self._log.close)
        return self._log

    # ------------------------------------------------------------------------ the run
    def handle_signals(self) -> None:
        """Install the exit-signal handler now (idempotent; :meth:`start` does it too). It is
        installed over any a framework installed: a signal only raises stalwart's flag."""
        handler, self.signal_handler = self.signal_handler, None
        if handler is not None:
            self._exit.enter_context(handler)

    def start(
        self, *, resumed: Any = None, flops_so_far: float = 0.0,
        manifest: Mapping[str, Any] | None = None,
    ) -> None:  # fmt: skip
        """Right before the first iteration (main thread), after a load: ``resumed``, the
        ``Checkpointer.load`` result (None: nothing loaded; or call :meth:`resumed`). Installs
        the handler, writes ``manifest`` (the run's settings, rank 0, for the report), starts
        ``progress.txt``, the interval timer and the energy meter."""
        if resumed is not None:
            self.resumed(resumed.iteration, persistent=not resumed.non_persistent)
        self.handle_signals()
        run_dir = self.config.artefact_dir
        if manifest is not None and self.rank == 0 and run_dir:
            metrics = self.config.sinks.metrics_path(run_dir)
            RunPaths.for_run(run_dir, metrics).write_manifest(manifest)
        self.progress.start(flops_so_far)
        self.timers(INTERVAL_TIME).start(barrier=True)
        self.energy.start()

    def resumed(self, iteration: int, *, persistent: bool = True) -> None:
        """A checkpoint of ``iteration`` was loaded (0: a fresh start)."""
        if iteration:
            self.sections.on_checkpoint_loaded(persistent=persistent)
        self.ledger.resumed(iteration)

    @contextlib.contextmanager
    def iteration(self, index: int) -> Iterator[Any]:
        """Iteration ``index`` (0-based): the profiler window, a goodput step (booked as compile
        time when it captured a graph, as rerun time when it was rejected), the watchdog's step
        section, the observer's iteration (dumps, stragglers, memory release)."""
        self.profiler.on_iteration_start(index)
        observer = self.observer  # a framework may build the step inside its first step
        captures = self._step.capture_state if self._step is not None else None
        with self.ledger.step(index + 1) as span:
            with self.sections.step_section():
                observer.begin_iteration(index + 1)
                yield span
                observer.end_iteration()
            step = self._step
            if step is not None and captures is not None and step.capture_state != captures:
                span.reclassify(Bucket.COMPILE, CompileSource.CAPTURE)
            if step is not None and step.rejected:
                span.abandon(Bucket.RERUN)  # its passes validated, nothing advanced
        self.profiler.on_iteration_end(index + 1)
        if step is None:
            self._refuse_without_step()

    def _refuse_without_step(self) -> None:
        """Settings that only the guarded step can honour, refused in one line without it."""
        cfg = self.config
        needs = {
            "tensor dumps (they hook each micro-batch's forward and backward)":
                cfg.dumps.dump_config(log_interval=1).any_enabled,
            "LogConfig.log_num_zeros_in_grad (it counts the gradients the step clips)":
                cfg.log.log_num_zeros_in_grad,
        }  # fmt: skip
        for what, wanted in needs.items():
            if wanted:
                raise ValueError(
                    f"{what}: needs the guarded step (GuardedModule, StalwartTrainer, Shell.step)"
                )

    def record(
        self, iteration: int, result: StepResult | None = None, *, batch_size: int,
        losses: Mapping[str, TensorOrScalar] | None = None,
        consumed_samples: int | None = None, **values: Any,
    ) -> None:  # fmt: skip
        """The completed ``iteration`` (1-based) into the log line, the sinks and the metrics
        file (collective at log steps). ``result``: the guarded step's (its losses, gradient
        norm, zeros, skip; nothing is logged for a rejected one); ``values``: the rest of
        ``TrainingLog.on_iteration``'s (``learning_rate``, ``grad_norm``, ``loss_scale``, ...)."""
        if result is not None and result.verdict.exit:
            return
        self._consumed = batch_size * iteration if consumed_samples is None else consumed_samples
        if result is not None:
            losses = result.losses
            values = {"grad_norm": result.grad_norm, "num_zeros": result.num_zeros,
                      "skipped": result.skipped, **values}  # fmt: skip
        values = {"learning_rate": None, "grad_norm": None, "skipped": False, **values}
        log = self.config.log
        is_log = iteration % log.log_interval == 0 or iteration in (1, self.config.train_iters)
        if log.log_params_norm and is_log and self._model is not None:
            values.setdefault("params_norm", params_norm(self._model))
        self.log.on_iteration(
            iteration, losses=losses or {}, global_batch_size=batch_size,
            consumed_samples=self._consumed, **values,
        )  # fmt: skip

    @contextlib.contextmanager
    def evaluation(self) -> Iterator[None]:
        """Around an evaluation: goodput's evaluation bucket and the watchdog's evaluation. The
        next :meth:`decide` agrees on the exit inputs again (a signal received during the
        evaluation ends the run at this iteration)."""
        self.sections.start_evaluation()
        with self.ledger.span(Bucket.EVALUATION):
            yield
        self._evaluated = True

    @contextlib.contextmanager
    def eval_iteration(self) -> Iterator[None]:
        """One evaluation iteration: the watchdog's section, then the memory release."""
        with self.sections.step_section(is_eval=True):
            yield
        self.memory_release.after_eval_step()

    def decide(
        self, iteration: int, result: StepResult | None = None, *, finished: bool = False,
        can_save: bool | None = None,
    ) -> ExitDecision:  # fmt: skip
        """The one save/exit decision after the completed ``iteration`` (1-based). ``result``:
        the guarded step's (its verdict and agreed inputs), else the inputs are agreed here.
        The replica check runs when due (its interval, or before any save)."""
        if result is not None:
            agreed, verdict = result.agreed, result.verdict
            if self._evaluated:  # a signal during the evaluation stops at this iteration
                agreed = self.agreement.agree_again()
        else:
            self.agreement.begin()
            agreed, verdict = self.agreement.finish(), RerunVerdict()
        self._evaluated = False
        inputs = exit_inputs(agreed, rerun=verdict, finished=finished)
        can = self.config.save_dir is not None if can_save is None else can_save
        decision = decide(iteration, inputs, self.config.exit, can_save=can)
        saving = decision.save is not SaveKind.NONE
        if not verdict.exit and self._model is not None and self.replicas.due(iteration, saving=saving):  # fmt: skip
            inputs = dataclasses.replace(inputs, replica=self.replicas.check(self._model))
            decision = decide(iteration, inputs, self.config.exit, can_save=can)
        if decision.exit and self._log is not None:  # agreed on every rank
            self._log.flush()  # the iterations since the last log line
            self._log.end_progress()  # save and exit lines print below the bar
        return decision

    @contextlib.contextmanager
    def saving(
        self, iteration: int, *, non_persistent: bool = False, async_save: bool = False,
        flops_so_far: float | None = None, tokens_so_far: float | None = None,
    ) -> Iterator[None]:  # fmt: skip
        """Around a save: the checkpointing section, save timing, goodput's checkpoint bucket,
        energy paused; then ``progress.txt``'s line and the run's event."""
        self.energy.pause()  # a save is not training energy
        with (
            self.sections.section(Section.CHECKPOINTING),
            self.saves.blocking(iteration, non_persistent=non_persistent, async_save=async_save),
        ):
            yield
        self.energy.resume()
        if not non_persistent:  # --log-progress: Megatron's progress.txt line
            flops = (self._flops or 0.0) * iteration if flops_so_far is None else flops_so_far
            tokens = tokens_so_far
            if tokens is None:
                tokens = float(self._consumed * (self.config.seq_length or 0))
            self.progress.on_save(iteration, flops, tokens, async_save=async_save)
        self.sections.maybe_update_timeouts(async_save=async_save)
        kind = "non-persistent checkpoint" if non_persistent else "checkpoint"
        self.event(iteration, EventKind.CHECKPOINT, f"saved {kind}")

    def maybe_finalize(self, checkpointer: Any) -> None:
        """Complete a pending async save that finished in the background (its section)."""
        with self.sections.section(Section.CHECKPOINTING, is_async_finalization=True):
            committed = checkpointer.maybe_finalize()
        if committed is not None:
            self.saves.finalized(committed)

    def finish(
        self, decision: ExitDecision, iteration: int, checkpointer: Any = None, *,
        async_save: bool = False,
    ) -> int:  # fmt: skip
        """The one exit path: complete a pending save, learn timeouts, record why
        (``exit_reason.json``, the run's events), wait for the other ranks, close the ledger
        (rank 0 prints the goodput line). Returns the exit code; a second call the first's."""
        if self._finished is not None:
            return self._finished
        reason = decision.reason or ExitReason.FINISHED
        if self._log is not None:
            self._log.end_progress()
        if self._step is not None:
            logger.info("look-ahead launches: %d used of %d", self._step.num_used, self._step.num_launched)  # fmt: skip
        if checkpointer is not None:
            with (
                self.sections.section(Section.CHECKPOINTING, is_async_finalization=True),
                self.saves.finalizing(),
            ):
                checkpointer.finalize()  # an exit always completes the pending async save
            self.saves.finalized_all()
        self.sections.maybe_update_timeouts(closing=True, async_save=async_save)
        if reason is ExitReason.RERUN:  # the diagnosis goes to rerun_verdict.json in leave()
            self.event(iteration, EventKind.RERUN, decision.detail)
        self.event(iteration, EventKind.EXIT,
                   f"{reason.value}: {decision.detail} (exit code {decision.exit_code})")  # fmt: skip
        if decision.exit_code and reason is not ExitReason.INTERRUPT:
            # Ctrl-C is the user's own stop: its one line is leave()'s, with the code.
            logger.error("%s; exiting with code %d", decision.detail, decision.exit_code)
        self._finished = leave(decision, iteration, save_dir=self.config.save_dir, rank=self.rank,
                               log=self.print, checkpoint=self._verdict_checkpoint(decision))  # fmt: skip
        self.ledger.close(reason.value, decision.detail)
        return self._finished

    def event(self, iteration: int, kind: EventKind, detail: str) -> None:
        """Append to the run's event timeline (rank 0; nothing without a run directory)."""
        if self.config.artefact_dir and self.rank == 0:
            append_event(self.config.artefact_dir, iteration, kind, detail)

    def checkpoint_at(self, iteration: int, name: str) -> None:
        """A framework saved or loaded checkpoint ``name`` (its name in ``save_dir``) holding
        ``iteration`` completed iterations: the one a rerun verdict names to train on from."""
        self._checkpoints[int(iteration)] = name
        self._latest = name

    def _verdict_checkpoint(self, decision: ExitDecision) -> str | None:
        diagnosis = decision.diagnosis
        if diagnosis is None:
            return None
        if diagnosis.checkpoint_iteration is None:  # "the latest checkpoint"
            return self._latest
        return self._checkpoints.get(diagnosis.checkpoint_iteration)

    @property
    def exit_code(self) -> int | None:
        """The code :meth:`finish` returned (None before)."""
        return self._finished

    def fault(self, error: BaseException) -> None:
        """The loop raised: the ledger records the fault (then :meth:`close`)."""
        self.ledger.close("fault", f"{type(error).__name__}: {error}"[:200])

    def refused(self) -> None:
        """The launch was refused (bad input found after start-up): no goodput session."""
        self.ledger.refused()

    def close(self) -> None:
        """Release everything (idempotent)."""
        self._exit.close()

    def __enter__(self) -> Shell:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is not None and not isinstance(exc, SystemExit) and self._finished is None:
            self.fault(exc)
        self.close()


def params_norm(model: nn.Module) -> torch.Tensor:
    """L2 norm of all parameters (device tensor, ``--log-params-norm``)."""
    norms = torch._foreach_norm([p.detach() for p in model.parameters()])
    return torch.linalg.vector_norm(torch.stack(norms))


__all__ = ["Shell", "ShellConfig", "params_norm"]
