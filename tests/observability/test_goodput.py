"""Goodput ledger: buckets, sessions, gaps, lost work, torn and hostile files (fake clock, CPU)."""

from __future__ import annotations

import doctest
import json
import os
import time

import pytest

from stalwart.observability.goodput import (
    Bucket,
    GoodputLedger,
    NullGoodputLedger,
    make_goodput_ledger,
    process_start_time,
    straggler_idle_seconds,
)
from stalwart.observability.goodput import ledger as goodput
from stalwart.observability.goodput import session as goodput_session
from stalwart.observability.goodput.reader import read_ledger
from stalwart.observability.goodput.records import (
    GOODPUT_FILE,
    format_duration,
    format_table,
    goodput_line,
    summarize,
)


class FakeClock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def _ledger(run_dir, clock, start=None, **kw) -> GoodputLedger:
    lines: list[str] = []
    kw.setdefault("print_fn", lines.append)
    ledger = GoodputLedger(
        run_dir, clock=clock, launcher_start=clock.t if start is None else start, **kw
    )
    ledger.lines = lines  # type: ignore[attr-defined]
    return ledger


def _train(ledger, clock, iterations, step_s=1.0, start=1) -> None:
    for it in range(start, start + iterations):
        with ledger.step(it):
            clock.advance(step_s)


def test_docstring_example_runs() -> None:
    result = doctest.testmod(goodput, raise_on_error=True)
    assert result.attempted >= 5


def test_one_session_buckets_are_exact_and_sum_to_wall(tmp_path) -> None:
    clock = FakeClock()
    ledger = _ledger(tmp_path, clock, start=clock.t - 3.0)  # launched 3 s ago
    clock.advance(2.0)  # build + load
    ledger.resumed(0)
    _train(ledger, clock, 4)
    with ledger.span(Bucket.EVALUATION):
        clock.advance(0.5)
    with ledger.span(Bucket.CHECKPOINT):
        clock.advance(0.25)
    _train(ledger, clock, 2, start=5)
    summary = ledger.close()
    s = summary.seconds
    assert s[Bucket.STARTUP] == pytest.approx(5.0)
    assert s[Bucket.PRODUCTIVE] == pytest.approx(6.0)
    assert s[Bucket.EVALUATION] == pytest.approx(0.5)
    assert s[Bucket.CHECKPOINT] == pytest.approx(0.25)
    assert summary.wall_s == pytest.approx(11.75)
    assert summary.goodput == pytest.approx(6.0 / 11.75)
    assert ledger.lines == [goodput_line(summary)]  # type: ignore[attr-defined]
    assert ledger.lines[0] == (  # type: ignore[attr-defined]
        "goodput: 51.1% (productive 6.0s of 12s; lost: startup 5.0s, evaluation 0.5s, "
        "checkpoint 0.2s)"
    )
    assert summary.sessions[0].end_reason == "finished"
    assert summary.sessions[0].last_iteration == 6
    assert summary.sessions[0].startup_s == pytest.approx(5.0)


def test_crash_then_restart_counts_downtime_and_recomputed_iterations(tmp_path) -> None:
    """Session 1 trains 1..7 (last save at 4) and is SIGKILLed (no end record); session 2
    starts 10 s later, resumes at 4: 5..7 are lost work, the gap and its start-up are restart."""
    clock = FakeClock()
    first = _ledger(tmp_path, clock, flush_interval_s=0.1)
    clock.advance(1.0)
    _train(first, clock, 7)  # every step flushes (1 s >= 0.1 s)
    del first  # killed: no close()
    clock.advance(10.0)
    second = _ledger(tmp_path, clock)  # its launcher starts now
    clock.advance(3.0)
    second.resumed(4)
    _train(second, clock, 8, start=5)  # 5..12
    summary = second.close()
    s = summary.seconds
    assert s[Bucket.STARTUP] == pytest.approx(1.0)
    assert s[Bucket.RESTART] == pytest.approx(13.0)  # fault -> next first step
    assert s[Bucket.LOST_WORK] == pytest.approx(3.0)
    assert s[Bucket.PRODUCTIVE] == pytest.approx(7.0 + 5.0)
    assert summary.wall_s == pytest.approx(summary.last - summary.first)
    assert [x.end_reason for x in summary.sessions] == [None, "finished"]
    assert summary.sessions[1].downtime_before_s == pytest.approx(10.0)
    assert summary.sessions[1].resumed_at == 4


