"""Per-iteration observation hooks of the step: straggler compute regions and tensor dumps.

The schedule calls ``on_microbatch(index, is_last)`` and wraps each forward/backward in
``compute()``; the trainer calls ``begin_iteration``/``end_iteration``. With both probes off the
trainer passes no observer at all, so the schedule pays nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from stalwart.observability.dumps import NullTensorDumper, TensorDumper
from stalwart.observability.straggler import NullStragglerDetector, StragglerDetector


class StepObserver:
    """Straggler detector + tensor dumper behind the schedule's two hook points."""

    def __init__(
        self,
        straggler: StragglerDetector | NullStragglerDetector,
        dumper: TensorDumper | NullTensorDumper,
    ) -> None:
        self.straggler = straggler
        self.dumper = dumper

    @property
    def enabled(self) -> bool:
        return not (
            isinstance(self.straggler, NullStragglerDetector)
            and isinstance(self.dumper, NullTensorDumper)
        )

    def begin_iteration(self, iteration: int) -> None:
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

    def end_iteration(self) -> None:
        self.straggler.step()
        self.dumper.end_iteration()

    def close(self) -> None:
        self.dumper.close()
        self.straggler.close()
