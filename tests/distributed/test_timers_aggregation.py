from __future__ import annotations

import time

import pytest

from stalwart.observability.sinks import NullSink

from dist_utils import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


class _RecSink(NullSink):
    def __init__(self) -> None:
        self.values: dict[str, float] = {}

    def add_scalars(self, values, step):  # type: ignore[no-untyped-def]
        self.values.update(values)


def _body(rank: int, world_size: int) -> dict[str, object]:
    from stalwart.observability.timers import Timers, TimingLogOption

    timers = Timers(0, TimingLogOption.MAX)
    t = timers("fb")
    t.start(barrier=True)
    time.sleep(0.02 if rank == 0 else 0.15)  # rank 1 is the straggler
    t.stop()
    if rank == 1:  # a timer that exists on one rank only
        only = timers("only-r1")
        only.start()
        time.sleep(0.01)
        only.stop()
    names = ["fb", "only-r1"]
    out: dict[str, object] = {}
    for option in ("max", "minmax", "all"):
        timers.log_option = TimingLogOption(option)
        out[option] = timers.log(names, reset=False)
    sink = _RecSink()
    timers.write(names, sink, iteration=3, reset=False)
    out["scalars"] = sink.values
    return out


def _value(text: str, prefix: str) -> str:
    line = next(ln for ln in text.splitlines() if ln.strip().startswith(prefix))
    return line.split(":", 1)[1].strip()


def test_timer_aggregation_two_ranks() -> None:
    r0, r1 = run_distributed(_body, world_size=2)
    assert r1 == {"max": None, "minmax": None, "all": None, "scalars": {}}  # rank 0 reports
    max_text = r0["max"]
    assert isinstance(max_text, str) and max_text.startswith("max time across ranks (ms):")
    assert 140.0 <= float(_value(max_text, "fb ")) < 1000.0  # rank 1's slow time wins
    minmax = r0["minmax"]
    assert isinstance(minmax, str) and minmax.startswith("(min, max) time across ranks (ms):")
    lo, hi = (float(v) for v in _value(minmax, "fb ").strip("()").split(","))
    assert 15.0 <= lo < 140.0 <= hi < 1000.0
    lo1, hi1 = (float(v) for v in _value(minmax, "only-r1 ").strip("()").split(","))
    assert lo1 == hi1  # zeros (rank 0 never timed it) are excluded from the min
    text_all = r0["all"]
    assert isinstance(text_all, str) and text_all.startswith("times across ranks (ms):\n  fb:")
    assert "\n     rank  0: " in text_all and "\n     rank  1: " in text_all
    assert text_all.count("rank  0:") == 1  # only-r1 lists rank 1 only
    scalars = r0["scalars"]
    # Timers.write: Megatron's dashboard keys and unit (seconds).
    assert isinstance(scalars, dict) and set(scalars) == {"fb-time", "only-r1-time"}
    assert 0.14 <= scalars["fb-time"] < 1.0