def test_hang_fault_splits_the_gap_into_hang_and_restart(tmp_path) -> None:
    clock = FakeClock()
    first = _ledger(tmp_path, clock, flush_interval_s=0.1)
    _train(first, clock, 3)
    clock.advance(6.0)  # hung; the watchdog detects after 6 s (another process writes the fault)
    with open(tmp_path / GOODPUT_FILE, "a") as f:
        f.write(json.dumps({"k": "fault", "t": clock.t, "s": "monitor", "cause": "hang"}) + "\n")
    clock.advance(4.0)  # kill, torchrun restart
    second = _ledger(tmp_path, clock)
    clock.advance(1.0)
    _train(second, clock, 2, start=4)
    s = second.close().seconds
    assert s[Bucket.HANG] == pytest.approx(6.0)
    assert s[Bucket.RESTART] == pytest.approx(5.0)


def test_in_process_attempts_share_the_process_start(tmp_path) -> None:
    """An in-process attempt starts from the previous attempt's end (the process started long
    before); a failed step is lost work, the rest until the next first step restart."""
    clock = FakeClock()
    first = _ledger(tmp_path, clock)
    _train(first, clock, 2)
    with pytest.raises(RuntimeError), first.step(3):
        clock.advance(0.5)
        raise RuntimeError("peer died")
    clock.advance(0.2)  # abort
    first.close("fault", "RuntimeError")
    clock.advance(1.0)  # finalize, health check, rendezvous
    second = _ledger(tmp_path, clock, start=clock.t - 100.0, attempt=1)
    clock.advance(0.5)
    _train(second, clock, 2, start=1)  # resumed from scratch: 1, 2 again
    summary = second.close()
    s = summary.seconds
    assert s[Bucket.LOST_WORK] == pytest.approx(0.5 + 2.0)
    assert s[Bucket.RESTART] == pytest.approx(0.2 + 1.0 + 0.5)
    assert s[Bucket.PRODUCTIVE] == pytest.approx(2.0)
    assert summary.wall_s == pytest.approx(summary.last - summary.first)
    assert [x.attempt for x in summary.sessions] == [0, 1]


def test_hang_reported_in_process_makes_the_failed_step_a_hang(tmp_path) -> None:
    clock = FakeClock()
    ledger = _ledger(tmp_path, clock)
    _train(ledger, clock, 1)
    with pytest.raises(TimeoutError), ledger.step(2):
        clock.advance(30.0)
        ledger.fault("hang", "soft timeout")
        raise TimeoutError
    s = ledger.close("fault").seconds
    assert s[Bucket.HANG] == pytest.approx(30.0)


def test_relaunch_after_finished_is_a_new_segment(tmp_path) -> None:
    clock = FakeClock()
    first = _ledger(tmp_path, clock)
    _train(first, clock, 3)
    first.close()
    clock.advance(3600.0)  # the user comes back an hour later
    second = _ledger(tmp_path, clock)
    clock.advance(2.0)
    _train(second, clock, 3, start=1)  # a new run from scratch: not lost work
    summary = second.close()
    s = summary.seconds
    assert s[Bucket.RESTART] == 0.0 and s[Bucket.LOST_WORK] == 0.0
    assert s[Bucket.STARTUP] == pytest.approx(2.0)
    assert summary.excluded_s == pytest.approx(3600.0)
    assert "not counted: 3600.0 s" in format_table(summary)


