"""Launch the next iteration's first work before this iteration is read, exactly.

With a device-gated optimizer step the only host sync left per iteration is the rerun machine's
read of the checks. Reading right after the step stalls the device while the host issues the
next iteration. The look-ahead queues the next iteration's first work first (eager: its first
micro-batch, forward and backward; a full-iteration graph: its whole forward-backward replay),
then lets the machine read, so the device works through the read. One launcher for both plans.
The launch's host work comes before this pass's optimizer step is queued (:meth:`LookAhead.prepare`:
the next micro-batches are read; a graph's next pass is begun and its inputs are copied), while
the device still runs the pass: queued after the step, which is short, it left the device idle.

What keeps this exact (same losses, grad norms and parameters as without it):

- The read sees this pass's values: ``RerunStateMachine.begin_ahead`` snapshots the buffer
  (stream-ordered copy) before the next pass writes it, and records go to the next pass from then.
- State: the machine saves the next iteration's state (every RNG, the loss scaler, the device
  large-value windows) when the launch begins, before any of its work, which is exactly what it
  would save at that iteration's start. Nothing is restored after the launch: the RNG simply
  goes on from where the launched work left it, as it would have.
- Data: the next micro-batches are read ahead with ``RerunDataIterator.peek`` and served first to
  the next iteration (recorded for its own rerun); a rerun of this iteration replays its own.
- A rejected pass skipped its optimizer step on the device, so the launched work ran on stale
  weights: it is discarded (records, large-value windows and data position undone) and this
  iteration is rerun from its own saved state. :meth:`LookAhead.discard` (``GuardedStep.settle``)
  drops a launch also when anything else must run first (evaluation, a checkpoint, another
  micro-batch count), restoring every RNG to the launch's start.

Not launched under error injection (its per-pass decisions are made as a pass begins), for the
last iteration, or when the loop says the next iteration is not a plain one.

Limitations: on several GPUs with NCCL the iteration's agreement collective is a device
all-reduce, stream-ordered after the launched work, so the read waits for it and most of the
overlap is lost (the results stay exact). Between ``run`` calls nothing may draw from the RNG,
read the data iterator or change parameters without ``GuardedStep.settle()`` first; a data loader
that draws from the global Python/NumPy RNG sees its draws for a discarded launch happen earlier.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from stalwart.loop.microbatches import Reported
from stalwart.reliability.rerun import RerunDataIterator, RerunStateMachine


@dataclass
class Launched:
    """The next iteration's work already queued: its first ``len(batches)`` micro-batches."""

    iteration: int
    num_microbatches: int
    batches: list[Any]
    reported: Reported


@dataclass(eq=False)
class LookAhead:
    """Launches the next iteration's first micro-batches (or the whole graphed pass).

    Args:
        machine: the rerun machine (begins the next pass ahead, or discards it).
        data: the training data iterator (peeked for the next iteration).
        forward_backward: the plan's pass function.
        splittable: eager: launch one micro-batch; otherwise the whole pass.
        ready: whether a launch may happen now (a graph: once captured).
        stage_pass: a graph's input loading (``Runners.stage_pass``): :meth:`prepare` then
            begins the next pass and queues its input copies, and :meth:`launch` only replays.
    """

    machine: RerunStateMachine
    data: RerunDataIterator[Any]
    forward_backward: Callable[..., Reported]
    splittable: bool
    ready: Callable[[], bool]
    stage_pass: Callable[..., Callable[[], Reported]] | None = None
    num_launched: int = field(default=0, init=False)
    num_used: int = field(default=0, init=False)
    _launched: Launched | None = field(default=None, init=False, repr=False)
    _staged: tuple[int, int, list[Any], Callable[[], Reported]] | None = field(
        default=None, init=False, repr=False
    )

    @property
    def pending(self) -> Launched | None:
        return self._launched

    def prepare(self, iteration: int, num_microbatches: int) -> bool:
        """The launch's host work, ahead of it: called before this pass's optimizer step is
        queued, while the device still runs the pass (the step is too short to hide it, so
        between the step and the launch the device would idle). Reads the micro-batches a
        :meth:`launch` takes (the data iterator builds and pins them; nothing is consumed);
        with a graph (``stage_pass``) also begins the next pass and queues its input copies,
        so the launch is one replay. Nothing changes if no launch follows (:meth:`discard`).
        Returns whether the launch was staged."""
        if self._launched is not None or self._staged is not None or not self._can_launch():
            return False
        count = 1 if self.splittable else num_microbatches
        if self.stage_pass is None:
            self.data.peek(count)
            return False
        self.machine.begin_ahead(iteration)
        batches = self.data.peek(count)
        fire = self.stage_pass(data_iterator=iter(batches), num_microbatches=num_microbatches)
        self._staged = (iteration, num_microbatches, list(batches), fire)
        return True

    def _can_launch(self) -> bool:
        return self.ready() and self.machine.can_begin_ahead()

    def launch(self, iteration: int, num_microbatches: int) -> bool:
        """Queue ``iteration``'s first work now (after this pass's gated step was enqueued and
        joined, before the machine reads this pass). Returns whether it launched."""
        staged, self._staged = self._staged, None
        if staged is not None:
            if staged[:2] != (iteration, num_microbatches):
                raise RuntimeError(
                    f"launch of {(iteration, num_microbatches)} after staging {staged[:2]}"
                )
            reported = staged[3]()
            self._launched = Launched(iteration, num_microbatches, staged[2], reported)
            self.num_launched += 1
            return True
        if self._launched is not None or not self._can_launch():
            return False
        count = 1 if self.splittable else num_microbatches
        self.machine.begin_ahead(iteration)
        batches = self.data.peek(count)
        # A graph's pass is one call with the usual keywords (extra ones would change its
        # signature); eager runs the prefix.
        span = {"first": 0, "stop": count} if self.splittable else {}
        reported = self.forward_backward(
            data_iterator=iter(batches), num_microbatches=num_microbatches, **span
        )
        self._launched = Launched(iteration, num_microbatches, list(batches), reported)
        self.num_launched += 1
        return True

    def take(self, data_iterator: Any) -> Launched | None:
        """The launched work for the iteration the machine just adopted it for; consumes its
        micro-batches from ``data_iterator`` (so a rerun of that iteration replays them)."""
        launched, self._launched = self._launched, None
        if launched is None:
            return None
        served = [next(data_iterator) for _ in launched.batches]
        if any(a is not b for a, b in zip(served, launched.batches, strict=True)):
            raise RuntimeError(
                "the data iterator was read between GuardedStep.run() calls while the next "
                "iteration was launched ahead; call step.settle() before reading it"
            )
        self.num_used += 1
        return launched

    def discard(self, restore_rng: bool = True) -> bool:
        """Drop the launched work (the peeked batches stay first in line). Returns whether
        there was any."""
        launched, self._launched = self._launched, None
        staged, self._staged = self._staged, None
        if launched is None and staged is None:
            return False
        self.machine.discard_ahead(restore_rng=restore_rng)
        return True

    def forget(self) -> None:
        """The machine already dropped the pass begun ahead (a rerun): forget the work too."""
        self._launched = self._staged = None
