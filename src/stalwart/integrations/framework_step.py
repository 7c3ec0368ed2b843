"""The guarded step inside a framework's step: the framework brings each iteration's
micro-batches, stalwart runs forward, backward, the checks, a replay and the optimizer step.

A framework owns its data loader and checkpoints; the rerun state machine needs to own
forward-backward (it replays the iteration on the same micro-batches and RNG) and the
optimizer step (a rejected iteration must never touch the weights). :class:`FrameworkStep`
feeds the batches the framework hands over into a :class:`stalwart.loop.GuardedStep` (no
look-ahead: the next batch is not known before the framework's next call) and keeps the state
the framework's checkpoint has to carry (:meth:`state_dict`): the iteration count, every RNG,
the rerun machine and, after an exit 16, the failed iteration's micro-batches.

Why the micro-batches: the framework counts the failed iteration's batches as consumed, so a
relaunch (on other hardware) resumes its data loader *after* them; the machine needs to rerun
exactly that iteration. :meth:`run` therefore runs the saved micro-batches first when the loaded
state asks for the rerun from the checkpoint (and the framework's batch of that call is not
used: that rerun always ends the job, with 16 again on the same device or 17 with the
diagnosis). A settled verdict (``rerun_verdict.json``, :meth:`apply_verdict`) drops them.

Usage (what the Lightning and Hugging Face adapters do)::

    fstep = FrameworkStep(shell, model=model, optimizer=optimizer, forward_step=fwd)
    result = fstep.run([batch])                 # one iteration of one (or more) micro-batches
    decision = shell.decide(fstep.iteration, result=result, finished=...)
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from stalwart.loop import RngState, StepResult
from stalwart.loop.microbatches import ForwardStep, as_output
from stalwart.observability.train_log import MAIN_LOSS_KEY
from stalwart.reliability.rerun import RerunDataIterator, RerunState
from stalwart.reliability.rerun.verdict_file import apply_verdict

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
            agreement, timers, observer and goodput ledger).
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
            model, optimizer, reporting_loss(forward_step), self.data, clip_grad=clip_grad,
            lookahead=False, backward=backward,
        )  # fmt: skip
        self.rng = RngState(self.machine.rng)
        self.iteration = 0  # accepted iterations
        self._failed: list[Any] | None = None  # the exit-16 iteration's micro-batches
        self._rerun_first: list[Any] | None = None  # loaded: rerun from the checkpoint first

    def run(self, batches: list[Any]) -> StepResult:
        """One iteration on ``batches`` (its micro-batches); the loaded failed iteration first
        (see the module docstring). The result's verdict says whether to exit (16/17)."""
        if not batches:
            raise ValueError("FrameworkStep.run: an iteration needs at least one micro-batch")
        if self._rerun_first is not None:
            replay, self._rerun_first = self._rerun_first, None
            result = self._run(replay)
            if result.verdict.exit:
                return result
        return self._run(batches)

    def _run(self, batches: list[Any]) -> StepResult:
        self._feed.queue.extend(batches)
        try:
            result = self.step.run(self.iteration, num_microbatches=len(batches), launch_next=False)
        finally:
            self._feed.queue.clear()
        if result.verdict.exit:
            # A diagnosis (the rerun from a checkpoint's, or the peer replay's) rides on the
            # verdict; the shell's leave() writes rerun_verdict.json from it.
            self._failed = list(batches) if result.verdict.checkpoint else None
        else:
            self.iteration += 1
            self._failed = None
        return result

    # --------------------------------------------------------------------------- Stateful
    def state_dict(self) -> dict[str, Any]:
        """JSON-friendly values and tensors (loadable with ``torch.load(weights_only=True)``).
        Collective (the rerun machine's state): call it on every rank."""
        return {
            "iteration": self.iteration,
            "step": self.step.state_dict(),
            "rng": self.rng.state_dict(),
            "rerun": self.machine.state_dict(),
            "failed_microbatches": _detached(self._failed) if self._failed is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any], *, checkpoint_path: str | None = None) -> None:
        """Restore (before the first :meth:`run`); ``checkpoint_path`` names the loaded
        checkpoint for the rerun verdict file. Raises ``SuspectDeviceError`` (exit 16) on a
        device a verdict names as faulty."""
        self.iteration = int(state["iteration"])
        self.step.load_state_dict(state.get("step", {}))
        self.rng.load_state_dict(state["rng"])
        self.machine.load_state_dict(state.get("rerun"))
        if checkpoint_path is not None:
            # The framework's own layout: the verdict names this checkpoint by its name.
            name = os.path.basename(os.path.normpath(checkpoint_path))
            self.shell.checkpoint_at(self.iteration, name)
            apply_verdict(
                self.machine, checkpoint_path, iteration=self.iteration,
                root=self.shell.config.save_dir,
            )  # fmt: skip
        failed = state.get("failed_microbatches")
        if failed is not None and self.machine.state is RerunState.WILL_RERUN_FROM_CHECKPOINT:
            self._rerun_first = list(failed)

    def close(self) -> None:
        self.step.close()


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


def _detached(batches: list[Any]) -> list[Any]:
    """The micro-batches on the CPU (a checkpoint is read on any device)."""

    def cpu(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.detach().cpu()
        if isinstance(value, Mapping):  # dicts, and Hugging Face's BatchEncoding
            return {k: cpu(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [cpu(v) for v in value]
        return value

    return [cpu(b) for b in batches]


__all__ = ["FrameworkStep", "reporting_loss"]