def test_signal_exit_then_relaunch_counts_the_gap(tmp_path) -> None:
    clock = FakeClock()
    first = _ledger(tmp_path, clock)
    _train(first, clock, 3)
    with first.span(Bucket.CHECKPOINT):
        clock.advance(0.5)
    first.close("signal")
    clock.advance(20.0)
    second = _ledger(tmp_path, clock)
    clock.advance(2.0)
    _train(second, clock, 2, start=4)
    s = second.close().seconds
    assert s[Bucket.RESTART] == pytest.approx(22.0)
    assert s[Bucket.LOST_WORK] == 0.0


def test_reclassify_and_straggler_idle(tmp_path) -> None:
    clock = FakeClock()
    ledger = _ledger(tmp_path, clock)
    _train(ledger, clock, 2)
    with ledger.step(3) as step:
        clock.advance(4.0)
        step.reclassify(Bucket.COMPILE)
    _train(ledger, clock, 3, start=4)
    ledger.add_straggler_idle(0.75)
    _train(ledger, clock, 1, start=7)
    s = ledger.close().seconds
    assert s[Bucket.COMPILE] == pytest.approx(4.0)
    assert s[Bucket.STRAGGLER] == pytest.approx(0.75)
    assert s[Bucket.PRODUCTIVE] == pytest.approx(6.0 - 0.75)


def test_straggler_idle_seconds_is_the_mean_wait() -> None:
    assert straggler_idle_seconds([10.0, 10.0, 20.0, 10.0], 100) == pytest.approx(0.75)
    assert straggler_idle_seconds([], 10) == 0.0


def test_live_goodput_field(tmp_path) -> None:
    clock = FakeClock()
    ledger = _ledger(tmp_path, clock, start=clock.t - 1.0)
    _train(ledger, clock, 3)
    (field,) = ledger.log_fields(None)  # type: ignore[arg-type]
    assert field.key == "goodput" and field.value == pytest.approx(75.0)
    ledger.close()


def test_torn_last_record_is_skipped_and_the_next_session_stays_readable(tmp_path) -> None:
    clock = FakeClock()
    first = _ledger(tmp_path, clock, flush_interval_s=0.1)
    _train(first, clock, 3)
    path = tmp_path / GOODPUT_FILE
    with open(path, "ab") as f:
        f.write(b'{"k":"span","b":"productive","t0":1000003.0,"t1"')  # killed mid-write
    file = read_ledger(path)
    assert file.torn_tail and file.skipped == 0
    assert "torn" in " ".join(summarize(file).notes)
    second = _ledger(tmp_path, clock)
    _train(second, clock, 1, start=4)
    second.close()
    file = read_ledger(path)
    assert not file.torn_tail and file.skipped == 1  # the torn line, now ended by a newline
    assert summarize(file).sessions[-1].end_reason == "finished"


@pytest.mark.parametrize(
    "garbage",
    [
        b"\x00\xff\xfe binary\n",
        b"[1, 2, 3]\n",
        b'{"k":"span","b":"productive","t0":5,"t1":1}\n',  # negative duration
        b'{"k":"span","b":"productive","t0":NaN,"t1":1}\n',
        b'{"k":"span","b":"teleport","t0":1,"t1":2}\n',
        b'{"k":"span","b":"productive","t0":1,"t1":2,"idle":5}\n',
        b'{"k":"span","b":"productive","t0":1,"t1":1e300}\n',
        b'{"k":"end","t":"yesterday"}\n',
        b"[" * 100000 + b"\n",  # deep nesting / over-long line
        b'{"k":"span","b":"productive","t0":1,"t1":2,"it":-3}\n',
    ],
)
def test_hostile_lines_are_skipped(tmp_path, garbage) -> None:
    path = tmp_path / GOODPUT_FILE
    path.write_bytes(
        b'{"k":"span","b":"productive","t0":10,"t1":20,"s":"a"}\n'
        + garbage
        + b'{"k":"span","b":"evaluation","t0":20,"t1":21,"s":"a"}\n'
    )
    file = read_ledger(path)
    assert file.skipped == 1
    s = summarize(file).seconds
    assert s[Bucket.PRODUCTIVE] == 10.0 and s[Bucket.EVALUATION] == 1.0


