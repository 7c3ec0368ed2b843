"""Manual garbage collection (``--manual-gc``): collect at the same iterations on every rank.

Python's automatic collector runs whenever allocation counters cross a threshold, which happens at
different moments on different ranks. A full collection of a large training process takes tens to
hundreds of milliseconds, and in synchronous data-parallel training every rank then waits for the
one that collected: at scale the job runs at the speed of a random straggler. With ``--manual-gc``
the automatic collector is off and ``gc.collect()`` runs every ``--manual-gc-interval`` iterations
(0: never between steps) and around evaluation (unless ``--no-manual-gc-eval``), at the same
iteration on every rank. `close` restores the collector as it was, so a restart or a library user
gets their process back unchanged. In a hand-written loop::

    gc_policy = ManualGC(interval=100)       # automatic GC off from here
    for it in range(1, train_iters + 1):
        step.run(it)
        gc_policy.on_iteration_end(it)       # collects at 100, 200, ... on every rank
    gc_policy.close()                        # automatic GC back on
"""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger(__name__)


class NullManualGC:
    """Automatic collection as usual."""

    def on_iteration_end(self, completed: int) -> None:
        pass

    def on_evaluation(self) -> None:
        pass

    def close(self) -> None:
        pass


class ManualGC:
    """Automatic GC off while this object is open; collect at fixed iterations and evaluations."""

    def __init__(self, interval: int, collect_at_eval: bool = True) -> None:
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
            raise ValueError(f"--manual-gc-interval must be an integer >= 0 (got {interval!r})")
        self.interval = interval
        self.collect_at_eval = collect_at_eval
        self.num_collections = 0
        self.collect_seconds = 0.0
        self._was_enabled = gc.isenabled()
        self._open = True
        gc.disable()
        self._collect()  # start clean: what setup left behind is not charged to a step

    def _collect(self) -> None:
        start = time.perf_counter()
        gc.collect()
        self.collect_seconds += time.perf_counter() - start
        self.num_collections += 1

    def on_iteration_end(self, completed: int) -> None:
        """Call after iteration ``completed`` (counted from 1, as logged)."""
        if self.interval and completed % self.interval == 0:
            self._collect()

    def on_evaluation(self) -> None:
        """Call before and after an evaluation (its tensors are freed in one sweep)."""
        if self.collect_at_eval:
            self._collect()

    def close(self) -> None:
        """Restore the automatic collector as it was before (idempotent)."""
        if not self._open:
            return
        self._open = False
        if self._was_enabled:
            gc.enable()
        logger.debug(
            "manual gc: %d collections, %.3f s in total", self.num_collections, self.collect_seconds
        )


def make_manual_gc(enabled: bool, interval: int, collect_at_eval: bool) -> ManualGC | NullManualGC:
    """`ManualGC` when ``--manual-gc``, else the null object."""
    return ManualGC(interval, collect_at_eval) if enabled else NullManualGC()
