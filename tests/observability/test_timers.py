from __future__ import annotations

import time

import pytest

from stalwart.observability.sinks import NullSink
from stalwart.observability.timer_names import FORWARD_BACKWARD, FORWARD_COMPUTE, INTERVAL_TIME
from stalwart.observability.timers import (
    NullTimer,
    Timer,
    TimerReport,
    Timers,
    TimingLogOption,
    TimingMode,
    validate_timing_flags,
)


class RecSink(NullSink):
    def __init__(self) -> None:
        self.calls: list[tuple[str, float, int]] = []

    def add_scalars(self, values, step):  # type: ignore[no-untyped-def]
        self.calls.extend((k, float(v), step) for k, v in values.items())


@pytest.mark.parametrize("mode", list(TimingMode))
def test_timer_accumulates_seconds(mode: TimingMode) -> None:
    t = Timers(0, TimingLogOption.MAX, mode=mode)("x")
    assert isinstance(t, Timer)
    for _ in range(2):
        t.start()
        time.sleep(0.03)
        t.stop()
    first = t.elapsed(reset=False)
    assert 0.055 <= first < 0.5
    assert t.elapsed(reset=True) >= first
    assert t.elapsed() == 0.0
    assert t.active_time() >= first  # reset keeps the cumulative active time


def test_running_timer_elapsed_restarts() -> None:
    t = Timers(0, TimingLogOption.MINMAX)("x")
    t.start()
    time.sleep(0.02)
    assert t.elapsed() >= 0.015
    assert isinstance(t, Timer) and t.is_running
    t.stop()
    assert 0.0 <= t.elapsed() < 0.5


def test_start_stop_misuse_raises() -> None:
    t = Timers(0, TimingLogOption.MINMAX)("x")
    with pytest.raises(RuntimeError, match="not started"):
        t.stop()
    t.start()
    with pytest.raises(RuntimeError, match="already been started"):
        t.start()


def test_levels_and_null_timer() -> None:
    timers = Timers(1, TimingLogOption.MINMAX)
    fb = timers(FORWARD_BACKWARD)  # standard level 1
    assert isinstance(fb, Timer) and fb.log_level == 1
    null_a = timers(FORWARD_COMPUTE)  # standard level 2 > 1
    null_b = timers("custom", log_level=2)
    assert isinstance(null_a, NullTimer) and null_a is null_b  # one shared null object
    assert timers.names == [FORWARD_BACKWARD]  # null timers are not registered
    null_a.start()
    null_a.stop()
    with pytest.raises(RuntimeError, match="timing-log-level"):
        null_a.elapsed()
    assert timers(INTERVAL_TIME).log_level == 0  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="log level"):
        timers(FORWARD_BACKWARD, log_level=0)


@pytest.mark.parametrize(
    ("level", "option", "error", "match"),
    [
        (3, TimingLogOption.MAX, ValueError, "--timing-log-level"),
        (-1, TimingLogOption.MAX, ValueError, "--timing-log-level"),
        # A string is the CLI's business (parsed once, in the config): the component refuses it.
        (0, "max", TypeError, "TimingLogOption"),
        (0, "avg", TypeError, "TimingLogOption"),
    ],
)
def test_bad_flags_raise(level: int, option: object, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        Timers(level, option)  # type: ignore[arg-type]
    with pytest.raises(error, match=match):
        validate_timing_flags(level, option)  # type: ignore[arg-type]


def test_report_formats_exact() -> None:
    rep = TimerReport(names=("fb", "opt", "never"), ms=((10.0, 0.0, 0.0), (30.5, 2.0, 0.0)))
    dots_fb = "fb " + "." * 45
    dots_opt = "opt " + "." * 44
    assert rep.format(TimingLogOption.MAX) == (
        f"max time across ranks (ms):\n    {dots_fb}: 30.50\n    {dots_opt}: 2.00"
    )
    assert rep.format(TimingLogOption.MINMAX) == (
        "(min, max) time across ranks (ms):"
        f"\n    {dots_fb}: (10.00, 30.50)\n    {dots_opt}: (2.00, 2.00)"
    )
    assert rep.format(TimingLogOption.ALL) == (
        "times across ranks (ms):\n  fb:\n     rank  0: 10.00\n     rank  1: 30.50"
        "\n  opt:\n     rank  1: 2.00"
    )
    assert rep.scalars() == {"fb-time-ms": 30.5, "opt-time-ms": 2.0}
    assert rep.megatron_scalars() == {"fb-time": 0.0305, "opt-time": 0.002}
    assert TimerReport(("a",), ((0.0,),)).format(TimingLogOption.MINMAX) is None
    with pytest.raises(TypeError, match="TimingLogOption"):
        rep.format("all")  # type: ignore[arg-type]


def test_log_and_write_single_process_in_ms() -> None:
    timers = Timers(0, TimingLogOption.MAX)
    t = timers("step")
    t.start()
    time.sleep(0.04)
    t.stop()
    sink = RecSink()
    timers.write(["step"], sink, iteration=7, normalizer=2.0, reset=False)
    ((key, value, step),) = sink.calls
    assert key == "step-time" and step == 7
    assert 0.018 <= value < 0.25  # 40 ms / 2, in seconds (Megatron's dashboard unit)
    text = timers.log(["step"], normalizer=2.0)
    assert text is not None and text.startswith("max time across ranks (ms):\n    step ...")
    assert timers.log([]) is None
    with pytest.raises(ValueError, match="normalizer"):
        timers.log(["step"], normalizer=0.0)