def test_truncation_at_every_byte_never_breaks_the_reader(tmp_path) -> None:
    """A SIGKILL can stop a write after any byte: every prefix of a real ledger reads, with at
    most the last (torn) record lost."""
    clock = FakeClock()
    ledger = _ledger(tmp_path, clock, flush_interval_s=0.1)
    _train(ledger, clock, 3)
    ledger.close()
    data = (tmp_path / GOODPUT_FILE).read_bytes()
    complete = len(read_ledger(tmp_path / GOODPUT_FILE).records)
    cut = tmp_path / "cut.jsonl"
    for n in range(len(data) + 1):
        cut.write_bytes(data[:n])
        file = read_ledger(cut)
        assert file.skipped == 0
        assert len(file.records) == data[:n].count(b"\n") <= complete
        summarize(file)


def test_missing_file_and_directory_in_place_of_the_file(tmp_path) -> None:
    assert not read_ledger(tmp_path / "nope.jsonl").exists
    (tmp_path / "dir.jsonl").mkdir()
    assert read_ledger(tmp_path / "dir.jsonl").records == []


def test_null_ledger_and_factory(tmp_path) -> None:
    null = make_goodput_ledger(True, tmp_path, rank=1)
    assert isinstance(null, NullGoodputLedger)
    assert isinstance(make_goodput_ledger(False, tmp_path), NullGoodputLedger)
    assert isinstance(make_goodput_ledger(True, None), NullGoodputLedger)
    with null.step(1), null.span(Bucket.EVALUATION):
        pass
    assert null.log_fields(None) == [] and null.close() is None  # type: ignore[arg-type]
    assert not (tmp_path / GOODPUT_FILE).exists()


def test_process_start_time_is_this_process() -> None:
    psutil = pytest.importorskip("psutil")
    ours = process_start_time()
    assert ours is not None
    assert abs(ours - psutil.Process().create_time()) < 1.5  # psutil rounds the boot time
    assert ours <= time.time()
    assert process_start_time(2**22 + 12345) is None or True  # no such pid: None or psutil's


def test_format_duration() -> None:
    assert [format_duration(s) for s in (0.04, 4.25, 42, 130, 3720, 4000)] == [
        "0.0s", "4.2s", "42s", "2m10s", "1h02m", "1h07m",
    ]  # fmt: skip


def test_launcher_start_uses_torchrun_parent(monkeypatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    assert goodput_session.launcher_start_time() == pytest.approx(
        process_start_time(os.getppid()), abs=0.01
    )
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "garbage")
    assert goodput_session.torchrun_restart_count() == 0


_KILLED_WRITER = """
import sys, time
from stalwart.observability.goodput import Bucket, GoodputLedger
ledger = GoodputLedger(sys.argv[1], flush_interval_s=0.001)
it = 0
while True:
    it += 1
    with ledger.step(it):
        time.sleep(0.002)
    if it % 7 == 0:
        with ledger.span(Bucket.CHECKPOINT):
            time.sleep(0.001)
    if it == 50:
        print("ready", flush=True)
"""


def test_sigkilled_writer_leaves_a_readable_ledger(tmp_path) -> None:
    """A real writer SIGKILLed mid-run: every complete record reads, at most a torn tail is
    lost, and the next session accounts the gap as restart and finishes the file cleanly."""
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    killed_at = time.time()
    file = read_ledger(tmp_path / GOODPUT_FILE)
    assert file.skipped == 0 and len(file.records) > 50
    before = summarize(file)
    assert before.sessions[0].end_reason is None and before.sessions[0].last_iteration >= 50
    assert "no end record" in " ".join(before.notes)
    second = GoodputLedger(tmp_path, print_fn=lambda line: None)
    with second.step(1):
        pass
    after = second.close()
    assert after.seconds[Bucket.RESTART] >= time.time() - killed_at - 0.5
    assert after.seconds[Bucket.LOST_WORK] > 0  # iteration 1 was done before the kill
    assert after.wall_s == pytest.approx(after.last - after.first, abs=1e-3)
    assert [s.end_reason for s in after.sessions] == [None, "finished"]


