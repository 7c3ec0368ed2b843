"""The end of the shell's iterations: the one agreed save/exit decision, what a save does
around the loop's (or the framework's) checkpoint, and what an exit records before the process
ends. It owns the exit code and the framework checkpoints' names (a rerun verdict names the one
to train on from).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from stalwart.loop.step import StepResult
from stalwart.observability.run_dir import EventKind
from stalwart.reliability.exit import (
    ExitDecision,
    ExitReason,
    SaveKind,
    decide,
    exit_inputs,
    leave,
    replica_exit,
)
from stalwart.reliability.hang.sections import Section
from stalwart.reliability.rerun import RerunVerdict

if TYPE_CHECKING:
    from stalwart.loop.shell_view import ShellView

logger = logging.getLogger("stalwart.loop.shell")


class ExitPath:
    """Saves and the exit of one :class:`~stalwart.loop.Shell` (its parts: sections, save
    timing, energy, ``progress.txt``, ledger, log)."""

    def __init__(self, shell: ShellView) -> None:
        self.shell = shell
        self.code: int | None = None  # what finish() returned
        self._checkpoints: dict[int, str] = {}  # a framework's checkpoint names by iteration
        self._latest: str | None = None
        self.evaluated = False  # since the last decide: agree on the exit inputs again

    def decide(
        self,
        result: StepResult | None = None,
        *,
        finished: bool | None = None,
        can_save: bool | None = None,
    ) -> ExitDecision:
        """The one save/exit decision after the iteration just run (over the completed ones).
        ``result``: the guarded step's (its verdict and agreed inputs), else the inputs are
        agreed here; ``finished``: default, the last training iteration is done; ``can_save``:
        default, a save directory is set. The machine's replica check compares the weights
        when due (its interval, or before any save): a mismatch exits 17 without saving. Its
        reasons name the settings as the shell's path spells them."""
        shell = self.shell
        if result is not None:
            agreed, verdict = result.agreed, result.verdict
            if self.evaluated:  # a signal during the evaluation stops at this iteration
                agreed = shell.agreement.agree_again()
        else:
            shell.agreement.begin()
            agreed, verdict = shell.agreement.finish(), RerunVerdict()
        self.evaluated = False
        iteration, config, model = shell.completed, shell.config, shell.watched
        finished = shell.iterations.finished if finished is None else finished
        inputs = exit_inputs(agreed, rerun=verdict, finished=finished)
        can = config.save_dir is not None if can_save is None else can_save
        decision = decide(iteration, inputs, config.exit, can_save=can, spell=self._spell)
        replicas, saving = shell.machine.replicas, decision.save is not SaveKind.NONE
        due = replicas is not None and replicas.due(iteration, saving=saving)
        if due and not verdict.rejected and model is not None:  # a mismatch outranks the rest
            decision = replica_exit(iteration, replicas.check(model)) or decision
        log = shell.built_log
        if decision.exit and log is not None:  # agreed on every rank
            log.flush()  # the iterations since the last log line
            log.end_progress()  # save and exit lines print below the bar
        return decision

    def _spell(self, name: str) -> str:
        """An :class:`ExitConfig` field (or ``train_iters``, ``save_dir``) as the path spells it."""
        path = name if name in ("train_iters", "save_dir") else f"exit.{name}"
        return str(self.shell.names.spell(path))

    @contextlib.contextmanager
    def saving(
        self,
        *,
        non_persistent: bool = False,
        async_save: bool = False,
        flops_so_far: float | None = None,
        tokens_so_far: float | None = None,
    ) -> Iterator[None]:
        """Around a save of the completed iterations: the checkpointing section, save timing,
        goodput's checkpoint bucket, energy paused; then ``progress.txt``'s line (persistent
        saves; ``flops_so_far``/``tokens_so_far`` default to the shell's FLOPs and the consumed
        samples' tokens), new learned timeouts and the run's event."""
        shell = self.shell
        iteration = shell.completed
        shell.energy.pause()  # a save is not training energy
        with (
            shell.sections.section(Section.CHECKPOINTING),
            shell.saves.blocking(iteration, non_persistent=non_persistent, async_save=async_save),
        ):
            yield
        shell.energy.resume()
        if not non_persistent:  # progress.log_progress: Megatron's progress.txt line
            flops = flops_so_far
            if flops is None:
                flops = (shell.flops_per_iteration or 0.0) * iteration
            tokens = tokens_so_far
            if tokens is None:
                tokens = float(shell.state.consumed_samples * (shell.config.seq_length or 0))
            shell.progress.on_save(iteration, flops, tokens, async_save=async_save)
        shell.sections.maybe_update_timeouts(async_save=async_save)
        kind = "non-persistent checkpoint" if non_persistent else "checkpoint"
        shell.event(EventKind.CHECKPOINT, f"saved {kind}")

    def maybe_finalize(self, checkpointer: Any) -> None:
        """Complete a pending async save that finished in the background (its section)."""
        shell = self.shell
        with shell.sections.section(Section.CHECKPOINTING, is_async_finalization=True):
            committed = checkpointer.maybe_finalize()
        if committed is not None:
            shell.saves.finalized(committed)

    def finish(
        self, decision: ExitDecision, checkpointer: Any = None, *, async_save: bool | None = None
    ) -> int:
        """The one exit path: complete a pending save (``async_save``: default, the
        checkpointer's), learn timeouts, record why (``exit_reason.json``, the run's events),
        wait for the other ranks, close the ledger (rank 0 prints the goodput line). Returns
        the exit code; a second call the first's."""
        if self.code is not None:
            return self.code
        shell = self.shell
        iteration, reason = shell.completed, decision.reason or ExitReason.FINISHED
        if async_save is None:
            async_save = bool(getattr(checkpointer, "async_save", False))
        if shell.built_log is not None:
            shell.built_log.end_progress()
        step = shell.guarded
        if step is not None:
            logger.info("look-ahead launches: %d used of %d", step.num_used, step.num_launched)
        if checkpointer is not None:
            with (
                shell.sections.section(Section.CHECKPOINTING, is_async_finalization=True),
                shell.saves.finalizing(),
            ):
                checkpointer.finalize()  # an exit always completes the pending async save
            shell.saves.finalized_all()
        shell.sections.maybe_update_timeouts(closing=True, async_save=async_save)
        if reason is ExitReason.RERUN:  # the diagnosis goes to rerun_verdict.json in leave()
            shell.event(EventKind.RERUN, decision.detail)
        code = decision.exit_code
        shell.event(EventKind.EXIT, f"{reason.value}: {decision.detail} (exit code {code})")
        if code and reason is not ExitReason.INTERRUPT:
            # Ctrl-C is the user's own stop: its one line is leave()'s, with the code.
            logger.error("%s; exiting with code %d", decision.detail, code)
        self.code = leave(
            decision,
            iteration,
            save_dir=shell.config.save_dir,
            rank=shell.rank,
            log=shell.print,
            checkpoint=self._verdict_checkpoint(decision),
        )
        shell.ledger.close(reason.value, decision.detail)
        return self.code

    def checkpoint_at(self, iteration: int, name: str) -> None:
        """A framework's checkpoint ``name`` holds ``iteration`` completed iterations."""
        self._checkpoints[int(iteration)] = name
        self._latest = name

    def _verdict_checkpoint(self, decision: ExitDecision) -> str | None:
        diagnosis = decision.diagnosis
        if diagnosis is None:
            return None
        if diagnosis.checkpoint_iteration is None:  # "the latest checkpoint"
            return self._latest
        return self._checkpoints.get(diagnosis.checkpoint_iteration)


__all__ = ["ExitPath"]
