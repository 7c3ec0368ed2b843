"""progress.txt (--log-progress) read back at every save: a bad date (year 1), a NaN, garbage
lines are skipped with one warning naming the file and the line, never an error after the
checkpoint committed, never a NaN in a later throughput line."""

from __future__ import annotations

import datetime as dt
import logging
import math
from pathlib import Path

import pytest

from stalwart.cli.main import main
from stalwart.observability.progress_log import (
    PROGRESS_FILE,
    SAVED,
    STARTING,
    ProgressLog,
    cumulative_start,
    format_line,
    parse_line,
    saved_message,
)

from train_utils import TINY_FLAGS

NOW = dt.datetime.now().replace(microsecond=0)
HOSTILE = {
    "year 1": "0001-01-01 00:00:00\tJob ID: 1\t# GPUs: 1\tStarting job",
    "year 9999": "9999-12-31 23:59:59\tJob ID: 1\t# GPUs: 1\tStarting job",
    "NaN operations": format_line(NOW, "1", 1, saved_message(2, 1.0, 1.0, 1e12, 1e6, False))
    .replace("1.00e+12", "nan"),
    "infinite operations": format_line(NOW, "1", 1, saved_message(2, 1.0, 1.0, 1e12, 1e6, False))
    .replace("1.00e+12", "inf"),
    "huge world": format_line(NOW, "1", 1, STARTING).replace("# GPUs: 1", "# GPUs: " + "9" * 5000),
    "zero world": format_line(NOW, "1", 1, STARTING).replace("# GPUs: 1", "# GPUs: 0"),
    "garbage": "\x00\xff binary garbage",
    "short save": format_line(NOW, "1", 1, SAVED),
}  # fmt: skip


def _values(line: str) -> dict[str, str]:
    return dict(t.split(": ", 1) for t in line.split("\t")[1:] if ": " in t)


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_line_is_skipped_with_one_warning(tmp_path: Path, caplog, name: str) -> None:
    path = tmp_path / PROGRESS_FILE
    # Taken now, not at import: under xdist a test may run minutes after its module was collected.
    good = format_line(
        dt.datetime.now().replace(microsecond=0) - dt.timedelta(hours=1), "1", 1, STARTING
    )
    path.write_text(f"{HOSTILE[name]}\n{good}\n")
    with pytest.raises(ValueError):
        parse_line(HOSTILE[name])
    assert cumulative_start(path.read_text().splitlines(), 1)[0] is not None
    caplog.set_level(logging.WARNING)
    log = ProgressLog(tmp_path, world_size=1)
    log.start(flops_so_far=0.0)
    log.on_save(iteration=2, flops_so_far=3.6e15, tokens=1e6, async_save=False)
    log.on_save(iteration=4, flops_so_far=7.2e15, tokens=2e6, async_save=False)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and str(path) in warnings[0] and "line 1" in warnings[0], warnings
    saves = [_values(ln) for ln in path.read_text().splitlines()[3:]]
    assert len(saves) == 2
    for save in saves:
        cumulative = float(save["Cumulative throughput"].split()[0])
        assert math.isfinite(cumulative) and math.isfinite(float(save["Job throughput"].split()[0]))
    # counted from the valid start an hour ago: 7.2e15 / 3600 s = 2.0 TFLOP/s/GPU
    assert float(saves[1]["Cumulative throughput"].split()[0]) == pytest.approx(2.0, abs=0.1)


def test_training_with_a_year_one_progress_file_keeps_going(tmp_path: Path, caplog) -> None:
    save = tmp_path / "save"
    save.mkdir()
    (save / PROGRESS_FILE).write_text(HOSTILE["year 1"] + "\n" + HOSTILE["NaN operations"] + "\n")
    caplog.set_level(logging.WARNING)
    flags = ["--train-iters", "4", "--save", str(save), "--save-interval", "2", "--log-progress"]
    assert main(["train", *TINY_FLAGS, *flags]) == 0
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "4\n"
    lines = (save / PROGRESS_FILE).read_text().splitlines()
    saves = [_values(ln) for ln in lines[2:] if SAVED in ln]
    assert [s["Iteration"] for s in saves] == ["2", "4"]
    assert all("nan" not in s["Cumulative throughput"] for s in saves), saves
    warnings = [r.getMessage() for r in caplog.records if PROGRESS_FILE in r.getMessage()]
    assert len(warnings) == 1 and "line 1" in warnings[0] and "line 2" in warnings[0], warnings


def test_a_torn_last_line_does_not_swallow_the_starting_line(tmp_path: Path) -> None:
    """Appended to a last line without a newline, the job's own `Starting job` line was glued
    to the garbage and lost: the cumulative throughput silently counted from elsewhere."""
    path = tmp_path / PROGRESS_FILE
    earlier = NOW - dt.timedelta(hours=1)
    path.write_text(format_line(earlier, "1", 2, STARTING) + "\ntorn garbage, no newline")
    log = ProgressLog(tmp_path, world_size=1)
    log.start(flops_so_far=0.0)
    log.on_save(iteration=2, flops_so_far=1e12, tokens=1e6, async_save=False)
    lines = path.read_text().splitlines()
    assert lines[1] == "torn garbage, no newline" and lines[2].endswith("\tStarting job")
    assert cumulative_start(lines, world_size=1)[0] is not None