def test_hang_reported_after_the_failed_step_is_a_hang(tmp_path) -> None:
    """In-process restart: the watchdog's interrupt ends the step first, the abort path reports
    the hang afterwards; the failed step still becomes hang, the teardown restart."""
    clock = FakeClock()
    ledger = _ledger(tmp_path, clock)
    _train(ledger, clock, 1)
    with pytest.raises(KeyboardInterrupt), ledger.step(2):
        clock.advance(20.0)
        raise KeyboardInterrupt  # stands in for RestartRequested (a BaseException)
    clock.advance(0.5)
    ledger.fault("hang", "no progress for 20s")
    clock.advance(1.0)
    s = ledger.close("fault").seconds
    assert s[Bucket.HANG] == pytest.approx(20.0) and s[Bucket.RESTART] == pytest.approx(1.5)
    assert s[Bucket.LOST_WORK] == 0.0 and s[Bucket.PRODUCTIVE] == pytest.approx(1.0)


def test_abandoned_step_is_not_done(tmp_path) -> None:
    clock = FakeClock()
    first = _ledger(tmp_path, clock)
    _train(first, clock, 2)
    with first.step(3) as step:  # the rerun state machine rejects iteration 3: exit 16
        clock.advance(2.0)
        step.abandon(Bucket.RERUN)
    first.close("rerun")
    second = _ledger(tmp_path, clock)
    _train(second, clock, 1, start=3)  # iteration 3 again: never completed, so not lost work
    s = second.close().seconds
    assert s[Bucket.RERUN] == pytest.approx(2.0) and s[Bucket.LOST_WORK] == 0.0


def test_log_step_writes_the_open_interval(tmp_path) -> None:
    clock = FakeClock()
    ledger = _ledger(tmp_path, clock)  # flush interval 5 s: steps alone would not write
    _train(ledger, clock, 2)
    ledger.log_fields(None)  # type: ignore[arg-type]
    spans = [r for r in read_ledger(tmp_path / GOODPUT_FILE).records if hasattr(r, "bucket")]
    assert spans[-1].bucket is Bucket.PRODUCTIVE and spans[-1].iteration == 2
    assert spans[-1].t1 == pytest.approx(clock.t)
    ledger.close()


def test_a_watchdogs_hang_record_makes_the_failed_step_a_hang(tmp_path) -> None:
    """The peer of a hung rank: its collective fails when the watchdog aborts the process
    group, after the watchdog (another process) appended its ``fault`` record. Hang runs to
    the detection; the second between it and the failure (the escalation) is restart."""
    clock = FakeClock()
    ledger = _ledger(tmp_path, clock)
    _train(ledger, clock, 1)
    with pytest.raises(RuntimeError), ledger.step(2):
        clock.advance(10.0)
        with open(tmp_path / GOODPUT_FILE, "a") as f:
            f.write(json.dumps({"k": "fault", "t": clock.t, "cause": "hang", "s": "m"}) + "\n")
        clock.advance(1.0)
        raise RuntimeError("Connection closed by peer")
    s = ledger.close("fault").seconds
    assert s[Bucket.HANG] == pytest.approx(10.0) and s[Bucket.LOST_WORK] == 0.0
    assert s[Bucket.RESTART] == pytest.approx(1.0)


