"""Recoveries read back from what the ledger writer wrote (fake clock): a raised step, a hang
the watchdog reported before a kill, a SIGTERM, a finished job relaunched; the projection's
docstring examples."""

from __future__ import annotations

import doctest

import pytest

from stalwart.observability.goodput import Bucket, CompileSource, GoodputLedger, ettr, recovery
from stalwart.observability.goodput.reader import read_ledger
from stalwart.observability.goodput.records import GOODPUT_FILE
from stalwart.observability.goodput.recovery import recoveries


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


def _ledger(run_dir, clock: Clock) -> GoodputLedger:
    return GoodputLedger(run_dir, clock=clock, launcher_start=clock.t, print_fn=lambda s: None)


def _steps(ledger: GoodputLedger, clock: Clock, its, compile_first=None) -> None:
    for it in its:
        with ledger.step(it) as step:
            clock.t += 1.0
            if compile_first is not None and it == its[0]:
                step.reclassify(Bucket.COMPILE, compile_first)


def test_exception_hang_signal_and_a_new_segment(tmp_path) -> None:
    clock = Clock()
    a = _ledger(tmp_path, clock)
    clock.t += 5.0
    a.resumed(0)
    _steps(a, clock, [1, 2, 3, 4], CompileSource.COLD)
    with pytest.raises(RuntimeError), a.step(5):
        clock.t += 0.5  # half a step, then it raises
        raise RuntimeError("boom")
    clock.t += 0.25  # the loop's exit path
    a.close("fault", "RuntimeError: boom")
    clock.t += 7.0  # torchrun tears down and relaunches
    b = _ledger(tmp_path, clock)
    clock.t += 3.0
    b.resumed(2)
    _steps(b, clock, [3, 4, 5, 6], CompileSource.WARM)  # 3 compiles, 4 again, 5-6 new
    with pytest.raises(RuntimeError), b.step(7):
        clock.t += 10.0
        b.fault("hang", "no progress")  # the in-process watchdog's report
        clock.t += 2.0  # abort, escalation
        raise RuntimeError("aborted")
    del b  # killed before it could close
    clock.t += 4.0
    c = _ledger(tmp_path, clock)
    clock.t += 2.0
    c.resumed(6)
    _steps(c, clock, [7, 8])
    c.close("signal", "SIGTERM")
    clock.t += 30.0
    d = _ledger(tmp_path, clock)
    clock.t += 1.0
    d.resumed(8)
    _steps(d, clock, [9])
    d.close()
    clock.t += 100.0  # a finished job relaunched: a new segment, not a recovery
    e = _ledger(tmp_path, clock)
    e.resumed(9)
    _steps(e, clock, [10])
    e.close()

    found = recoveries(read_ledger(tmp_path / GOODPUT_FILE, now=clock.t))
    assert [r.kind for r in found] == ["exception", "hang", "signal"]
    raised, hung, signal = found
    assert raised.seconds() == pytest.approx(
        {
            "detection": 0.0,
            "teardown": 0.25 + 7.0,
            "restart": 3.0,
            "recompile": 1.0,
            "lost work": 0.5 + 1.0,
        }  # the failed half step; iteration 4 again (3 compiled)
    )
    # b never closed: its hung step is the gap's hang (until the watchdog's report), then
    # teardown.
    assert hung.seconds() == pytest.approx(
        {
            "detection": 10.0,
            "teardown": 2.0 + 4.0,
            "restart": 2.0,
            "recompile": 0.0,
            "lost work": 0.0,
        }
    )
    assert signal.planned and not hung.planned
    assert signal.seconds() == pytest.approx(
        {"detection": 0.0, "teardown": 30.0, "restart": 1.0, "recompile": 0.0, "lost work": 0.0}
    )


def test_killed_without_an_end_record(tmp_path) -> None:
    clock = Clock()
    a = GoodputLedger(
        tmp_path,
        clock=clock,
        launcher_start=clock.t,
        print_fn=lambda s: None,
        flush_interval_s=0.5,
    )
    a.resumed(0)
    _steps(a, clock, [1, 2, 3])
    del a
    clock.t += 6.0
    b = _ledger(tmp_path, clock)
    b.resumed(2)
    _steps(b, clock, [3, 4])
    b.close()
    (found,) = recoveries(read_ledger(tmp_path / GOODPUT_FILE, now=clock.t))
    assert found.kind == "killed" and found.teardown_s == pytest.approx(6.0)
    assert found.lost_work_s == pytest.approx(1.0) and found.total_s == pytest.approx(7.0)


@pytest.mark.parametrize("module", [recovery, ettr])
def test_docstring_examples(module) -> None:
    assert doctest.testmod(module).failed == 0
