"""The shell around a training step, for any loop: one object that owns everything an
iteration needs besides the user's model, wired once.

It owns the goodput ledger, the hang watchdog's sections, the exit-signal handler, the
iteration agreement, the rerun state machine (with the one replica check), the timers, the
sinks, the probes (stragglers, memory, energy, tensor dumps, the profiler window, the memory
release, ``progress.txt``), the save timing and the training log (:mod:`stalwart.loop.shell_parts`)
and the iteration itself: its count and number (:mod:`stalwart.loop.iterations`: from 1, in
every verb, message and file), the skip list, the compile booking, the evaluation hooks and its
own checkpoint state (every RNG, the rerun machine, the count; :meth:`Shell.checkpointer`).
:meth:`Shell.step` builds the :class:`stalwart.loop.GuardedStep` on the shell's parts. The
reference trainer, the Lightning and Hugging Face adapters and the README's loop are all this
sequence (a framework that owns its step and checkpoints uses :meth:`saving` and :meth:`finish`
instead of :meth:`act`)::

    with ShellConfig(train_iters=n, save_dir=save_dir).build(device=device) as shell:
        step = shell.step(model, optimizer, forward_step, RerunDataIterator(batches))
        ckpt = shell.checkpointer(CheckpointManager(save_dir), model, optimizer)
        shell.start(ckpt)                                # resumes from the newest checkpoint
        while True:
            with shell.iteration() as it:                # goodput, watchdog, probes, skips
                result = step.run(it)
            shell.record(result, batch_size=gbs)         # log line, sinks
            if (code := shell.act(shell.decide(result), ckpt)) is not None:
                raise SystemExit(code)                   # 0, 16 or 17

Without a guarded step (a framework's own), :meth:`decide` agrees on the exit inputs itself
(one all-reduce per iteration, only when a signal handler or a duration needs it).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from stalwart.compile import NullCompileCache
from stalwart.loop.checkpointing import Checkpointer, LoopState, RngState
from stalwart.loop.compile_booking import CompileBooking
from stalwart.loop.iterations import Iteration, Iterations
from stalwart.loop.naming import Names
from stalwart.loop.observer import NULL_OBSERVER, StepObserver
from stalwart.loop.rewind import check_rewindable
from stalwart.loop.shell_exit import ExitPath
from stalwart.loop.shell_iteration import IterationScope
from stalwart.loop.shell_log import ShellLog, params_norm
from stalwart.loop.shell_parts import Probes, Reliability
from stalwart.loop.shell_settings import ShellSettings
from stalwart.loop.step import GuardedStep, StepResult
from stalwart.observability.run_dir import EventKind, RunPaths, append_event
from stalwart.observability.timer_names import INTERVAL_TIME
from stalwart.observability.train_log import TensorOrScalar, TrainingLog
from stalwart.reliability.exit import ExitDecision, SaveKind
from stalwart.reliability.rerun import resolve_iterations_to_skip
from stalwart.reliability.rerun.types import SpikeRewind
from stalwart.reliability.rewind import RewindRecord

logger = logging.getLogger(__name__)


class Shell:
    """Everything around a step (see the module docstring); built by :meth:`ShellConfig.build`.
    :meth:`close` releases the monitor process, the handler, the files and the step.

    ``names``: how this path spells the settings in its messages (:class:`Names`);
    ``compile_cache``: an open persistent compile cache whose artifacts are written after an
    iteration that compiled (default: none; compiled iterations are booked all the same)."""

    def __init__(
        self,
        config: ShellSettings,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        print_fn: Callable[..., None] = print,
        attempt: int = 0,
        loss_scaler: Any = None,
        run_config: Mapping[str, Any] | None = None,
        memory_estimate: Any = None,
        names: Names = Names.LOOP,
        compile_cache: Any = None,
    ) -> None:
        self.config, self.rank, self.world_size, self.device = config, rank, world_size, device
        self.names = names
        self.print = print_fn if rank == 0 else (lambda *a, **k: None)
        self.started = time.monotonic()
        self._exit = contextlib.ExitStack()
        self.exits = ExitPath(self)  # its saves, its exit code
        self._step: GuardedStep | None = None
        self._model: nn.Module | None = None  # the unwrapped model (replica check, norms)
        self._began = False  # an iteration began: a ValueError now is no refused start
        # Before anything is built or written: a refused start leaves nothing behind.
        config.check(names, device=device, world_size=world_size)
        try:
            self._build(attempt, loss_scaler, run_config, memory_estimate, compile_cache)
        except BaseException as exc:
            if isinstance(exc, ValueError) and hasattr(self, "ledger"):
                self.ledger.refused()  # bad input found while building: no goodput session
            self._exit.close()
            raise

    def _build(
        self,
        attempt: int,
        loss_scaler: Any,
        run_config: Mapping[str, Any] | None,
        estimate: Any,
        compile_cache: Any,
    ) -> None:
        config, say = self.config, self._say
        # The sinks first: a W&B run that cannot start (no login) fails before the ledger
        # writes the run directory, so such a start leaves nothing behind.
        sink = config.sinks.build(rank=self.rank, run_dir=config.artefact_dir, config=run_config)
        self._exit.callback(sink.close)
        parts = Reliability.build(
            config,
            rank=self.rank,
            device=self.device,
            attempt=attempt,
            loss_scaler=loss_scaler,
            say=say,
            stack=self._exit,
            started=self.started,
        )
        self.ledger, self.sections, self.machine = parts.ledger, parts.sections, parts.machine
        self.signal_handler, self.agreement = parts.signal_handler, parts.agreement
        self.rewinder = parts.rewinder
        self.iterations = Iterations(config.train_iters, resolve_iterations_to_skip(config.rerun))
        probes = Probes.build(
            config,
            rank=self.rank,
            world_size=self.world_size,
            device=self.device,
            ledger=self.ledger,
            sink=sink,
            estimate=estimate,
            say=say,
            stack=self._exit,
        )
        self.timers, self.sink, self.straggler = probes.timers, probes.sink, probes.straggler
        self.energy, self.saves, self.profiler = probes.energy, probes.saves, probes.profiler
        self.memory_release, self.progress = probes.memory_release, probes.progress
        self.observer: StepObserver = probes.observer
        self._build_own(compile_cache, probes.providers)

    def _build_own(self, compile_cache: Any, providers: list[Any]) -> None:
        """What the shell keeps itself: the compile booking, the iteration's scope and the
        training log."""
        self.compiles = CompileBooking(
            compile_cache or NullCompileCache(), self.ledger, enabled=True
        )
        self._scope = IterationScope(
            self.iterations,
            ledger=self.ledger,
            sections=self.sections,
            profiler=self.profiler,
            memory_release=self.memory_release,
            rewinder=self.rewinder,
            compiles=self.compiles,
            skip_setting=self.names.spell("rerun.iterations_to_skip"),
            announce=self._announce_skip,
        )
        self._records = ShellLog(
            self.config,
            self.names,
            rank=self.rank,
            world_size=self.world_size,
            sink=self.sink,
            timers=self.timers,
            providers=providers,
            print_fn=self.print,
            stack=self._exit,
        )

    def _say(self, line: str) -> None:
        """A line of the run's own (rank 0), flushed: the probes' reports (printed above the
        progress bar: the training log lifts it around them), the goodput line."""
        self.print(line)
        sys.stdout.flush()

    # ------------------------------------------------------------------------ the step
    def step(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        forward_step: Any,
        data: Any,
        *,
        num_microbatches: int = 1,
        faults: Any = None,
        **options: Any,
    ) -> GuardedStep:
        """The guarded step on the shell's machine, agreement, timers, observer (stragglers,
        dumps of the unwrapped ``model``, the memory release, a ``backward`` fault injector)
        and ledger. ``options``: the rest of :class:`GuardedStep`'s arguments (``plan``,
        ``clip_grad``, ``autocast``, ``lookahead``, ...). One step per shell."""
        if self._step is not None:
            raise RuntimeError("Shell.step: this shell already built its step")
        cfg, raw = self.config, getattr(model, "module", model)  # DDP's wrapped module
        check_rewindable(cfg, self.names, data, options.get("plan"))
        dumper = cfg.dumps.build(
            raw, run_dir=cfg.artefact_dir, log_interval=cfg.log.log_interval, rank=self.rank
        )
        self._exit.callback(dumper.close)
        self.observer = StepObserver(self.straggler, dumper, self.memory_release, faults, self.rank)
        self._step = GuardedStep(
            model=model,
            optimizer=optimizer,
            forward_step=forward_step,
            machine=self.machine,
            data=data,
            num_microbatches=num_microbatches,
            agreement=self.agreement,
            timers=self.timers,
            # A disabled observer's step pays nothing for it.
            observer=self.observer if self.observer.enabled else NULL_OBSERVER,
            log_num_zeros=cfg.log.log_num_zeros_in_grad,
            goodput=self.ledger,
            **options,
        )
        self._exit.callback(self._step.close)
        self.watch(raw)
        return self._step

    def watch(self, model: nn.Module) -> None:
        """The (unwrapped) model whose parameters ``log_params_norm`` and the replica check
        read: :meth:`step` sets it; a framework's own step sets it here."""
        self._model = model

    def set_flops(
        self, flops_per_iteration: float, peak_tflops_per_gpu: float | None = None
    ) -> None:
        """The whole job's FLOPs of one iteration (``stalwart.observability.flop_count``), for
        TFLOP/s (``LogConfig.log_throughput``) and MFU; before the first :meth:`record`."""
        self._records.set_flops(flops_per_iteration, peak_tflops_per_gpu)

    @property
    def log(self) -> TrainingLog:
        """The training log, built at its first use (after :meth:`set_flops`, if any)."""
        return self._records.log

    @property
    def watched(self) -> nn.Module | None:
        """The model :meth:`watch` was given (the replica check and parameter norms read it)."""
        return self._model

    @property
    def built_log(self) -> TrainingLog | None:
        """The training log if it was built (None before its first use)."""
        return self._records.built

    @property
    def guarded(self) -> GuardedStep | None:
        """The guarded step :meth:`step` built (None: a framework's own step)."""
        return self._step

    @property
    def flops_per_iteration(self) -> float | None:
        """What :meth:`set_flops` was given (None before)."""
        return self._records.flops

    # ------------------------------------------------------------------------ its state
    @property
    def state(self) -> LoopState:
        """The loop's progress, checkpointed as ``train_state``: ``iteration`` (completed) and
        ``consumed_samples``."""
        return self.iterations.state

    @property
    def completed(self) -> int:
        """Iterations completed (accepted or skipped): the number of the last one done."""
        return self.iterations.completed

    @property
    def current(self) -> Iteration | None:
        """The iteration in progress (inside :meth:`iteration`), else None."""
        return self.iterations.current

    def checkpointer(
        self,
        manager: Any,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        data: Any = None,
        common: Mapping[str, Any] | None = None,
        per_rank: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> Checkpointer:
        """A :class:`Checkpointer` with the shell's own state registered: the guarded step
        (first: its state settles a launch before the data and RNG are read), the count
        (``train_state``), ``data`` (the loop's data iterator), every RNG (``rng``) and the
        rerun machine (``rerun``). ``common`` / ``per_rank``: the loop's other parts;
        ``options``: ``Checkpointer``'s (``check_common``, ``upgrade_common``)."""
        check_rewindable(self.config, self.names, data, None, registered=data is not None)
        parts: dict[str, Any] = {} if self._step is None else {"step": self._step}
        parts["train_state"] = self.state
        if data is not None:
            parts["data"] = data
        own = {"rng": RngState(self.machine.rng), "rerun": self.machine}
        common, per_rank = {**parts, **(common or {})}, {**own, **(per_rank or {})}
        return Checkpointer(manager, model, optimizer, common=common, per_rank=per_rank, **options)

    # ------------------------------------------------------------------------ the run
    def handle_signals(self) -> None:
        """Install the exit-signal handler now (idempotent; :meth:`start` does it too). It is
        installed over any a framework installed: a signal only raises stalwart's flag."""
        handler, self.signal_handler = self.signal_handler, None
        if handler is not None:
            self._exit.enter_context(handler)

    def start(
        self,
        checkpointer: Checkpointer | None = None,
        *,
        resumed: Any = None,
        flops_so_far: float = 0.0,
        manifest: Mapping[str, Any] | None = None,
    ) -> None:
        """Right before the first iteration (main thread): loads ``checkpointer``'s newest
        checkpoint (or takes ``resumed``, a ``Checkpointer.load`` result already loaded; None:
        a fresh start), installs the handler, writes ``manifest`` (the run's settings, rank 0,
        for the report), starts ``progress.txt``, the interval timer and the energy meter."""
        if checkpointer is not None and resumed is None:
            resumed = checkpointer.load()
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
        """A checkpoint holding ``iteration`` completed iterations was loaded (0: a fresh
        start): the count goes on from there."""
        self.state.iteration = int(iteration)
        if iteration:
            self.sections.on_checkpoint_loaded(persistent=persistent)
        self.ledger.resumed(iteration)

    @contextlib.contextmanager
    def iteration(self) -> Iterator[Iteration]:
        """The next iteration (numbered from 1): the profiler window, a goodput step (booked as
        compile time when it compiled or captured a graph, as rerun time when it was
        rejected), the watchdog's step section, the observer's iteration (dumps, stragglers,
        memory release). A skipped one says so here; a rejected one is not counted."""
        with self._scope.iteration(self.observer, lambda: self._step, self._begin) as it:
            yield it
        if self._step is None:
            self.refuse_without_step()

    def _begin(self) -> None:
        self._began = True  # an iteration began: a ValueError now is no refused start

    def _announce_skip(self, number: int, why: str) -> None:
        self.print(f"skipping iteration {number} ({why})")
        self.event(EventKind.SKIPPED, why, iteration=number)

    def refuse_without_step(self) -> None:
        """Settings that only the guarded step can honour, refused in one line without it (a
        framework's own step: call it at start; a loop's first iteration without a step)."""
        self.config.refuse_without_step(self.names, skips=bool(self.iterations.skip))

    def record(
        self,
        result: StepResult | None = None,
        *,
        batch_size: int,
        losses: Mapping[str, TensorOrScalar] | None = None,
        consumed_samples: int | None = None,
        **values: Any,
    ) -> Mapping[str, Any] | None:
        """The iteration just completed into the log line, the sinks and the metrics file
        (collective at log steps); its ``batch_size`` samples are consumed (or
        ``consumed_samples`` in all). ``result``: the guarded step's (its losses, gradient
        norm, zeros, skip; nothing is logged for a rejected one); ``values``: the rest of
        ``TrainingLog.on_iteration``'s (``learning_rate``, ``grad_norm``, ``loss_scale``, ...).
        Returns the log step's metrics record on rank 0 (host values: what a framework's own
        loggers are offered), None on other iterations and ranks."""
        return self._records.record(
            self.completed,
            self.state,
            self._model,
            result,
            batch_size=batch_size,
            losses=losses,
            consumed_samples=consumed_samples,
            values=values,
        )

    @contextlib.contextmanager
    def evaluation(self) -> Iterator[None]:
        """Around an evaluation: goodput's evaluation bucket (its compiles booked as compile
        time) and the watchdog's evaluation. The next :meth:`decide` agrees on the exit inputs
        again (a signal received during the evaluation ends the run at this iteration)."""
        with self._scope.evaluation():
            yield
        self.exits.evaluated = True  # the next decide agrees on the exit inputs again

    @contextlib.contextmanager
    def eval_iteration(self) -> Iterator[None]:
        """One evaluation iteration: the watchdog's section, then the memory release."""
        with self._scope.eval_iteration():
            yield

    def record_eval(self, losses: Mapping[str, TensorOrScalar], *, suffix: str = "") -> None:
        """An evaluation's mean losses after the completed iterations: Megatron's validation
        lines, the sinks' ``<key> validation`` (and perplexity,
        ``log_validation_ppl_to_tensorboard``)."""
        self.log.on_eval(
            self.completed, losses, consumed_samples=self.state.consumed_samples, suffix=suffix
        )

    # ------------------------------------------------------------------------ the decision
    def decide(
        self,
        result: StepResult | None = None,
        *,
        finished: bool | None = None,
        can_save: bool | None = None,
    ) -> ExitDecision:
        """The one save/exit decision after the iteration just run (:meth:`ExitPath.decide`)."""
        return self.exits.decide(result, finished=finished, can_save=can_save)

    def act(self, decision: ExitDecision, checkpointer: Checkpointer) -> int | None:
        """Do what ``decision`` says with ``checkpointer``: save (persistent or not, as
        decided) inside :meth:`saving`, then, on an exit, :meth:`finish`. Returns the exit code
        on an exit (0, 16, 17 or 130: raise ``SystemExit`` with it), None to go on. A spike
        rewind restores ``checkpointer``'s newest snapshot (:meth:`rewind`)."""
        if decision.rewind is not None:
            self.rewind(decision.rewind, checkpointer)
            return None
        if decision.save is not SaveKind.NONE:
            non_persistent = decision.save is SaveKind.NON_PERSISTENT
            with self.saving(non_persistent=non_persistent, async_save=checkpointer.async_save):
                checkpointer.save(self.completed, non_persistent=non_persistent)
        return self.finish(decision, checkpointer) if decision.exit else None

    def rewind(self, request: SpikeRewind, checkpointer: Checkpointer | None) -> RewindRecord:
        """The spike rewind a decision asked for (``ExitDecision.rewind``; :meth:`act` does it):
        ``checkpointer``'s newest snapshot restored (collective), the window from the
        spike skipped and recorded in the tracker file (:class:`stalwart.loop.rewind.Rewinder`).
        A loop that keeps its own state beyond the checkpointer's parts restores it after."""
        return self.rewinder.rewind(self, request, checkpointer)

    def saving(self, **options: Any) -> contextlib.AbstractContextManager[None]:
        """Around a save of the completed iterations (:meth:`ExitPath.saving`: its options)."""
        return self.exits.saving(**options)

    def maybe_finalize(self, checkpointer: Any) -> None:
        """Complete a pending async save that finished in the background (its section)."""
        self.exits.maybe_finalize(checkpointer)

    def finish(
        self, decision: ExitDecision, checkpointer: Any = None, *, async_save: bool | None = None
    ) -> int:
        """The one exit path (:meth:`ExitPath.finish`); returns the exit code."""
        return self.exits.finish(decision, checkpointer, async_save=async_save)

    def checkpoint_at(self, iteration: int, name: str) -> None:
        """A framework saved or loaded checkpoint ``name`` (its name in ``save_dir``) holding
        ``iteration`` completed iterations: the one a rerun verdict names to train on from."""
        self.exits.checkpoint_at(iteration, name)

    @property
    def exit_code(self) -> int | None:
        """The code :meth:`finish` returned (None before)."""
        return self.exits.code

    def event(self, kind: EventKind, detail: str, *, iteration: int | None = None) -> None:
        """Append to the run's event timeline at ``iteration`` (default: the completed ones;
        rank 0; nothing without a run directory)."""
        if self.config.artefact_dir and self.rank == 0:
            at = self.completed if iteration is None else iteration
            append_event(self.config.artefact_dir, at, kind, detail)

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
        if exc is not None and not isinstance(exc, SystemExit) and self.exits.code is None:
            if isinstance(exc, ValueError) and not self._began:
                self.refused()  # bad input found after start-up: no goodput session
            else:
                self.fault(exc)
        self.close()


__all__ = ["Shell", "params_norm"]
