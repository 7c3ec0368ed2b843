"""The progress bar: plain fallback, and tqdm on a real pseudo-terminal with log lines above it."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

from stalwart.observability.progress import ProgressBar

# A child run of TrainingLog on a terminal: INFO lines and iteration lines must land above the bar.
CHILD = textwrap.dedent(
    """
    import logging, sys, time
    import torch
    from stalwart.observability.sinks import NullSink
    from stalwart.observability.timer_names import INTERVAL_TIME
    from stalwart.observability.timers import TimingLogOption, Timers
    from stalwart.observability.train_log import LogConfig, TrainingLog

    logging.basicConfig(level=logging.INFO, format="INFO %(message)s")
    timers = Timers(0, TimingLogOption.MAX)
    log = TrainingLog(LogConfig(log_interval=10, log_timestamp=False), train_iters=40,
                      sink=NullSink(), timers=timers, rank=0, world_size=1, seq_length=128)
    assert log._progress.enabled  # auto: stdout is a terminal
    if sys.argv[1] == "plain":
        log._progress._tqdm_cls = None  # as if tqdm were not installed
    assert log._progress.uses_tqdm == (sys.argv[1] == "tqdm")
    timers(INTERVAL_TIME).start()
    for it in range(1, 41):
        time.sleep(0.01)
        log.on_iteration(it, losses={"lm loss": torch.tensor(9.0 - it / 10)}, learning_rate=0.1,
                         global_batch_size=8, consumed_samples=8 * it, grad_norm=None,
                         skipped=False)
        if it == 15:
            logging.getLogger("stalwart.test").info("MESSAGE FROM THE LOGGER")
        if it == 20:
            log.on_eval(20, {"lm loss": 6.5})
        time.sleep(0.12 if it in (25, 26) else 0.0)
    log.close()
    """
)


def _screen(raw: str, width: int) -> list[str]:
    """A minimal terminal: \\r, \\n, cursor up (ESC[A), erase line (ESC[K / ESC[2K), overwrite."""
    rows: list[list[str]] = [[]]
    row = col = 0
    for token in re.findall(r"\x1b\[[0-9;]*[A-Za-z]|\r|\n|[^\x1b\r\n]", raw):
        if token == "\r":
            col = 0
        elif token == "\n":
            row, col = row + 1, 0
            while len(rows) <= row:
                rows.append([])
        elif token.startswith("\x1b["):
            code = token[-1]
            if code == "A":
                row = max(row - int(token[2:-1] or 1), 0)
            elif code == "K":
                del rows[row][0 if token[2:-1] == "2" else col :]
        else:
            line = rows[row]
            line.extend(" " * (col - len(line) + 1))
            line[col] = token
            col = min(col + 1, width - 1)
    return ["".join(r).rstrip() for r in rows]


def _run_on_pty(backend: str) -> tuple[list[str], str]:
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 160, 0, 0))
    env = dict(os.environ, COLUMNS="160", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, backend], stdin=slave, stdout=slave, stderr=slave, env=env
    )
    os.close(slave)
    chunks = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert proc.wait(timeout=30) == 0, b"".join(chunks).decode(errors="replace")
    raw = b"".join(chunks).decode(errors="replace")
    return _screen(raw, 160), raw


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["tqdm", "plain"])
def test_bar_on_a_terminal_keeps_log_lines_above(backend: str) -> None:
    if backend == "tqdm":
        pytest.importorskip("tqdm")
    screen, _raw = _run_on_pty(backend)
    lines = [row for row in screen if row.strip()]
    bar_rows = [i for i, row in enumerate(lines) if "40/40" in row and "iteration" not in row]
    assert bar_rows == [len(lines) - 1], lines  # the bar is the last row, drawn once at the end
    bar = lines[-1]
    assert re.search(r"100(\.0)?%", bar) and "it/s" in bar and "tok/s" in bar, bar
    assert "lm loss 5" in bar and "val 6.5" in bar, bar  # last logged loss, last validation loss
    assert re.search(r"\d\d:\d\d<", bar), bar  # elapsed<ETA
    # Every log line is a whole row of its own: nothing of the bar is mixed into it.
    logged = lines[:-1]
    assert any(row == "INFO MESSAGE FROM THE LOGGER" for row in logged), logged
    iteration_rows = [row for row in logged if row.startswith("iteration")]  # compact lines
    assert len(iteration_rows) == 5, logged  # iterations 1, 10, 20, 30, 40
    assert any(row.startswith("validation at iteration 20") for row in logged), logged
    for row in logged:
        assert "it/s" not in row and "%|" not in row and "[#" not in row, row


def test_plain_bar_fields_and_resume_rate() -> None:
    out = io.StringIO()
    bar = ProgressBar(
        1000, enabled=True, stream=out, use_tqdm=False, tokens_per_iteration=2048, min_interval_s=0
    )
    bar.update(500)  # a resumed run: the clock starts here, not at iteration 0
    time.sleep(0.05)
    bar.update(510)
    bar.set_stats(loss=3.25, val_loss=3.5, loss_name="lm loss")
    text = bar.render()
    rate = bar.rate()
    assert rate is not None and 10 / 1.0 < rate < 10 / 0.04  # 10 iterations in ~50 ms
    assert " 510/1000  51.0%" in text and "it/s]" in text and "tok/s " in text
    assert "lm loss 3.25" in text and "val 3.5" in text
    bar.write("a line")
    assert "a line\n" in out.getvalue()
    bar.close()


def test_disabled_bar_is_silent_and_restores_logging() -> None:
    import logging

    root = logging.getLogger()
    before = list(root.handlers)
    bar = ProgressBar(10, enabled=True, stream=io.StringIO(), use_tqdm=False)
    handler = logging.StreamHandler(io.StringIO())
    root.addHandler(handler)
    try:
        bar.update(1)
        assert handler not in root.handlers  # wrapped while the bar is open
        bar.close()
        assert handler in root.handlers
    finally:
        root.removeHandler(handler)
    assert root.handlers == before
    off = io.StringIO()
    quiet = ProgressBar(10, stream=off)
    quiet.update(3)
    quiet.write("x")
    quiet.close()
    assert off.getvalue() == "x\n"
