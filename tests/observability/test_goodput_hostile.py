"""Absurd records in goodput.jsonl (out of range, non-finite, wrong type, out of order): each is
skipped at the one reader with one warning naming the file and line, and nothing else breaks:
the live ledger, `stalwart goodput` (table and JSON) and the report's goodput section."""

from __future__ import annotations

import json
import logging
import time

import pytest

from stalwart.cli.main import main
from stalwart.observability.goodput import Bucket, GoodputLedger
from stalwart.observability.goodput.reader import read_ledger
from stalwart.observability.goodput.records import GOODPUT_FILE, format_table, summarize
from stalwart.report.goodput import goodput_section

NOW = time.time()
GOOD = [
    {"k": "session", "t": NOW - 100, "s": "a", "pid": 1},
    {"k": "span", "b": "startup", "t0": NOW - 101, "t1": NOW - 99, "s": "a"},
    {"k": "span", "b": "productive", "t0": NOW - 99, "t1": NOW - 90, "s": "a", "it": 4},
]
ABSURD = {
    "session at 1e308": {"k": "session", "t": 1e308, "s": "b", "pid": 2},
    "span at 1e308": {"k": "span", "b": "productive", "t0": 1e308, "t1": 1e308, "s": "a"},
    "integer beyond a float": {"k": "end", "t": 10**400, "s": "a", "reason": "x"},
    "a year ahead": {"k": "end", "t": NOW + 3.2e7, "s": "a", "reason": "finished"},
    "negative": {"k": "resume", "t": -5.0, "s": "a", "it": 1},
    "string time": {"k": "fault", "t": "yesterday", "s": "a"},
    "bool time": {"k": "fault", "t": True, "s": "a"},
    "infinite": {"k": "span", "b": "productive", "t0": NOW - 90, "t1": "Infinity", "s": "a"},
    "overlap (out of order)": {
        "k": "span",
        "b": "evaluation",
        "t0": NOW - 95,
        "t1": NOW - 94,
        "s": "a",
    },
    "before its session": {"k": "end", "t": NOW - 500, "s": "a", "reason": "finished"},
    "second session start": {"k": "session", "t": NOW - 80, "s": "a", "pid": 1},
    "idle NaN": {
        "k": "span",
        "b": "productive",
        "t0": NOW - 90,
        "t1": NOW - 89,
        "s": "a",
        "idle": "NaN",
    },
}


def _plant(run_dir, bad) -> None:
    lines = [json.dumps(r) for r in GOOD] + [json.dumps(bad).replace('"NaN"', "NaN")]
    lines = [ln.replace('"Infinity"', "Infinity") for ln in lines]
    (run_dir / GOODPUT_FILE).write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("name", list(ABSURD))
def test_absurd_record_is_skipped_with_one_warning_naming_file_and_line(
    tmp_path, caplog, capsys, name
) -> None:
    _plant(tmp_path, ABSURD[name])
    file = read_ledger(tmp_path / GOODPUT_FILE)
    assert len(file.records) == 3 and [n for n, _ in file.bad_lines] == [4], file.bad_lines
    caplog.set_level(logging.WARNING)
    lines: list[str] = []
    ledger = GoodputLedger(tmp_path, print_fn=lines.append)  # the resume's constructor
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert str(tmp_path / GOODPUT_FILE) in warnings[0] and "line 4" in warnings[0]
    with ledger.step(5):
        pass
    summary = ledger.close()  # no second warning at close
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1
    assert summary.seconds[Bucket.PRODUCTIVE] >= 9.0  # the earlier session's data is kept
    assert summary.sessions[0].last_iteration == 4 and len(lines) == 1
    assert "line 4" in format_table(summarize(read_ledger(tmp_path / GOODPUT_FILE)))
    assert main(["goodput", str(tmp_path)]) == 0
    assert main(["goodput", str(tmp_path), "--json"]) == 0
    out = capsys.readouterr().out
    assert "line 4" in out and json.loads(out[out.index("\n{") :])["seconds"]["productive"] >= 9
    assert "Goodput" in goodput_section(tmp_path)


def test_a_far_future_record_does_not_swallow_the_next_session(tmp_path) -> None:
    """Accepted, a record a year ahead moved the next session's start past every one of its
    own intervals: the resumed run wrote no span at all."""
    _plant(tmp_path, ABSURD["a year ahead"])
    ledger = GoodputLedger(tmp_path, print_fn=lambda s: None, launcher_start=time.time() - 2)
    with ledger.step(5):
        time.sleep(0.01)
    summary = ledger.close()
    assert summary.sessions[-1].last_iteration == 5
    assert summary.seconds[Bucket.RESTART] > 80  # the gap since the first session's last span


def test_report_survives_an_absurd_ledger(tmp_path, capsys) -> None:
    _plant(tmp_path, ABSURD["session at 1e308"])
    (tmp_path / "metrics.jsonl").write_text('{"split": "train", "iteration": 1, "lm loss": 1.0}\n')
    assert main(["report", str(tmp_path), "--no-png", "--static"]) == 0
    html = (tmp_path / "report.html").read_text()
    assert "line 4" in html and "Traceback" not in capsys.readouterr().err


def test_resume_goes_on_past_an_absurd_record(tmp_path, caplog) -> None:
    from train_utils import TINY_FLAGS

    save = tmp_path / "save"
    train = [*TINY_FLAGS, "--seed", "5", "--save", str(save), "--save-interval", "2"]
    train += ["--lr-decay-iters", "10"]
    assert main(["train", *train, "--train-iters", "2"]) == 0
    with open(save / GOODPUT_FILE, "a") as f:
        f.write(json.dumps(ABSURD["session at 1e308"]) + "\n")
    before = summarize(read_ledger(save / GOODPUT_FILE)).seconds[Bucket.PRODUCTIVE]
    caplog.set_level(logging.WARNING)
    assert main(["train", *train, "--train-iters", "4"]) == 0
    assert any("goodput.jsonl" in r.getMessage() and "line" in r.getMessage()
               for r in caplog.records)  # fmt: skip
    summary = summarize(read_ledger(save / GOODPUT_FILE))
    assert summary.sessions[-1].last_iteration == 4 and summary.sessions[-1].resumed_at == 2
    assert summary.seconds[Bucket.PRODUCTIVE] > before > 0


def test_two_writers_at_once_keep_every_record_and_say_so(tmp_path) -> None:
    """Two jobs sharing one --run-dir: their lines interleave; each session's own order holds,
    so nothing is skipped, and the summary names the overlap."""
    t = [time.time() - 50]
    clock = lambda: t[0]  # noqa: E731
    a = GoodputLedger(tmp_path, clock=clock, launcher_start=t[0], print_fn=lambda s: None)
    b = GoodputLedger(tmp_path, clock=clock, launcher_start=t[0], print_fn=lambda s: None)
    for it in range(1, 4):
        for ledger in (a, b):
            with ledger.step(it):
                t[0] += 1.0
    a.close()
    summary = b.close()
    file = read_ledger(tmp_path / GOODPUT_FILE)
    assert file.bad_lines == [] and len(summary.sessions) == 2
    assert any("overlap" in note for note in summary.notes), summary.notes
