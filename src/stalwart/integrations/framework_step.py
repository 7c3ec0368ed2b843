"""The guarded step inside a framework's step: the framework brings each iteration's
micro-batches, stalwart runs forward, backward, the checks, a replay and the optimizer step.

A framework owns its data loader and checkpoints; the rerun state machine needs to own
forward-backward (it replays the iteration on the same micro-batches and RNG) and the
optimizer step (a rejected iteration must never touch the weights). :class:`FrameworkStep`
feeds the batches the framework hands over into a :class:`stalwart.loop.GuardedStep` (no
look-ahead: the next batch is not known before the framework's next call) for the shell's
current iteration (a skipped one consumes its batch without training), and keeps the state the
framework's checkpoint has to carry (:meth:`state_dict`): the completed count, every RNG and
the rerun machine.

After a rejected iteration (exit 16 or 17) the adapters save the framework's state as it was
at that iteration's start (its data position, its step count, its schedule), so a relaunch is
handed the rejected iteration's batch again: rerun from the checkpoint (exit 16's protocol) or,
once a verdict settled it, trained on, bitwise as the run without the fault.

Usage (what the Lightning and Hugging Face adapters do)::

    fstep = FrameworkStep(shell, model=model, optimizer=optimizer, forward_step=fwd)
    with shell.iteration():
        result = fstep.run([batch])             # one iteration of one (or more) micro-batches
    decision = shell.decide(result)
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from stalwart.loop import Names, RngState, ShellConfig, StepResult
from stalwart.loop.microbatches import ForwardStep, as_output
from stalwart.observability.train_log import MAIN_LOSS_KEY
from stalwart.reliability.rerun import RerunDataIterator
from stalwart.reliability.rerun.attribution.verdict_file import apply_verdict

logger = logging.getLogger(__name__)


class _Feed:
    """An endless iterator over the batches the framework handed over for this call."""

    def __init__(self) -> None:
        self.queue: deque[Any] = deque()

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        if not self.queue:
            raise RuntimeError(
                "FrameworkStep: the step read more micro-batches than the framework handed over"
            )
        return self.queue.popleft()


class FrameworkStep:
    """A :class:`GuardedStep` fed by a framework (see the module docstring).

    Args:
        shell: the :class:`stalwart.loop.Shell`, which builds the guarded step (its machine,
            agreement, timers, observer and goodput ledger) and counts the iterations.
        model / optimizer / forward_step: as for :class:`GuardedStep`; ``forward_step(batch,
            model)`` returns the loss or a dict with ``"loss"``.
        clip_grad: global gradient-norm clip (0: none).
        backward: the framework's backward (Lightning's ``manual_backward``), if any.
    """

    def __init__(
        self,
        shell: Any,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        forward_step: ForwardStep,
        clip_grad: float = 0.0,
        backward: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        self.shell = shell
        self.machine = shell.machine
        self._feed = _Feed()
        self.data: RerunDataIterator[Any] = RerunDataIterator(self._feed)
        self.step = shell.step(
            model,
            optimizer,
            reporting_loss(forward_step),
            self.data,
            clip_grad=clip_grad,
            lookahead=False,
            backward=backward,
        )
        self.rng = RngState(self.machine.rng)
        self.skipped = False  # the last run() was a skipped iteration (the skip list)
        self.result: StepResult | None = None  # the last run()'s

    @property
    def iteration(self) -> int:
        """Iterations completed (the shell's count)."""
        return int(self.shell.completed)

    def run(self, batches: list[Any]) -> StepResult:
        """The shell's current iteration on ``batches`` (its micro-batches; a skipped one
        consumes them). The result's verdict says whether to exit (16/17)."""
        if not batches:
            raise ValueError("FrameworkStep.run: an iteration needs at least one micro-batch")
        it = self.shell.current
        if it is None:
            raise RuntimeError("FrameworkStep.run: call it inside shell.iteration()")
        self.skipped = it.skipped
        self._feed.queue.extend(batches)
        try:
            self.result = self.step.run(it, num_microbatches=len(batches), launch_next=False)
        finally:
            self._feed.queue.clear()
        return self.result

    # --------------------------------------------------------------------------- Stateful
    def state_dict(self) -> dict[str, Any]:
        """JSON-friendly values and tensors (loadable with ``torch.load(weights_only=True)``).
        Collective (the rerun machine's state): call it on every rank."""
        return {
            "iteration": self.iteration,
            "step": self.step.state_dict(),
            "rng": self.rng.state_dict(),
            "rerun": self.machine.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any], *, checkpoint_path: str | None = None) -> None:
        """Restore (before the first :meth:`run`); ``checkpoint_path`` names the loaded
        checkpoint for the rerun verdict file. Raises ``SuspectDeviceError`` (exit 16) on a
        device a verdict names as faulty."""
        self.shell.state.iteration = int(state["iteration"])
        self.step.load_state_dict(state.get("step", {}))
        self.rng.load_state_dict(state["rng"])
        self.machine.load_state_dict(state.get("rerun"))
        if checkpoint_path is not None:
            # The framework's own layout: the verdict names this checkpoint by its name.
            name = os.path.basename(os.path.normpath(checkpoint_path))
            self.shell.checkpoint_at(self.iteration, name)
            apply_verdict(
                self.machine,
                checkpoint_path,
                iteration=self.iteration,
                root=self.shell.config.save_dir,
            )

    def close(self) -> None:
        self.step.close()


def refuse_framework_saves(config: ShellConfig, names: Names) -> None:
    """The adapter's start-up refusals (``ValueError``, one line naming the settings as the
    adapter spells them): every rule of :meth:`ShellConfig.check`, a non-persistent save
    interval (a framework's checkpoint, ``trainer.save_checkpoint``, ``checkpoint-N``, is
    persistent, so such a save would outlive the job it was meant not to) and a spike rewind."""
    if config.rerun.rewind_on_spike:
        raise ValueError(
            f"{names.spell('rerun.rewind_on_spike')}: a rewind restores a snapshot and the "
            "loader's position in the middle of the framework's loop, which the framework owns; "
            f"skip a window with {names.spell('rerun.iterations_to_skip')} instead"
        )
    if config.exit.non_persistent_save_interval:
        raise ValueError(
            f"{names.spell('exit.non_persistent_save_interval')}: the framework's checkpoints "
            "are persistent (it has no non-persistent kind); save with "
            f"{names.spell('exit.save_interval')} instead"
        )
    config.check(names)


def reporting_loss(forward_step: ForwardStep) -> ForwardStep:
    """``forward_step`` that also reports its loss as ``"lm loss"`` (Megatron's key: the log
    line's loss, and what ``StepResult.losses`` carries) unless it reports that key itself."""

    def step(batch: Any, model: nn.Module) -> dict[str, torch.Tensor]:
        output = as_output(forward_step(batch, model))
        if MAIN_LOSS_KEY in output:
            return output
        # The step detaches every reported value (the loss under both keys once).
        return {**output, MAIN_LOSS_KEY: output["loss"]}

    return step


__all__ = ["FrameworkStep", "refuse_framework_saves", "reporting_loss"]