@pytest.mark.parametrize("flush_s", [100.0, 0.3], ids=["no-flush", "flushes-in-between"])
def test_a_step_is_held_until_it_ends_and_ahead_work_is_the_next_steps(tmp_path, flush_s) -> None:
    """Step 1 (1 s) runs 0.25 s of step 2's work ahead; step 2 (1 s, with a 0.5 s nested rerun
    span) is abandoned: its own time and the work run ahead for it are ``rerun``. Step 3 runs
    0.25 s ahead for step 4, which is dropped: it stays with step 3 (productive; a clean run has
    no lost work); so does step 4's run ahead at the close. Step 5 runs ahead for step 6, which
    is abandoned as a capture (compile). The same with flushes (closes) in between."""
    clock = FakeClock()
    ledger = _ledger(tmp_path, clock, flush_interval_s=flush_s)
    ledger.resumed(0)
    with ledger.step(1):
        clock.advance(0.5)
        with ledger.ahead():
            clock.advance(0.25)
        clock.advance(0.25)
    clock.advance(0.1)  # the loop: productive
    with ledger.step(2) as span:
        clock.advance(0.25)
        with ledger.span(Bucket.RERUN):
            clock.advance(0.5)
        clock.advance(0.25)
        span.abandon(Bucket.RERUN)
    with ledger.step(3):
        clock.advance(0.5)
        with ledger.ahead():
            clock.advance(0.25)
        clock.advance(0.25)
    ledger.drop_ahead()  # e.g. settled before a save
    with ledger.step(4):
        clock.advance(0.5)
        with ledger.ahead():
            clock.advance(0.25)
        clock.advance(0.25)
    with ledger.step(5) as span:
        clock.advance(0.5)
        span.reclassify(Bucket.COMPILE)
    ledger.drop_ahead()
    with ledger.step(6):
        clock.advance(0.5)
        with ledger.ahead():
            clock.advance(0.25)
    summary = ledger.close()
    s = summary.seconds
    assert s[Bucket.PRODUCTIVE] == pytest.approx(0.75 + 0.1 + 1.0 + 0.75 + 0.75)
    assert s[Bucket.RERUN] == pytest.approx(0.25 + 1.0)
    assert s[Bucket.COMPILE] == pytest.approx(0.25 + 0.5)  # step 4's work ahead for it, too
    assert s[Bucket.LOST_WORK] == 0.0
    assert sum(s.values()) == pytest.approx(summary.wall_s) == pytest.approx(5.35)
    assert summary.sessions[0].last_iteration == 6
    assert not summary.notes  # no overlap, nothing skipped


def test_an_accepted_step_writes_nothing_of_its_own(tmp_path) -> None:
    """The hot path: accepted steps in one bucket (with look-ahead work) leave one open
    interval; nothing is written until a switch or a flush."""
    clock = FakeClock()
    ledger = _ledger(tmp_path, clock)
    ledger.resumed(0)
    with ledger.step(1):
        clock.advance(0.1)
    size = (tmp_path / GOODPUT_FILE).stat().st_size
    for it in range(2, 12):
        with ledger.step(it):
            clock.advance(0.05)
            with ledger.ahead():
                clock.advance(0.05)
    assert (tmp_path / GOODPUT_FILE).stat().st_size == size


def test_work_run_ahead_then_dropped_in_a_save_stays_productive_and_leaves_no_hole(
    tmp_path,
) -> None:
    """A save after step 1 (its span closes the open interval, cutting out the work run ahead
    for step 2), then the launch is dropped (the save settles the step): that work is
    productive, not checkpoint time. A flush never writes past held work, so a kill leaves a
    suffix unwritten, never a hole."""
    clock = FakeClock()
    ledger = _ledger(tmp_path, clock, flush_interval_s=0.1)
    ledger.resumed(0)
    with ledger.step(1):
        clock.advance(0.5)
        with ledger.ahead():
            clock.advance(0.25)
    with ledger.span(Bucket.CHECKPOINT):
        ledger.drop_ahead()
        clock.advance(0.5)
    with ledger.step(2):
        clock.advance(0.5)
        with ledger.ahead():
            clock.advance(0.25)
    clock.advance(0.5)
    ledger.log_fields(None)  # type: ignore[arg-type]  # a log step flushes
    written = summarize(read_ledger(tmp_path / GOODPUT_FILE))  # as a SIGKILL now would leave it
    assert written.excluded_s == 0.0 and written.last == pytest.approx(clock.t - 0.75)
    s = ledger.close().seconds
    assert s[Bucket.CHECKPOINT] == pytest.approx(0.5)
    assert s[Bucket.PRODUCTIVE] == pytest.approx(0.75 + 0.75 + 0.5)
