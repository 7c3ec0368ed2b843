"""The loop's iterations as the shell owns them: one count, one numbering, one skip list.

Every verb, message and file numbers an iteration as the training log does: from 1. Iteration
``N`` is the ``N``-th one run; once it is done, ``N`` iterations are completed (a checkpoint of
it is ``iter_000000N``). A rejected iteration (exit 16/17) is not completed: the exit, its
checkpoint and ``exit_reason.json`` name the iterations completed before it, on every path.

    >>> iterations = Iterations(train_iters=4, skip=[2])
    >>> it = iterations.begin(); it
    Iteration(number=1, skipped=False, launch_next=False)
    >>> iterations.end(done=True); iterations.begin()
    Iteration(number=2, skipped=True, launch_next=True)
    >>> iterations.end(done=True); iterations.completed
    2
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from stalwart.loop.checkpointing import LoopState


@dataclass(frozen=True)
class Iteration:
    """One iteration, as ``with shell.iteration() as it`` hands it to the loop.

    Attributes:
        number: counted from 1, as logged (also the completed count once it is done).
        skipped: in the skip list (``RerunConfig.iterations_to_skip``, or the tracker file's
            iterations to skip after a restart): ``GuardedStep.run(it)`` consumes its
            micro-batches without training (Megatron's dummy step); the log counts it skipped.
        launch_next: the next iteration exists and is not skipped, so the guarded step may
            launch it ahead (a loop that evaluates before it passes ``launch_next=False``).
    """

    number: int
    skipped: bool = False
    launch_next: bool = False


class Iterations:
    """The count (a :class:`LoopState`, checkpointed by the shell), the skip list and the
    iteration in progress (:attr:`current`)."""

    def __init__(self, train_iters: int, skip: Iterable[int] = ()) -> None:
        self.train_iters = train_iters
        self.skip = frozenset(skip)
        self.rewound: frozenset[int] = frozenset()
        self.state = LoopState()
        self.current: Iteration | None = None

    @property
    def completed(self) -> int:
        """Iterations completed (accepted or skipped): the number of the last one done."""
        return self.state.iteration

    @property
    def finished(self) -> bool:
        """The last training iteration is done."""
        return self.completed >= self.train_iters

    def begin(self) -> Iteration:
        """The next iteration (it becomes :attr:`current`)."""
        if self.current is not None:
            raise RuntimeError(f"iteration {self.current.number} is still in progress")
        number = self.completed + 1
        upcoming = number + 1
        self.current = Iteration(
            number,
            skipped=number in self.skip,
            launch_next=upcoming <= self.train_iters and upcoming not in self.skip,
        )
        return self.current

    def add_skips(self, numbers: Iterable[int]) -> None:
        """Skip these iterations too (a spike rewind's window, numbered from 1; listed in
        :attr:`rewound`)."""
        self.rewound = self.rewound | frozenset(numbers)
        self.skip = self.skip | self.rewound

    def end(self, *, done: bool) -> None:
        """The current iteration ended: completed (``done``), or rejected (not counted)."""
        self.current = None
        if done:
            self.state.iteration += 1


__all__ = ["Iteration", "Iterations"]
