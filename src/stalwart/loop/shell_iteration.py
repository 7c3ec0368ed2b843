"""One iteration of the shell, and one evaluation (:class:`IterationScope`): what brackets the
user's step. :meth:`~stalwart.loop.Shell.iteration`, ``evaluation`` and ``eval_iteration`` are
this; the shell adds the refusal of settings no step honours.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from stalwart.loop.compile_booking import CompileBooking
from stalwart.loop.iterations import Iteration, Iterations
from stalwart.loop.observer import StepObserver
from stalwart.loop.rewind import Rewinder
from stalwart.loop.step import GuardedStep
from stalwart.observability.goodput import Bucket


class IterationScope:
    """The count, the profiler window, the goodput ledger's step (compile, capture and rerun
    time booked by what the step did), the watchdog's sections, the observer's iteration and
    the spike rewind's learning-rate factor, around each iteration and evaluation.

    ``announce(number, why)``: a skipped iteration's line and event (``why``: the setting or
    the spike rewind that skips it)."""

    def __init__(
        self,
        iterations: Iterations,
        *,
        ledger: Any,
        sections: Any,
        profiler: Any,
        memory_release: Any,
        rewinder: Rewinder,
        compiles: CompileBooking,
        skip_setting: str,
        announce: Callable[[int, str], None],
    ) -> None:
        self.iterations, self.ledger, self.sections = iterations, ledger, sections
        self.profiler, self.memory_release = profiler, memory_release
        self.rewinder, self.compiles = rewinder, compiles
        self._skip_setting, self._announce = skip_setting, announce

    @contextlib.contextmanager
    def iteration(
        self,
        observer: StepObserver,
        step: Callable[[], GuardedStep | None],
        began: Callable[[], None],
    ) -> Iterator[Iteration]:
        """See :meth:`Shell.iteration`. ``step()``: the guarded step, read again after the
        iteration (a framework may build it inside its first one); ``began()``: called once
        the iteration is set up, right before the ledger's step opens."""
        it = self.iterations.begin()
        if it.skipped:
            rewound = it.number in self.iterations.rewound
            self._announce(it.number, "spike rewind" if rewound else self._skip_setting)
        self.profiler.on_iteration_start(it.number - 1)
        before_step = step()
        captures = before_step.capture_state if before_step is not None else None
        before = self.compiles.mark()
        began()
        try:
            with self.ledger.step(it.number) as span:
                with self.sections.step_section():
                    observer.begin_iteration(it.number)
                    optimizer = before_step.optimizer if before_step is not None else None
                    with self.rewinder.scaled_lr(optimizer, it.number):  # after rewinds
                        yield it
                    observer.end_iteration()
                after = step()
                captured = (
                    after is not None and captures is not None and after.capture_state != captures
                )
                # it compiled: cold, or warm from a cache; or it captured a graph
                self.compiles.book(span, before, captured=captured)
                rejected = after is not None and after.rejected
                if rejected:
                    span.abandon(Bucket.RERUN)  # its passes validated, nothing advanced
        except BaseException:
            self.iterations.end(done=False)
            raise
        self.iterations.end(done=not rejected)
        self.compiles.save()  # outside the step: writing the cache's artifacts is compile time
        self.profiler.on_iteration_end(it.number)

    @contextlib.contextmanager
    def evaluation(self) -> Iterator[None]:
        """See :meth:`Shell.evaluation` (the shell agrees on the exit inputs again after)."""
        self.sections.start_evaluation()
        before = self.compiles.mark()
        with self.ledger.span(Bucket.EVALUATION):
            yield
        self.compiles.book(None, before)  # the evaluation's own graphs go into the cache too
        self.compiles.save()

    @contextlib.contextmanager
    def eval_iteration(self) -> Iterator[None]:
        """One evaluation iteration: the watchdog's section, then the memory release."""
        with self.sections.step_section(is_eval=True):
            yield
        self.memory_release.after_eval_step()


__all__ = ["IterationScope"]
