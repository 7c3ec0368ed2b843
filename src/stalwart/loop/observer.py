"""The step's observer: straggler compute regions, tensor dumps, the memory release after each
forward-backward and a fault injector of the ``backward`` phase, behind the hook points the
guarded step calls (``on_microbatch``, ``compute``, ``iteration_region``, ``graph_safe``,
``after_forward_backward``) and the two the shell calls (``begin_iteration``, ``end_iteration``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from stalwart.observability.dumps import NullTensorDumper, TensorDumper
from stalwart.observability.memory_release import NullMemoryRelease, UnusedMemoryRelease
from stalwart.observability.straggler import NullStragglerDetector, StragglerDetector


class StepObserver:
    """Straggler detector + tensor dumper + memory release (+ a ``backward`` fault injector)."""

    def __init__(
        self,
        straggler: StragglerDetector | NullStragglerDetector,
        dumper: TensorDumper | NullTensorDumper,
        memory_release: UnusedMemoryRelease | NullMemoryRelease,
        faults: Any = None,
        rank: int = 0,
    ) -> None:
        self.straggler, self.dumper, self.memory_release = straggler, dumper, memory_release
        # An injector firing after the backward (--inject-fault grad_corruption), else None.
        self.faults = faults if getattr(faults, "phase", None) == "backward" else None
        self._rank = rank
        self._iteration = 0

    def after_forward_backward(self) -> None:
        if self.faults is not None:  # the gradients are all-reduced, the step not taken yet
            self.faults.maybe_inject(self._iteration, self._rank, "backward")
        self.memory_release.after_forward_backward()

    @property
    def enabled(self) -> bool:
        """Whether anything observes the step (else the step gets no observer: it pays nothing)."""
        return not (
            isinstance(self.straggler, NullStragglerDetector)
            and isinstance(self.dumper, NullTensorDumper)
            and isinstance(self.memory_release, NullMemoryRelease)
            and self.faults is None
        )

    @property
    def allows_lookahead(self) -> bool:
        """Dumps attribute a forward to the iteration that runs it: no launch ahead then."""
        return isinstance(self.dumper, NullTensorDumper)

    def begin_iteration(self, iteration: int) -> None:
        self._iteration = iteration
        self.dumper.begin_iteration(iteration)

    def on_microbatch(self, index: int, is_last: bool) -> None:
        self.dumper.begin_microbatch(index, is_last)

    def compute(self) -> contextlib.AbstractContextManager[Any]:
        """Region counted as this rank's compute (excludes collectives and the optimizer); a
        micro-batch's forward and backward. On exit the dumper records the micro-batch (tokens per
        expert; after the last one, the gradients before clipping)."""
        if isinstance(self.dumper, NullTensorDumper):
            return self.straggler.compute()
        return self._compute_and_record()

    @contextlib.contextmanager
    def _compute_and_record(self) -> Iterator[None]:
        with self.straggler.compute():
            yield
        self.dumper.end_microbatch()

    def iteration_region(self) -> contextlib.AbstractContextManager[Any]:
        """A whole forward-backward call (compute + its collectives): the straggler's comm."""
        return self.straggler.iteration_region()

    def graph_safe(self) -> StragglerDetector | None:
        """What may run inside a captured graph: the straggler's compute regions (external
        CUDA events, re-recorded by every replay); dumps may not (they read tensors)."""
        return self.straggler.graph_safe()

    def end_iteration(self) -> None:
        self.straggler.step()
        self.dumper.end_iteration()
        self.memory_release.after_optimizer_step()
