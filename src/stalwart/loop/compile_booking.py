"""The shell's compile booking (:class:`CompileBooking`): an iteration that compiled is booked
into the goodput ledger's ``compile`` bucket, cold or warm, and the compile cache
(:class:`stalwart.compile.CompileCache`) writes its artifacts after it. The cache is the
``compile`` component's; where its time goes is the shell's, so the booking is here.
"""

from __future__ import annotations

import sys
from typing import Any

from stalwart.compile import CompileCache, CompileCounts, NullCompileCache
from stalwart.observability.goodput.records import Bucket, CompileSource


def compile_source(counts: CompileCounts) -> CompileSource:
    """Where a compile's time went: warm (every Inductor graph from the cache) or cold."""
    return CompileSource.WARM if counts.warm else CompileSource.COLD


class CompileBooking:
    """Books the iterations that compiled into the goodput ledger's ``compile`` bucket, with where
    their time went (`CompileSource`), and writes the cache's artifacts after them.

    Not enabled (``--compile`` off): no counter is read, nothing is booked. An iteration that
    compiled nothing (the second iteration; an in-process restart's first, whose model reuses
    the compiled code) stays productive or lost work. ``ledger`` is a goodput ledger (the null
    one on other ranks).

        booking = CompileBooking(cache, ledger, enabled=True)
        with ledger.step(it) as span:
            before = booking.mark()
            train_step()
            booking.book(span, before)
        booking.save()                      # outside the step: its time is compile (cache write)
    """

    def __init__(
        self, cache: CompileCache | NullCompileCache, ledger: Any, *, enabled: bool
    ) -> None:
        self.cache, self.ledger, self.enabled = cache, ledger, enabled
        self._unsaved = False
        self._cold = False  # a graph compiled since the last save was not in the cache

    def mark(self) -> CompileCounts | None:
        """The counters before a step (None when not enabled, or while nothing was compiled:
        Dynamo not imported yet, so a loop that never compiles pays nothing)."""
        if not self.enabled or "torch._dynamo" not in sys.modules:
            return None
        return CompileCounts.read()

    def book(
        self, span: Any, before: CompileCounts | None, *, captured: bool = False
    ) -> CompileCounts | None:
        """What compiled since ``before`` (None: nothing); reclassifies ``span`` (a `StepSpan`,
        or None outside a step) to ``compile``, cold or warm, or, when nothing compiled and the
        step ``captured`` a graph, to the capture's compile time."""
        if captured and span is not None:
            span.reclassify(Bucket.COMPILE, CompileSource.CAPTURE)
        if before is None:
            return None
        compiled = CompileCounts.read().since(before)
        if not compiled.compiled:
            return None
        self._unsaved = True
        self._cold |= not compiled.warm
        if span is not None:
            span.reclassify(Bucket.COMPILE, compile_source(compiled))
        return compiled

    def save(self) -> None:
        """After a step that compiled something new (or with no artifacts file yet): write the
        artifacts, booked as compile (cache write). A warm relaunch writes nothing."""
        if self._unsaved and (self._cold or not self.cache.has_artifacts()):
            with self.ledger.span(Bucket.COMPILE, CompileSource.SAVE):
                self.cache.save()
        self._unsaved = self._cold = False


__all__ = ["CompileBooking", "compile_source"]
