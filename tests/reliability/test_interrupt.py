"""Ctrl-C: the handler records SIGINT, the decision saves and exits 130, a real terminal run does it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stalwart.reliability.exit import (
    EXIT_CODE_INTERRUPTED,
    ExitConfig,
    ExitInputs,
    ExitReason,
    SaveKind,
    decide,
    exit_message,
    gather_exit_inputs,
)
from stalwart.reliability.signals import DistributedSignalHandler, interrupt_handling_default


class FakeTTY:
    def __init__(self, tty: bool) -> None:
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_default_only_for_one_process_on_a_terminal() -> None:
    yes, no = FakeTTY(True), FakeTTY(False)
    assert interrupt_handling_default({}, yes, yes)
    assert interrupt_handling_default({"WORLD_SIZE": "1"}, yes, yes)
    assert not interrupt_handling_default({"WORLD_SIZE": "2"}, yes, yes)  # same on every rank
    assert not interrupt_handling_default({}, no, yes) and not interrupt_handling_default(
        {}, yes, no
    )
    assert not interrupt_handling_default({}, None, None)


def test_handler_records_which_signal_and_escalates_on_a_later_second_ctrl_c() -> None:
    now = [100.0]
    previous_int = signal.getsignal(signal.SIGINT)
    with DistributedSignalHandler(signal.SIGTERM, interrupt=True, clock=lambda: now[0]) as h:
        assert h.signals == (signal.SIGTERM, signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        assert h.received and h.received_signal is signal.SIGINT
        now[0] += 0.2
        os.kill(os.getpid(), signal.SIGINT)  # the same key press delivered twice: ignored
        os.kill(os.getpid(), signal.SIGTERM)
        assert h.received_signal is signal.SIGINT  # the first one is kept
        now[0] += 1.5
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # pressed again: stop now
    assert signal.getsignal(signal.SIGINT) is previous_int
    with DistributedSignalHandler(signal.SIGTERM) as plain:  # without interrupt: SIGINT untouched
        assert plain.signals == (signal.SIGTERM,)
        assert signal.getsignal(signal.SIGINT) is previous_int


def test_decision_interrupt_saves_and_exits_130() -> None:
    cfg = ExitConfig(exit_on_interrupt=True)
    assert cfg.needs_agreement and cfg.handles_signals
    with cfg.make_signal_handler() as handler:
        handler._received = signal.SIGINT
        inputs = gather_exit_inputs(cfg, handler, 1.0)
    assert inputs == ExitInputs(True, 1.0, int(signal.SIGINT))
    d = decide(12, inputs, cfg)
    assert (d.save, d.exit, d.reason, d.exit_code) == (
        SaveKind.PERSISTENT,
        True,
        ExitReason.INTERRUPT,
        EXIT_CODE_INTERRUPTED,
    )
    assert exit_message(d, 12).startswith("interrupted (Ctrl-C): exiting program at iteration 12")
    assert decide(12, inputs, cfg, can_save=False).save is SaveKind.NONE
    # The scheduler's exit signal wins over a Ctrl-C that reached some ranks (MAX of numbers).
    both = ExitConfig(exit_on_interrupt=True, exit_signal_handler=True)
    term = decide(12, ExitInputs(True, 0.0, int(signal.SIGTERM)), both)
    assert (term.reason, term.exit_code) == (ExitReason.SIGNAL, 0)
    # Ctrl-C without exit_on_interrupt is not the exit signal: no exit decided here.
    assert not decide(12, inputs, ExitConfig(exit_signal_handler=True)).exit
    # --exit-signal SIGINT keeps Megatron's meaning (a graceful exit 0).
    own = ExitConfig(exit_signal_handler=True, exit_signal="SIGINT", exit_on_interrupt=True)
    assert decide(3, inputs, own).exit_code == 0


def _spawn_on_terminal(args: list[str]) -> tuple[subprocess.Popen[bytes], int]:
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 200, 0, 0))

    def controlling_terminal() -> None:  # in the child, after setsid: the pty sends it ^C
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("WORLD_SIZE", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "stalwart", *args],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env,
        start_new_session=True,
        preexec_fn=controlling_terminal,  # only an ioctl: safe between fork and exec
    )
    os.close(slave)
    return proc, master


def _read_until(master: int, needle: bytes, buf: bytearray, timeout: float) -> bool:
    import select

    deadline = time.monotonic() + timeout
    while needle not in buf and time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.5)
        if ready:
            try:
                data = os.read(master, 65536)
            except OSError:
                return needle in buf
            if not data:
                break
            buf.extend(data)
    return needle in buf


@pytest.mark.slow
def test_ctrl_c_on_a_terminal_saves_and_exits_130(tmp_path: Path) -> None:
    save = tmp_path / "save"
    args = ["train", "--preset", "tiny", "--use-cpu", "--num-layers", "1", "--seq-length", "32"]
    args += ["--train-iters", "100000", "--log-interval", "1", "--save", str(save)]
    proc, master = _spawn_on_terminal(args)
    out = bytearray()
    try:
        assert _read_until(master, b"iteration 3/", out, 120), out.decode(errors="replace")
        os.write(master, b"\x03")  # Ctrl-C typed on the terminal: the line discipline sends SIGINT
        _read_until(master, b"\x00never", out, 60)  # read to EOF
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    text = out.decode(errors="replace")
    assert code == EXIT_CODE_INTERRUPTED, text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    lines = [line for line in text.splitlines() if "interrupted" in line]
    assert len(lines) == 1 and "interrupted (Ctrl-C): exiting program at iteration" in lines[0]
    reason = json.loads((save / "exit_reason.json").read_text())
    assert reason["reason"] == "interrupt" and reason["exit_code"] == 130
    latest = int((save / "latest_checkpointed_iteration.txt").read_text())
    assert latest == reason["iteration"] >= 3
    assert (save / f"iter_{latest:07d}").is_dir()
