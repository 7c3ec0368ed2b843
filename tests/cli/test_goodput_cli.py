"""``stalwart goodput RUN_DIR [--json]`` and the report's goodput section."""

from __future__ import annotations

import json

from stalwart.cli.main import main
from stalwart.observability.goodput import Bucket, GoodputLedger
from stalwart.observability.goodput.records import GOODPUT_FILE
from stalwart.report.run_report import write_report


class _Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


def _two_sessions(run_dir) -> None:
    clock = _Clock()
    first = GoodputLedger(
        run_dir, clock=clock, launcher_start=clock.t, print_fn=lambda s: None, flush_interval_s=0.5
    )
    clock.t += 2.0
    for it in (1, 2, 3):
        with first.step(it):
            clock.t += 1.0
    del first  # killed
    clock.t += 5.0
    second = GoodputLedger(run_dir, clock=clock, launcher_start=clock.t, print_fn=lambda s: None)
    clock.t += 1.0
    second.resumed(2)
    for it in (3, 4):
        with second.step(it):
            clock.t += 1.0
    with second.span(Bucket.CHECKPOINT):
        clock.t += 0.5
    second.close()


def test_table_and_json(tmp_path, capsys) -> None:
    _two_sessions(tmp_path)
    assert main(["goodput", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        "goodput: 29.6% (productive 4.0s of 14s; lost: restart 6.0s, startup 2.0s, lost work 1.0s,"
    )
    assert "lost work" in out and "no end record" in out and "finished" in out
    assert main(["goodput", str(tmp_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["seconds"]["restart"] == 6.0 and data["seconds"]["lost_work"] == 1.0
    assert data["wall_s"] == 13.5 and len(data["sessions"]) == 2


def test_bad_run_dirs_exit_2_with_one_line(tmp_path, capsys) -> None:
    assert main(["goodput", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a directory" in err
    assert main(["goodput", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no goodput.jsonl" in err
    assert main(["goodput"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_garbage_ledger_prints_what_it_could_read(tmp_path, capsys) -> None:
    (tmp_path / GOODPUT_FILE).write_bytes(b"\x00\x01garbage\n{not json\n" + b"x" * 100)
    assert main(["goodput", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "2 unreadable record(s) skipped" in out and "torn" in out


def test_report_has_the_goodput_section(tmp_path) -> None:
    _two_sessions(tmp_path)
    page = write_report(tmp_path, pngs=False).read_text()
    assert '<section id="goodput">' in page and "goodput: 29.6%" in page
    assert page.count("<rect") > 5 and "session 1" in page
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text('{"iteration": 1, "lm loss": 1.0}\n')  # a run, no ledger
    assert "goodput.jsonl: not available" in write_report(empty, pngs=False).read_text()
