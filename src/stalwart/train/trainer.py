"""The training loop: a short composition of the components built in ``components.py``.

Per iteration: finalize a pending async save, (maybe) inject a fault, run the rerun-guarded step
inside the hang watchdog's ``step`` section, log, evaluate, then one agreed save/exit decision.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from stalwart.config.run import RunConfig
from stalwart.data import make_eval_iterator
from stalwart.distributed import collectives
from stalwart.distributed.process_group import DistributedContext
from stalwart.observability.progress_log import make_progress_log
from stalwart.observability.report import EventKind, append_event
from stalwart.observability.timers import INTERVAL_TIME
from stalwart.reliability.exit import (
    ExitDecision,
    ExitReason,
    SaveKind,
    decide,
    exit_message,
    gather_exit_inputs,
    write_exit_reason,
)
from stalwart.reliability.rerun import (
    EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
    capture_rng_state,
    restore_rng_state,
)
from stalwart.reliability.rerun.verdict_file import apply_verdict, record_verdict
from stalwart.reliability.sections import Section
from stalwart.train.components import Components, build_components, run_dir_of
from stalwart.train.evaluate import evaluate
from stalwart.train.graphed import check_eval_losses
from stalwart.train.resume_checks import check_model_matches, nothing_left_to_train
from stalwart.train.step import StepResult, params_norm, train_step

logger = logging.getLogger("stalwart.train")


class Phase(enum.Enum):
    """What the loop does with the iteration it is about to run."""

    TRAIN = "train"
    SKIP = "skip"  # --iterations-to-skip: consume the data, do not train


@dataclass
class TrainOutcome:
    """How ``train()`` ended: the process exit code and why."""

    exit_code: int
    reason: ExitReason
    iteration: int
    detail: str = ""


@dataclass
class TrainState:
    """Progress counters; ``iteration`` counts completed iterations (0-based index of the next)."""

    iteration: int = 0
    consumed_samples: int = 0


class Trainer:
    """Owns every component of a run; ``train()`` runs to an agreed exit.

    Usage::

        ctx = init_distributed()
        with Trainer(config, ctx) as trainer:
            outcome = trainer.train()
        sys.exit(outcome.exit_code)
    """

    def __init__(self, config: RunConfig, ctx: DistributedContext, print_fn: Any = print) -> None:
        self.config = config
        self.ctx = ctx
        self.print = print_fn if ctx.is_main else (lambda *a, **k: None)
        self.started = time.monotonic()
        self.run_dir = run_dir_of(config)
        self.c: Components = build_components(config, ctx)
        self.config = self.c.config  # resolved (e.g. --train-samples -> iterations)
        self.state = TrainState()
        self.loaded_iteration: int | None = None
        self.loaded_path: str | None = None
        self.batch_size = self.c.global_batch_size  # this iteration's (see _start_batch)
        self._num_microbatches: int | None = None
        self._saved_at: int | None = None
        self.progress = make_progress_log(
            config.obs.log_progress, config.checkpoint.save, ctx.world_size, ctx.rank
        )

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is not None:
            # A failing rank must not enter a collective its peers never reach (they may wait in a
            # step collective): drop an in-flight async save instead of finalizing it. The previous
            # complete checkpoint stays the resume point.
            self.c.checkpoint.close(abort=True)
        self.close()

    def close(self) -> None:
        self.c.close()

    def release_graphs(self) -> None:
        """Drop the CUDA graphs now (idempotent; safe from the restart monitor's thread).

        Graphs that captured NCCL collectives keep the communicator referenced, so an in-process
        restart calls this before aborting the process groups; the main thread's next graph call
        then fails on the torn-down context, which ends the attempt.
        """
        if self.c.release_graphs is not None:
            self.c.release_graphs()

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint_common(self) -> dict[str, Any]:
        c = self.c
        return {
            "iteration": self.state.iteration,
            "consumed_samples": self.state.consumed_samples,
            # The sampler may be ahead (a rerun exit saves before the failed iteration): the data
            # position is the one of the completed iterations.
            "data": {**c.sampler.state_dict(), "consumed_samples": self.state.consumed_samples},
            "scheduler": c.scheduler.state_dict(),
            "loss_scaler": c.loss_scaler.state_dict(),
            "config": self.config.to_dict(),
        }

    def _checkpoint_per_rank(self) -> dict[str, Any]:
        return {"rng": capture_rng_state(), "rerun": self.c.rerun.state_dict()}

    def save(self, non_persistent: bool = False) -> None:
        """Save the current state (collective) inside the ``checkpointing`` section."""
        c = self.c
        self._saved_at = self.state.iteration
        c.energy.pause()  # a save is not training energy
        with c.sections.section(Section.CHECKPOINTING):
            c.faults.maybe_inject(self.state.iteration, self.ctx.rank, "checkpointing")
            common, per_rank = self._checkpoint_common(), self._checkpoint_per_rank()
            c.checkpoint.save(
                self.state.iteration,
                c.model,
                c.optimizer,
                common,
                per_rank,
                non_persistent=non_persistent,
            )
        c.energy.resume()
        if not non_persistent:  # --log-progress: Megatron's progress.txt line
            self.progress.on_save(
                self.state.iteration, self._flops_so_far(), self._tokens_so_far(),
                async_save=self.config.checkpoint.async_save,
            )  # fmt: skip
        c.sections.maybe_update_timeouts(async_save=self.config.checkpoint.async_save)
        kind = "non-persistent checkpoint" if non_persistent else "checkpoint"
        self.event(EventKind.CHECKPOINT, f"saved {kind}")

    def event(self, kind: EventKind, detail: str) -> None:
        """Append to the run's event timeline (rank 0; nothing without a run directory)."""
        if self.run_dir and self.ctx.is_main:
            append_event(self.run_dir, self.state.iteration, kind, detail)

    def load(self) -> None:
        """Resume from the newest complete checkpoint, if any (``--load`` defaults to ``--save``)."""
        cfg, c = self.config.checkpoint, self.c
        if cfg.load_dir is None:
            return
        load_optim = not (cfg.no_load_optim or cfg.finetune)
        current = self.config.to_dict()["model"]
        loaded = c.checkpoint.load(
            c.model,
            c.optimizer,
            load_optim=load_optim,
            check_common=lambda common: check_model_matches(common, current, logger.warning),
        )
        if loaded is None:
            return
        c.sections.on_checkpoint_loaded(persistent=not loaded.non_persistent)
        if cfg.finetune:
            self.print(f"finetuning from {loaded.path}: weights loaded, starting at iteration 0")
            return
        common = loaded.common
        self.state = TrainState(common["iteration"], common["consumed_samples"])
        self.loaded_iteration, self.loaded_path = loaded.iteration, loaded.path
        c.sampler.load_state_dict(common["data"])
        c.loss_scaler.load_state_dict(common.get("loss_scaler", {}))
        self._resume_schedule(common.get("scheduler"), load_optim)
        per_rank = loaded.per_rank
        if per_rank is None:
            logger.warning("world size changed: RNG and rerun state not restored for this rank")
        else:
            if not cfg.no_load_rng:
                restore_rng_state(per_rank["rng"])
            c.rerun.load_state_dict(per_rank["rerun"])
        apply_verdict(c.rerun, loaded.path)  # a settled rerun: train on, or refuse the bad device
        self.print(f"resumed from {loaded.path} at iteration {self.state.iteration}")

    def _resume_schedule(self, saved: Any, load_optim: bool) -> None:
        """Megatron's rule for a changed LR schedule (``ValueError`` unless a flag says which
        wins; one warning line otherwise). A checkpoint with nothing left to train is not
        checked: it ends at once (`nothing_left_to_train`)."""
        it, consumed = self.state.iteration, self.state.consumed_samples
        if it >= self.config.training.train_iters:
            return
        samples_after = consumed + self.c.batch_schedule.global_batch_size_at(consumed)
        note = self.c.scheduler.resume_from(saved, it, samples_after, load_optim=load_optim)
        if note and self.ctx.is_main:
            logger.warning(note)

    def _flops_so_far(self) -> float:
        """Floating-point operations of every iteration so far (linear in the samples)."""
        c = self.c
        return c.flops_per_iteration * self.state.consumed_samples / c.global_batch_size

    def _tokens_so_far(self) -> float:
        return float(self.state.consumed_samples * self.config.model.seq_length)

    # ------------------------------------------------------------------ the loop
    def train(self) -> TrainOutcome:
        """Train until an exit decision; returns the outcome (exit code 0, 16 or 17)."""
        c, cfg = self.c, self.config
        self.load()
        self.progress.start(self._flops_so_far())
        done = nothing_left_to_train(self.loaded_path, self.state.iteration, cfg.training)
        c.timers(INTERVAL_TIME).start(barrier=True)
        decision = ExitDecision()
        outcome: TrainOutcome | None = None
        while outcome is None:
            if self.state.iteration >= cfg.training.train_iters:
                detail = done or "reached --train-iters"
                decision = ExitDecision(SaveKind.NONE, True, ExitReason.FINISHED, detail)
                break
            with c.sections.section(Section.CHECKPOINTING, is_async_finalization=True):
                c.checkpoint.maybe_finalize()
            self._start_batch()
            result = self._run_iteration()
            if result.should_exit:
                outcome = self._rerun_exit(result)
                break
            self._after_iteration(result)
            decision = self._decide()
            outcome = self._maybe_check_replicas(before_save=decision.save is not SaveKind.NONE)
            if outcome is not None:
                break
            if decision.save is not SaveKind.NONE:
                self.save(non_persistent=decision.save is SaveKind.NON_PERSISTENT)
            if decision.exit:
                break
        return outcome or self._finish(decision)

    def _start_batch(self) -> None:
        """This iteration's global batch size (``--rampup-batch-size``: a function of the consumed
        samples). As Megatron, a checkpoint is saved when the micro-batch count steps up."""
        c, schedule = self.c, self.c.batch_schedule
        self.batch_size = schedule.global_batch_size_at(self.state.consumed_samples)
        num_microbatches = schedule.num_microbatches_at(self.state.consumed_samples)
        if self._num_microbatches not in (None, num_microbatches):
            self.print(
                f"batch size ramp: {self.batch_size} from iteration {self.state.iteration + 1}"
            )
            if self.config.checkpoint.save and self._saved_at != self.state.iteration:
                self.save()
        self._num_microbatches = c.step_parts.num_microbatches = num_microbatches
        # Throughput counts this iteration's samples (the estimate is linear in the batch size).
        c.log.flops_per_iteration = c.flops_per_iteration * self.batch_size / c.global_batch_size

    def _run_iteration(self) -> StepResult:
        c, it = self.c, self.state.iteration
        c.scheduler.set_iteration(it, samples_after=self.state.consumed_samples + self.batch_size)
        c.rerun.set_iteration(it)
        c.profiler.on_iteration_start(it)
        with c.sections.step_section():
            c.faults.maybe_inject(it + 1, self.ctx.rank, "step")
            if it + 1 in c.iterations_to_skip:  # numbered like the log line
                return self._skip_iteration()
            c.observer.begin_iteration(it + 1)
            c.step_parts.speculate = self._speculation_for_next()
            result = train_step(c.step_parts, c.train_iterator)
            c.memory_release.after_optimizer_step()
            c.observer.end_iteration()
            return result

    def _speculation_for_next(self) -> Callable[[dict[str, Any]], None] | None:
        """Graph mode: launch the next iteration ahead of this one's validation read when it is a
        plain training iteration (not past the end, not skipped, same micro-batch count) and no
        error is injected (the injection mask is set per pass, when the machine begins it)."""
        c, cfg = self.c, self.config
        speculation, upcoming = c.speculation, self.state.iteration + 1
        if (
            speculation is None
            or c.rerun.injector.enabled
            or upcoming >= cfg.training.train_iters
            or upcoming + 1 in c.iterations_to_skip  # numbered like the log line
        ):
            return None
        consumed = self.state.consumed_samples + self.batch_size
        num_microbatches = c.batch_schedule.num_microbatches_at(consumed)
        if num_microbatches != c.step_parts.num_microbatches:
            return None

        def launch(call_kwargs: dict[str, Any]) -> None:
            speculation.launch_next(call_kwargs, num_microbatches)

        return launch

    def _skip_iteration(self) -> StepResult:
        """``--iterations-to-skip``: consume this iteration's data without training on it."""
        it = self.state.iteration
        self.c.rerun.skip_iteration(it)  # drops a pending rerun of this iteration
        for _ in range(self.c.step_parts.num_microbatches):
            next(self.c.sampler)
        self.print(f"skipping iteration {it + 1} (--iterations-to-skip)")
        self.event(EventKind.SKIPPED, "--iterations-to-skip")
        return StepResult(skipped=True)

    def _after_iteration(self, result: StepResult) -> None:
        c, cfg = self.c, self.config
        self.state.iteration += 1
        self.state.consumed_samples += self.batch_size
        c.profiler.on_iteration_end(self.state.iteration)
        c.manual_gc.on_iteration_end(self.state.iteration)
        it = self.state.iteration
        is_log = it % cfg.log.log_interval == 0 or it == 1
        norm = (
            params_norm(list(c.model.parameters())) if cfg.log.log_params_norm and is_log else None
        )
        c.log.on_iteration(
            it,
            losses=result.losses or {"lm loss": torch.tensor(float("nan"))},
            learning_rate=c.scheduler.last_lr,
            global_batch_size=self.batch_size,
            consumed_samples=self.state.consumed_samples,
            grad_norm=result.grad_norm,
            skipped=result.skipped,
            loss_scale=c.loss_scaler.scale if cfg.training.fp16 else None,
            num_zeros=result.num_zeros,
            params_norm=norm,
        )
        if cfg.training.eval_interval and it % cfg.training.eval_interval == 0:
            self.run_evaluation()

    def run_evaluation(self) -> dict[str, float]:
        """Evaluate on the held-out split with validation checks disabled."""
        c, cfg = self.c, self.config
        c.manual_gc.on_evaluation()
        c.sections.start_evaluation()
        data = make_eval_iterator(
            c.valid_dataset, cfg.training.micro_batch_size, self.ctx.rank, self.ctx.world_size
        )
        losses = evaluate(
            model=c.model,
            forward_step_func=c.eval_forward_step,
            data_iterator=data,
            num_microbatches=c.num_microbatches,
            eval_iters=cfg.training.eval_iters,
            disable_validation=c.rerun.disabled,
            step_section=lambda: _then_release(
                c.sections.step_section(is_eval=True), c.memory_release.after_eval_step
            ),
            forward_backward_func=c.eval_forward_backward_func,
        )
        if c.eval_checks_losses_on_host:
            check_eval_losses(c.rerun, losses, cfg.rerun)
        c.log.on_eval(self.state.iteration, losses, consumed_samples=self.state.consumed_samples)
        c.manual_gc.on_evaluation()
        return losses

    def _decide(self) -> ExitDecision:
        cfg = self.config
        elapsed_min = (time.monotonic() - self.started) / 60.0
        inputs = gather_exit_inputs(cfg.exit, self.c.signal_handler, elapsed_min)
        return decide(
            self.state.iteration,
            inputs,
            cfg.exit,
            can_save=cfg.checkpoint.save is not None,
            finished=self.state.iteration >= cfg.training.train_iters,
        )

    def _rerun_exit(self, result: StepResult) -> TrainOutcome:
        """The rerun state machine asked to exit (16: resume elsewhere, 17: validation failed)."""
        if result.should_checkpoint and self.config.checkpoint.save:
            self.save()
        elif result.should_checkpoint:
            logger.warning("rerun needs a checkpoint to resume from but --save is not set")
        if self.loaded_path is not None:  # the diagnosis of a rerun from that checkpoint
            record_verdict(self.c.rerun, self.loaded_path, write=self.ctx.is_main)
        detail = f"rerun state machine exit code {result.exit_code}"
        self.event(EventKind.RERUN, detail)
        self._record_exit(ExitReason.RERUN, detail, result.exit_code)
        # A non-zero exit makes torchrun kill the other ranks: leave together, after rank 0 wrote.
        collectives.barrier()
        return TrainOutcome(result.exit_code, ExitReason.RERUN, self.state.iteration, detail)

    def _maybe_check_replicas(self, before_save: bool) -> TrainOutcome | None:
        """``--check-weight-hash-across-dp-replicas-interval``: compare the replicas' weights at
        its iterations and before every save (never write a checkpoint from diverged replicas).
        Every rank reaches the same answer; a mismatch exits 17 without saving, so the launcher
        resumes from the last checkpoint, which passed this check when it was written."""
        checker, it = self.c.replica_checker, self.state.iteration
        if not (checker.should_check(it) or (before_save and checker.enabled)):
            return None
        result = checker.check(self.c.raw_model)
        if result.consistent:
            return None
        detail = f"iteration {it}: {result.describe()}"
        logger.error("%s; exiting without a checkpoint", detail)
        self.event(EventKind.EXIT, detail)
        self._record_exit(
            ExitReason.REPLICA_MISMATCH, detail, EXIT_CODE_FAILED_ON_RESULT_VALIDATION
        )
        collectives.barrier()  # leave together, after rank 0 wrote the exit reason
        return TrainOutcome(
            EXIT_CODE_FAILED_ON_RESULT_VALIDATION, ExitReason.REPLICA_MISMATCH, it, detail
        )

    def _finish(self, decision: ExitDecision) -> TrainOutcome:
        reason = decision.reason or ExitReason.FINISHED
        self._record_exit(reason, decision.detail, decision.exit_code)
        self.print(exit_message(decision, self.state.iteration))
        return TrainOutcome(decision.exit_code, reason, self.state.iteration, decision.detail)

    def _record_exit(self, reason: ExitReason, detail: str, exit_code: int) -> None:
        c = self.c
        if c.speculation is not None:
            logger.info(
                "speculative graph launches: %d used of %d",
                c.speculation.num_used,
                c.speculation.num_launched,
            )
        with c.sections.section(Section.CHECKPOINTING, is_async_finalization=True):
            c.checkpoint.finalize()  # an exit always completes the pending async save first
        c.sections.maybe_update_timeouts(closing=True, async_save=self.config.checkpoint.async_save)
        self.event(EventKind.EXIT, f"{reason.value}: {detail} (exit code {exit_code})")
        save_dir = self.config.checkpoint.save
        if save_dir and self.ctx.is_main:
            write_exit_reason(save_dir, reason, self.state.iteration, detail, exit_code=exit_code)


@contextlib.contextmanager
def _then_release(section: Any, release: Callable[[], None]) -> Iterator[None]:
    """An eval step's watchdog section, then ``--empty-unused-memory-level``'s release."""
    with section:
        yield
    release()


def run_training(config: RunConfig, ctx: DistributedContext) -> TrainOutcome:
    """Build a trainer, train, release everything; the one-call entry used by the CLI."""
    with Trainer(config, ctx) as trainer:
        return trainer.train()
