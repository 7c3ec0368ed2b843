"""What an interactive ``stalwart train`` shows on a terminal (a pty): the bar ends before the
exit and goodput lines, which get lines of their own; a 0-column terminal still gets a bar;
Ctrl-C is one line; nothing routine is a WARNING, and INFO lines only with --verbose; a run
without --save has a run directory; ``make demo``'s first screen is short."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import signal
import struct
import sys
import termios
import time
from pathlib import Path

import pytest

from train_utils import REPO, TINY_FLAGS

FLAGS = [f for f in TINY_FLAGS if f != "--no-progress-bar"]  # the bar shows on a terminal
BAR = re.compile(r"\d+/\d+ \[|\] +\d+/\d+ ")  # tqdm's "6/6 [00:01<..." or the plain "] 6/6 "


def _pty_run(
    args: list[str], cwd: Path, *, cols: int = 100, interrupt_on: str | None = None
) -> tuple[int, str]:
    """Run ``python -m stalwart ARGS`` on a pty of ``cols`` columns; returns (exit code, output).
    ``interrupt_on``: send SIGINT once this text has been printed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src")}
    pid, fd = pty.fork()
    if pid == 0:  # the child: the pty is its terminal
        os.chdir(cwd)
        os.execvpe(sys.executable, [sys.executable, "-m", "stalwart", *args], env)
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, cols, 0, 0))
    out, sent, deadline = b"", False, time.monotonic() + 240
    while time.monotonic() < deadline:
        if interrupt_on and not sent and interrupt_on.encode() in out:
            os.kill(pid, signal.SIGINT)
            sent = True
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                data = os.read(fd, 65536)
            except OSError:  # the child closed the pty
                break
            if not data:
                break
            out += data
    else:
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), out.decode(errors="replace")


def _screen(raw: str) -> list[str]:
    """The lines left on the terminal: each line's text after its last carriage return (a
    redraw), control sequences removed."""
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", raw)
    return [line.split("\r")[-1].rstrip() for line in text.replace("\r\n", "\n").split("\n")]


@pytest.mark.parametrize("cols", [100, 0])
def test_the_bar_ends_before_the_exit_and_goodput_lines(tmp_path: Path, cols: int) -> None:
    args = ["train", *FLAGS, "--train-iters", "6", "--log-interval", "3"]
    code, raw = _pty_run([*args, "--save", str(tmp_path / "run")], tmp_path, cols=cols)
    assert code == 0, raw[-2000:]
    screen = _screen(raw)
    bars = [line for line in screen if BAR.search(line)]
    assert len(bars) == 1 and "6/6" in bars[0], screen  # one bar; with 0 columns, the plain one
    exit_line = next(i for i, line in enumerate(screen) if line.startswith("exiting program"))
    goodput = next(i for i, line in enumerate(screen) if line.startswith("goodput: "))
    assert screen.index(bars[0]) < exit_line < goodput  # own lines, below the finished bar
    tail = raw[raw.index("exiting program") :]
    assert not BAR.search(tail), "the bar was drawn again after the run ended"
    assert " WARNING " not in raw, [line for line in screen if "WARNING" in line]
    assert " INFO " not in raw, [line for line in screen if "INFO" in line]  # --verbose shows them
    assert f"saved checkpoint iteration 6 to {tmp_path / 'run'}/iter_0000006 in " in raw  # a notice


def test_ctrl_c_prints_one_line(tmp_path: Path) -> None:
    args = ["train", *FLAGS, "--train-iters", "100000", "--log-interval", "1"]
    code, raw = _pty_run(
        [*args, "--save", str(tmp_path / "run")], tmp_path, interrupt_on="iteration 2/"
    )
    assert code == 130, raw[-2000:]
    screen = _screen(raw)
    about = [line for line in screen if re.search(r"interrupt|SIGINT|exit", line, re.I)]
    assert len(about) == 1, about
    assert about[0].startswith("interrupted (Ctrl-C): exiting program at iteration ")
    assert about[0].endswith("with code 130")
    assert " ERROR " not in raw


def test_a_run_without_save_names_its_run_directory_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("STALWART_RUNS_DIR", raising=False)  # the default: ./runs
    code, raw = _pty_run(["train", *FLAGS, "--train-iters", "3", "--log-interval", "3"], tmp_path)
    assert code == 0, raw[-2000:]
    (run,) = (tmp_path / "runs").iterdir()
    first = _screen(raw)[0]
    assert first.startswith(f"stalwart train: run directory runs/{run.name} "), first
    assert (run / "metrics.jsonl").read_text().count('"split": "train"') == 2  # iterations 1 and 3
    assert (run / "goodput.jsonl").is_file()


def _demo_command() -> list[str]:
    """``make demo``'s ``stalwart train`` flags, read from the Makefile (so the test follows it)."""
    text = (REPO / "Makefile").read_text().replace("\\\n", " ")
    target = text[text.index("\ndemo:") :]
    line = next(ln for ln in target.splitlines() if "stalwart train " in ln)
    return line.split("stalwart train ", 1)[1].split()


def test_the_demos_first_screen_is_short(tmp_path: Path) -> None:
    """The first screen of ``make demo`` (an 80-column terminal): under 10 rows before the
    progress bar or the first iteration line, none of them a wall of text."""
    args = _demo_command()
    assert "--demo" in args and args[args.index("--save") + 1] == "runs/demo", args
    code, raw = _pty_run(["train", *args, "--train-iters", "2"], tmp_path, cols=80)
    assert code == 0, raw[-2000:]
    screen = _screen(raw)
    first = next(i for i, line in enumerate(screen) if BAR.search(line) or "iteration 1/" in line)
    before = [line for line in screen[:first] if line.strip()]
    rows = sum(max(1, -(-len(line) // 80)) for line in before)  # wrapped at 80 columns
    assert rows < 10, before
    assert before[0] == "stalwart train: run directory runs/demo (then: stalwart report runs/demo)"
    assert not any(" INFO " in line or "WARNING" in line for line in before), before
    line = next(line for line in screen if "iteration 1/2 |" in line)
    assert len(line) < 160, line  # Megatron's line of the demo: 572 characters
