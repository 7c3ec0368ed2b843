"""The goodput ledger's ``compile`` bucket says where its time went: cold compile, warm cache
load, CUDA graph capture, cache write (``src`` of a compile span)."""

from __future__ import annotations

import json

from stalwart.observability.goodput import Bucket, CompileSource, GoodputLedger
from stalwart.observability.goodput.reader import read_ledger
from stalwart.observability.goodput.records import GOODPUT_FILE, format_table, summarize


class FakeClock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _session(run_dir, clock: FakeClock, first: CompileSource, first_s: float) -> None:
    """A session: a compiling first iteration, the cache write, two plain iterations."""
    ledger = GoodputLedger(run_dir, clock=clock, launcher_start=clock.t, print_fn=lambda s: None)
    clock.t += 1.0  # start-up
    ledger.resumed(0)
    with ledger.step(1) as span:
        clock.t += first_s
        span.reclassify(Bucket.COMPILE, first)
    with ledger.span(Bucket.COMPILE, CompileSource.SAVE):
        clock.t += 0.5
    for it in (2, 3):
        with ledger.step(it):
            clock.t += 1.0
    ledger.close()


def test_cold_then_warm_relaunch_split_the_compile_bucket(tmp_path) -> None:
    clock = FakeClock()
    _session(tmp_path, clock, CompileSource.COLD, 40.0)
    clock.t += 2.0  # relaunch
    _session(tmp_path, clock, CompileSource.WARM, 4.0)
    summary = summarize(read_ledger(tmp_path / GOODPUT_FILE))
    assert summary.compile_sources == {"cold": 40.0, "save": 1.0, "warm": 4.0}
    assert summary.seconds[Bucket.COMPILE] == 45.0  # the sources add up to the bucket
    assert summary.seconds[Bucket.PRODUCTIVE] == 4.0
    table = format_table(summary)
    assert "compile: cold compile 40s, warm cache load 4.0s, cache write 1.0s" in table, table
    assert summary.to_json()["compile_sources"] == {"cold": 40.0, "save": 1.0, "warm": 4.0}
    # The ledger's live totals agree with the file.
    lines = [json.loads(x) for x in (tmp_path / GOODPUT_FILE).read_text().splitlines()]
    assert [x["src"] for x in lines if x.get("b") == "compile"] == ["cold", "save", "warm", "save"]


def test_a_compile_span_without_or_with_a_foreign_source_still_counts(tmp_path) -> None:
    path = tmp_path / GOODPUT_FILE
    session = {"k": "session", "t": 10.0, "s": "a", "launcher_start": 10.0}
    spans = [
        {"k": "span", "b": "compile", "t0": 10.0, "t1": 13.0, "s": "a"},  # an older stalwart
        {"k": "span", "b": "compile", "t0": 13.0, "t1": 14.0, "s": "a", "src": "quantum"},
        {"k": "span", "b": "compile", "t0": 14.0, "t1": 16.0, "s": "a", "src": "capture"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in [session, *spans]))
    summary = summarize(read_ledger(path))
    assert summary.compile_sources == {"unattributed": 4.0, "capture": 2.0}
    assert summary.seconds[Bucket.COMPILE] == 6.0
    assert "compile: unattributed 4.0s, CUDA graph capture 2.0s" in format_table(summary)


def test_a_capture_reclassified_step_keeps_its_source(tmp_path) -> None:
    clock = FakeClock()
    ledger = GoodputLedger(tmp_path, clock=clock, launcher_start=clock.t, print_fn=lambda s: None)
    with ledger.step(1) as span:
        clock.t += 0.25
        span.reclassify(Bucket.COMPILE, CompileSource.CAPTURE)
    with ledger.step(2):
        clock.t += 1.0
    summary = ledger.close()
    assert summary.compile_sources == {"capture": 0.25}
    assert summary.seconds[Bucket.PRODUCTIVE] == 1.0
