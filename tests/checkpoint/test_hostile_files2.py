"""Hostile files in checkpoint and run directories, round 2: a FIFO or a device planted under the
name of a file stalwart reads made the reader wait forever (a hung resume, a hung
``stalwart checkpoints``); ``--verify`` passed a tracker that a resume refuses.

Every reader of a file in a ``--save``/run directory now opens it with
`stalwart.regular_file.open_regular`; each case below must end at once (an alarm fails it) and
report the file as unreadable the way that reader reports a corrupt one.
"""

from __future__ import annotations

import doctest
import logging
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from stalwart.checkpoint import CheckpointError, layout
from stalwart.cli.main import main


class Hung(BaseException):
    """Raised by the alarm: not an OSError (TimeoutError is one), so no reader swallows it."""


@pytest.fixture(autouse=True)
def no_hang() -> Iterator[None]:
    def hang(*_: object) -> None:
        raise Hung("the case hung (a FIFO read?)")

    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def _fifo(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    return path


def _tracker(d: Path) -> Any:
    with pytest.raises(CheckpointError, match="not a regular file"):
        layout.read_tracker(str(d))


def _state(d: Path) -> Any:
    from stalwart.checkpoint.safe_state import read_state_file

    with pytest.raises(OSError, match="not a regular file"):
        read_state_file(str(d / "iter_0000002" / "rank_00000.json"))


def _dcp(d: Path) -> Any:
    from stalwart.checkpoint.dcp_safe import read_dcp_metadata

    with pytest.raises(CheckpointError, match="not a regular file"):
        read_dcp_metadata(d / "iter_0000002")


def _marker(d: Path) -> Any:
    assert layout.written_as(str(d / "iter_0000002"), non_persistent=False) is False


def _exit_reason(d: Path) -> Any:
    from stalwart.reliability.exit import read_exit_reason

    record, why = read_exit_reason(d)
    assert record is None and "unreadable" in why


def _ledger(d: Path) -> Any:
    from stalwart.observability.goodput.reader import read_ledger

    assert read_ledger(d / "goodput.jsonl").records == []


def _jsonl(d: Path) -> Any:
    from stalwart.report.clean import read_json, read_jsonl

    notes: list[str] = []
    assert (
        read_jsonl(d / "metrics.jsonl", notes) == [] and read_json(d / "memory.json", notes) is None
    )
    assert len(notes) == 2 and all("unreadable" in n for n in notes), notes


def _manifest(d: Path) -> Any:
    from stalwart.observability.run_dir import read_manifest

    assert read_manifest(d) == {}


def _ft_state(d: Path) -> Any:
    from stalwart.reliability.hang.timeouts import load_ft_state

    assert load_ft_state(d / "ft_state.json") is None


def _progress(d: Path) -> Any:
    from stalwart.observability.progress_log import ProgressLog

    assert ProgressLog(d, world_size=1)._entries() == []


# (file planted as a FIFO, the reader that hung on it)
READERS: list[tuple[str, Callable[[Path], Any]]] = [
    (layout.TRACKER_FILENAME, _tracker),
    ("iter_0000002/rank_00000.json", _state),
    ("iter_0000002/.metadata", _dcp),
    ("iter_0000002/COMPLETE", _marker),
    ("exit_reason.json", _exit_reason),
    ("goodput.jsonl", _ledger),
    ("metrics.jsonl", _jsonl),
    ("run.json", _manifest),
    ("ft_state.json", _ft_state),
    ("progress.txt", _progress),
]


@pytest.mark.parametrize(("name", "read"), READERS, ids=[n for n, _ in READERS])
def test_a_planted_fifo_is_unreadable_not_a_hang(
    tmp_path: Path, name: str, read: Callable[[Path], Any], caplog: pytest.LogCaptureFixture
) -> None:
    _fifo(tmp_path / name)
    if name == "metrics.jsonl":
        _fifo(tmp_path / "memory.json")
    with caplog.at_level(logging.WARNING):
        read(tmp_path)


def test_checkpoints_lists_a_directory_of_fifos(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in (layout.TRACKER_FILENAME, "exit_reason.json", "iter_0000002/metadata.json"):
        _fifo(tmp_path / name)
    (tmp_path / "iter_0000002" / layout.COMPLETE_MARKER).write_text("{}")
    assert main(["checkpoints", str(tmp_path), "--verify"]) == 1
    out = capsys.readouterr().out
    assert "BROKEN tracker" in out and "not a regular file (a FIFO)" in out, out
    assert "iter_0000002  complete" in out and "last exit: unknown" in out, out


@pytest.mark.parametrize(
    ("tracker", "needle"),
    [
        (b"garbage\n", "BROKEN tracker"),  # found: --verify said 0, the resume refuses it
        (b"7\n", "the tracked checkpoint iter_0000007 is missing"),  # found: exit 0
        (b"9" * 40 + b"\n", "is missing"),
    ],
)
def test_verify_fails_a_tracker_that_a_resume_refuses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tracker: bytes, needle: str
) -> None:
    (tmp_path / layout.TRACKER_FILENAME).write_bytes(tracker)
    assert main(["checkpoints", str(tmp_path), "--verify"]) == 1
    assert needle in capsys.readouterr().out
    assert main(["checkpoints", str(tmp_path)]) == 1  # listing alone too (issue 29, item 10)


def test_devices_and_directories_are_refused_as_files(tmp_path: Path) -> None:
    from stalwart.regular_file import open_regular

    with pytest.raises(OSError, match="a character device"):
        open_regular("/dev/zero")
    with pytest.raises(IsADirectoryError):
        open_regular(tmp_path)
    with pytest.raises(FileNotFoundError):
        open_regular(tmp_path / "nope")
    (tmp_path / "f").write_bytes(b"ok")
    os.symlink(tmp_path / "f", tmp_path / "link")  # a link to a regular file reads it
    with open_regular(tmp_path / "link") as f:
        assert f.read() == b"ok"


def test_regular_file_docstring_example_runs() -> None:
    import stalwart.regular_file

    flags = doctest.ELLIPSIS
    assert doctest.testmod(stalwart.regular_file, optionflags=flags).failed == 0
