"""The step's observer: straggler compute regions, tensor dumps, the memory release after each
forward-backward and a fault injector of the ``backward`` phase, behind the hook points the
guarded step calls (``on_microbatch``, ``compute``, ``iteration_region``, ``graph_safe``,
``after_forward_backward``) and the two the shell calls (``begin_iteration``, ``end_iteration``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

from stalwart.observability.dumps import NullTensorDumper, TensorDumper
from stalwart.observability.memory_release import NullMemoryRelease, UnusedMemoryRelease
from stalwart.observability.straggler import NullStragglerDetector, StragglerDetector

T = TypeVar("T")


class PassHooks(Protocol):
    """What a pass of micro-batches calls: before each micro-batch, around its compute, and
    the part of it that may run inside a captured graph (None: nothing)."""

    def on_microbatch(self, index: int, is_last: bool) -> None: ...

    def compute(self) -> contextlib.AbstractContextManager[Any]: ...

    def graph_safe(self) -> PassHooks | None: ...


class StepHooks(PassHooks, Protocol):
    """What the guarded step calls besides a pass's hooks (:class:`StepObserver` is the one;
    :class:`NullStepObserver` the disabled one)."""

    @property
    def enabled(self) -> bool:
        """Whether anything observes the step (the step skips its regions when not)."""
        ...

    @property
    def allows_lookahead(self) -> bool: ...

    def iteration_region(self) -> contextlib.AbstractContextManager[Any]: ...

    def after_forward_backward(self) -> None: ...


class NullStepObserver:
    """Nothing observes the step: every hook does nothing (the step pays nothing)."""

    enabled = False
    allows_lookahead = True

    def on_microbatch(self, index: int, is_last: bool) -> None:
        del index, is_last

    def compute(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def graph_safe(self) -> None:
        return None

    def iteration_region(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def after_forward_backward(self) -> None: ...


# Stateless: one instance serves every disabled step.
NULL_OBSERVER = NullStepObserver()


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


def in_regions(fb: Callable[..., T], observer: StepHooks) -> Callable[..., T]:
    """``fb`` with every call inside the observer's ``iteration_region`` (outside any graph);
    ``fb`` itself when nothing observes the step."""
    if not observer.enabled:
        return fb
    region = observer.iteration_region

    def timed(**kwargs: Any) -> T:
        with region():
            return fb(**kwargs)

    return timed


def staged_in_regions(
    stage: Callable[..., Callable[[], T]] | None, observer: StepHooks
) -> Callable[..., Callable[[], T]] | None:
    """A graph's ``stage_pass`` whose returned call runs inside the observer's region."""
    if stage is None or not observer.enabled:
        return stage
    region = observer.iteration_region

    def staged(**kwargs: Any) -> Callable[[], T]:
        fire = stage(**kwargs)

        def run() -> T:
            with region():
                return fire()

        return run

    return staged


__all__ = [
    "NULL_OBSERVER",
    "NullStepObserver",
    "PassHooks",
    "StepHooks",
    "StepObserver",
    "in_regions",
    "staged_in_regions",
]
