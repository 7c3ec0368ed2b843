"""bench/warm_restart.py reads a relaunch's figures from its goodput ledger (the runs themselves
compile for minutes on CPU: the command is in docs/benchmarks-inprocess.md)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import warm_restart  # type: ignore[import-not-found]
from stalwart.observability.goodput import Bucket, CompileSource, GoodputLedger


class FakeClock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_last_session_is_launch_to_the_end_of_its_last_compile_span(tmp_path: Path) -> None:
    clock = FakeClock(1000.0)
    for first_s in (30.0, 3.0):  # the faulted job, then the relaunch
        start = clock.t
        ledger = GoodputLedger(tmp_path, clock=clock, launcher_start=start, print_fn=lambda s: None)
        clock.t += 2.0  # start-up
        with ledger.step(1) as span:
            clock.t += first_s
            span.reclassify(Bucket.COMPILE, CompileSource.WARM)
        with ledger.span(Bucket.COMPILE, CompileSource.SAVE):
            clock.t += 0.5
        with ledger.step(2):
            clock.t += 1.0
        ledger.close("fault")
        clock.t += 5.0
    result = warm_restart.last_session(tmp_path)
    assert result["to_first_productive_s"] == 2.0 + 3.0 + 0.5
    assert result["startup_s"] == 2.0
    assert result["compile_sources"] == {"warm": 3.0, "save": 0.5}
    table = warm_restart.summary_table({"cold": [result], "warm": [result]})
    assert "| warm | 5.50 | 5.50-5.50 | 5.50 | 3.50 | warm 3.00, save 0.50 |" in table
