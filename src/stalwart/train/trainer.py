"""The reference trainer: the GPT, its data and the whole shell around one guarded step.

Per iteration (:meth:`Trainer.train`): finalize a pending async save, run the guarded step
inside the shell's iteration (the hang watchdog's ``step`` section, the skip list, the compile
booking; faults injected there), log and maybe evaluate, then one pure save/exit decision over
every exit input, acted on in one place.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from typing import Any

from stalwart.checkpoint import CheckpointError
from stalwart.checkpoint.in_memory import InMemorySnapshots
from stalwart.compile import CompileCache, NullCompileCache
from stalwart.config.run import RunConfig
from stalwart.data import make_eval_iterator
from stalwart.distributed.process_group import DistributedContext
from stalwart.loop import Checkpointer, GuardedStep, Iteration, StepResult, autocast_context
from stalwart.loop.naming import Names
from stalwart.models import num_floating_point_operations
from stalwart.observability.throughput import compute_dtype, device_peak_tflops
from stalwart.reliability.exit import ExitDecision, ExitReason, SaveKind
from stalwart.reliability.rerun import RerunDataIterator
from stalwart.train import build
from stalwart.train.forward_step import gpt_forward_step
from stalwart.train.manual_gc import make_manual_gc
from stalwart.train.resume_checks import (
    check_model_matches,
    nothing_left_to_train,
    upgrade_common_layout,
)
from stalwart.train.schedule import LRScheduler
from stalwart.train.trainer_parts import ConfigPart, TrainOutcome

logger = logging.getLogger("stalwart.train")

# Errors that refuse a launch (bad input or an unusable checkpoint, found after start-up: the
# CLI's exit 2): the goodput ledger then writes nothing of the session.
_REFUSALS = (ValueError, CheckpointError)


class Trainer:
    """Owns every part of a run; ``train()`` runs to an agreed exit.

    Usage::

        ctx = init_distributed()
        with Trainer(config, ctx) as trainer:
            outcome = trainer.train()
        sys.exit(outcome.exit_code)
    """

    def __init__(
        self,
        config: RunConfig,
        ctx: DistributedContext,
        print_fn: Any = print,
        attempt: int = 0,
        compile_cache: CompileCache | NullCompileCache | None = None,
        snapshots: InMemorySnapshots | None = None,
    ) -> None:
        """``compile_cache``: an open cache that outlives this trainer (an in-process restart's,
        owned by the restart wrapper); None: the trainer opens its own and closes it.
        ``snapshots``: the in-process restart's in-memory snapshots (``--non-persistent-ckpt-type
        in_memory``), which outlive this trainer too."""
        self.ctx = ctx
        self.print = print_fn if ctx.is_main else (lambda *a, **k: None)
        self.started = time.monotonic()
        self._exit = contextlib.ExitStack()
        self.compile_cache = compile_cache  # None: _build opens the trainer's own
        self.snapshots = snapshots
        try:
            self._build(config, ctx, attempt)
        except BaseException as exc:
            if isinstance(exc, _REFUSALS) and hasattr(self, "shell"):
                self.shell.refused()  # bad input found while building: no goodput session
            self._exit.close()
            raise

    def _build(self, config: RunConfig, ctx: DistributedContext, attempt: int) -> None:
        """One line per part: each is built from its config, nothing is changed afterwards."""
        on_close = self._exit.callback
        build.check_graph_flags(config, ctx.device, ctx.world_size)  # before any set-up
        self.faults = config.faults.build(config.checkpoint.save, ctx.world_size)
        # --save probed and locked before any work (atexit releases it if building fails). No
        # lambda over self: atexit keeps the manager, in-process restart must free the trainer.
        commit = functools.partial(self.faults.maybe_inject, rank=ctx.rank, phase="commit")
        manager = config.checkpoint.build(before_commit=commit, snapshots=self.snapshots)
        on_close(manager.close)
        self.config, self.data = build.resolve_config(config, ctx)
        config, t = self.config, self.config.training
        self.loss_scaler = build.build_loss_scaler(config)
        cache = build.open_compile_cache(config, ctx.rank, self.compile_cache, on_close)
        # The shell: ledger, watchdog, signal handler, agreement, rerun machine, probes, log,
        # the iterations (count, skip list, compile booking into this run's cache).
        self.shell = config.shell.build(
            rank=ctx.rank,
            world_size=ctx.world_size,
            device=ctx.device,
            print_fn=self.print,
            attempt=attempt,
            loss_scaler=self.loss_scaler,
            run_config=config.to_dict(),
            memory_estimate=build.memory_estimate(config, ctx),
            names=Names.CLI,
            compile_cache=cache,
        )
        on_close(self.shell.close)
        self.shell.handle_signals()  # now: a SIGTERM during set-up only raises the flag
        # A tracked complete checkpoint is loaded or the load fails (it never starts afresh), so
        # the model's random initialisation would be overwritten: it is skipped.
        resuming = config.checkpoint.load_dir is not None
        self.blank_model = resuming and manager.latest_iteration() is not None
        self.raw_model, self.model = build.build_model(config, ctx, self.faults, self.blank_model)
        self.optimizer = build.build_optimizer(self.model, config)
        self.scheduler = LRScheduler(self.optimizer, config.optim, t.train_iters, t.train_samples)
        self.sampler = build.build_sampler(config, ctx, self.data.train, self.data.num_microbatches)
        on_close(getattr(self.sampler, "close", lambda: None))
        self.train_data: RerunDataIterator[Any] = RerunDataIterator(self.sampler)
        gbs = self.data.global_batch_size
        self.flops_per_iteration = num_floating_point_operations(config.model, gbs)
        peak = device_peak_tflops(ctx.device, compute_dtype(t.bf16, t.fp16))
        self.shell.set_flops(self.flops_per_iteration, peak)
        self.manual_gc = make_manual_gc(t.manual_gc, t.manual_gc_interval, t.manual_gc_eval)
        on_close(self.manual_gc.close)
        self.step = self._build_step()
        self.state = self.shell.state  # iterations completed, samples consumed (the shell's)
        self.checkpointer = self._build_checkpointer(manager)
        self.loaded_path: str | None = None
        self.batch_size = gbs  # this iteration's (see _start_batch)
        self._num_microbatches: int | None = None
        self._saved_at: int | None = None

    @property
    def machine(self) -> Any:
        """The rerun state machine (the shell's)."""
        return self.shell.machine

    def _build_step(self) -> GuardedStep:
        config, ctx = self.config, self.ctx
        dtype = build.autocast_dtype(config)
        return self.shell.step(
            self.model,
            self.optimizer,
            gpt_forward_step,
            self.train_data,
            num_microbatches=self.data.num_microbatches,
            faults=self.faults,
            plan=config.graphs.build(),
            clip_grad=config.optim.clip_grad,
            loss_scaler=self.loss_scaler,
            autocast=lambda: autocast_context(ctx.device, dtype),
            compute_weights=build.build_compute_weights(config, self.raw_model, ctx),
            lookahead=config.graphs.cuda_graph_speculative_launch,
        )

    def _build_checkpointer(self, manager: Any) -> Checkpointer:
        current = self.config.to_dict()["model"]
        # The shell registers the step (first: it settles a launch), the count, every RNG and
        # the rerun machine; the trainer its data, schedule and config.
        return self.shell.checkpointer(
            manager,
            self.model,
            self.optimizer,
            data=self.train_data,
            common={"scheduler": self.scheduler, "config": ConfigPart(self.config)},
            check_common=lambda common: check_model_matches(common, current, logger.warning),
            upgrade_common=upgrade_common_layout,
        )

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is not None:
            # A failing rank must not enter a collective its peers never reach (they may wait in a
            # step collective): drop an in-flight async save instead of finalizing it. The previous
            # complete checkpoint stays the resume point.
            self.checkpointer.close(abort=True)
            if isinstance(exc, _REFUSALS):  # a refused launch (exit 2): no goodput session
                self.shell.refused()
            else:
                self.shell.fault(exc)
        self.close()

    def close(self) -> None:
        """Release processes, files, graphs and handlers (safe to call twice)."""
        self._exit.close()

    # ------------------------------------------------------------------ the loop
    def train(self) -> TrainOutcome:
        """Train until an exit decision; returns the outcome (exit code 0, 16 or 17)."""
        self.load()
        t = self.config.training
        done = self.state.iteration >= t.train_iters
        # The run's settings for the report: only when training starts.
        manifest = None if done else self.config.manifest()
        self.shell.start(flops_so_far=self._flops_so_far(), manifest=manifest)
        if done:
            done_detail = nothing_left_to_train(self.loaded_path, self.state.iteration, t)
            return self._finish(
                ExitDecision(
                    SaveKind.NONE, True, ExitReason.FINISHED, done_detail or "reached --train-iters"
                )
            )
        while True:
            self.shell.maybe_finalize(self.checkpointer)
            result = self._run_iteration()
            if not result.verdict.rejected:  # a rejected iteration is not done: nothing to log
                self._after_iteration(result)
            decision = self.shell.decide(result)
            if decision.rewind is not None:  # a spike: back to the newest snapshot
                self.shell.rewind(decision.rewind, self.checkpointer)
                continue
            if decision.save is not SaveKind.NONE:
                self.save(non_persistent=decision.save is SaveKind.NON_PERSISTENT)
            if decision.exit:
                return self._finish(decision)

    def _run_iteration(self) -> StepResult:
        n = self._start_batch()
        self.scheduler.set_iteration(
            self.state.iteration, samples_after=self.state.consumed_samples + self.batch_size
        )
        with self.shell.iteration() as it:  # a skipped one: the step consumes its data
            self.faults.maybe_inject(it.number, self.ctx.rank, "step")
            return self.step.run(it, num_microbatches=n, launch_next=self._plain_next(it, n))

    def _plain_next(self, it: Iteration, num_microbatches: int) -> bool:
        """Whether the next iteration may be launched ahead: it exists and is not skipped (the
        shell's ``launch_next``), has the same micro-batch count and no evaluation runs before
        it."""
        eval_interval = self.config.training.eval_interval
        consumed = self.state.consumed_samples + self.batch_size
        return (
            it.launch_next
            and not (eval_interval and it.number % eval_interval == 0)
            and self.data.schedule.num_microbatches_at(consumed) == num_microbatches
        )

    def _start_batch(self) -> int:
        """This iteration's global batch size and micro-batch count (``--rampup-batch-size``: a
        function of the consumed samples). As Megatron, a checkpoint is saved when the
        micro-batch count steps up."""
        schedule = self.data.schedule
        self.batch_size = schedule.global_batch_size_at(self.state.consumed_samples)
        num_microbatches = schedule.num_microbatches_at(self.state.consumed_samples)
        if self._num_microbatches not in (None, num_microbatches):
            self.print(
                f"batch size ramp: {self.batch_size} from iteration {self.state.iteration + 1}"
            )
            if self.config.checkpoint.save and self._saved_at != self.state.iteration:
                self.save()
        self._num_microbatches = num_microbatches
        # Throughput counts this iteration's samples (the estimate is linear in the batch size).
        gbs = self.data.global_batch_size
        self.shell.log.flops_per_iteration = self.flops_per_iteration * self.batch_size / gbs
        return num_microbatches

    def _after_iteration(self, result: StepResult) -> None:
        """Log the completed iteration (the shell counted it), evaluate when due."""
        cfg = self.config
        it = self.state.iteration
        self.manual_gc.on_iteration_end(it)
        self.shell.record(
            result,
            batch_size=self.batch_size,  # losses empty: an iteration skipped
            learning_rate=self.scheduler.last_lr * self.shell.rewinder.policy.scale_at(it),
            loss_scale=self.loss_scaler.scale if cfg.training.fp16 else None,
        )
        if cfg.training.eval_interval and it % cfg.training.eval_interval == 0:
            self.run_evaluation()

    def run_evaluation(self) -> dict[str, float]:
        """Evaluate on the held-out split with validation checks in disabled mode (the shell's
        evaluation: its goodput bucket, watchdog and compile booking)."""
        with self.shell.evaluation():
            return self._evaluate()

    def _evaluate(self) -> dict[str, float]:
        cfg = self.config
        self.manual_gc.on_evaluation()
        self.faults.maybe_inject(
            self.state.iteration, self.ctx.rank, "eval"
        )  # --inject-fault-phase eval
        data = make_eval_iterator(
            self.data.valid, cfg.training.micro_batch_size, self.ctx.rank, self.ctx.world_size
        )
        losses = self.step.evaluate(
            data,
            cfg.training.eval_iters,
            num_microbatches=self.data.num_microbatches,
            each_iteration=self.shell.eval_iteration,
        )
        self.shell.record_eval(losses)
        self.manual_gc.on_evaluation()
        return losses

    def _finish(self, decision: ExitDecision) -> TrainOutcome:
        """The one exit path (the shell's): complete a pending save, record why, leave."""
        it, reason = self.state.iteration, decision.reason or ExitReason.FINISHED
        code = self.shell.finish(decision, self.checkpointer)
        return TrainOutcome(code, reason, it, decision.detail)

    # ------------------------------------------------------------------ checkpoints
    def save(self, non_persistent: bool = False) -> None:
        """Save every registered part (collective) inside the shell's ``saving``."""
        it = self._saved_at = self.state.iteration
        with self.shell.saving(
            non_persistent=non_persistent,
            async_save=self.config.checkpoint.async_save,
            flops_so_far=self._flops_so_far(),
            tokens_so_far=self._tokens_so_far(),
        ):
            self.faults.maybe_inject(it, self.ctx.rank, "checkpointing")
            self.checkpointer.save(it, non_persistent=non_persistent)

    def load(self) -> None:
        """Resume from the newest complete checkpoint, if any (``--load`` defaults to
        ``--save``)."""
        cfg = self.config.checkpoint
        if cfg.load_dir is None:
            return
        everything = frozenset(self.checkpointer.common) | frozenset(self.checkpointer.per_rank)
        skip = everything if cfg.finetune else frozenset({"rng"} if cfg.no_load_rng else ())
        loaded = self.checkpointer.load(
            load_optim=not (cfg.no_load_optim or cfg.finetune), skip=skip
        )
        if loaded is None:
            if self.blank_model:  # the checkpoint seen at build time is gone: no weights
                raise CheckpointError(f"--load {cfg.load_dir}: its checkpoint went away at start")
            return
        if cfg.finetune:
            self.shell.sections.on_checkpoint_loaded(persistent=not loaded.non_persistent)
            self.print(f"finetuning from {loaded.path}: weights loaded, starting at iteration 0")
            return
        # The machine's after_load applied rerun_verdict.json: a settled rerun trains on, a
        # suspect device was refused (SuspectDeviceError).
        self.loaded_path = loaded.path
        self._resume_schedule(loaded.common.get("scheduler"), not cfg.no_load_optim)
        self.shell.resumed(self.state.iteration, persistent=not loaded.non_persistent)
        self.print(
            f"resumed from {loaded.source or loaded.path} at iteration {self.state.iteration}"
        )

    def _resume_schedule(self, saved: Any, load_optim: bool) -> None:
        """Megatron's rule for a changed LR schedule (``ValueError`` unless a flag says which
        wins; one warning line otherwise). A checkpoint with nothing left to train is not
        checked: it ends at once (`nothing_left_to_train`)."""
        it, consumed = self.state.iteration, self.state.consumed_samples
        if it >= self.config.training.train_iters:
            return
        samples_after = consumed + self.data.schedule.global_batch_size_at(consumed)
        note = self.scheduler.resume_from(saved, it, samples_after, load_optim=load_optim)
        if note and self.ctx.is_main:
            logger.warning(note)

    def _flops_so_far(self) -> float:
        """Floating-point operations of every iteration so far (linear in the samples)."""
        gbs = self.data.global_batch_size
        return self.flops_per_iteration * self.state.consumed_samples / gbs

    def _tokens_so_far(self) -> float:
        return float(self.state.consumed_samples * self.config.model.seq_length)


def run_training(config: RunConfig, ctx: DistributedContext) -> TrainOutcome:
    """Build a trainer, train, release everything; the one-call entry used by the CLI."""
    with Trainer(config, ctx) as trainer:
        return trainer.train()
