"""Every command that prints, with its standard output a pipe whose reader is gone
(`stalwart goodput --json | head`): no BrokenPipeError traceback, the command's own exit code,
and a training run still saves. A refused launch writes no goodput session and prints no
goodput line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stalwart.cli.main import main

from train_utils import REPO, TINY_FLAGS, cli_command, cli_env

TRAIN = [*TINY_FLAGS, "--seed", "5", "--log-interval", "1"]


@pytest.fixture(scope="module")
def save(tmp_path_factory: pytest.TempPathFactory) -> Path:
    save = tmp_path_factory.mktemp("pipe") / "save"
    assert main(["train", *TRAIN, "--train-iters", "2", "--save", str(save)]) == 0
    return save


def _into_closed_pipe(args: list[str]) -> subprocess.CompletedProcess[str]:
    """Run ``stalwart ARGS`` with stdout a pipe whose read end is already closed: the first
    write fails (EPIPE), whatever the pipe's buffer size and timing."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(cli_command(args), stdout=write, stderr=subprocess.PIPE,
                              text=True, env=cli_env(), cwd=REPO, timeout=180)  # fmt: skip
    finally:
        os.close(write)


COMMANDS = {
    "goodput": lambda s, t: ["goodput", str(s)],
    "goodput --json": lambda s, t: ["goodput", str(s), "--json"],
    "--help": lambda s, t: ["--help"],
    "--version": lambda s, t: ["--version"],
    "train --help": lambda s, t: ["train", "--help"],
    "train --print-config": lambda s, t: ["train", "--preset", "tiny", "--print-config"],
    "checkpoints": lambda s, t: ["checkpoints", str(s)],
    "checkpoints --verify": lambda s, t: ["checkpoints", str(s), "--verify"],
    "export": lambda s, t: ["export", "--load", str(s), "--out", str(t / "w.pt")],
    "report": lambda s, t: ["report", str(s), "--no-png", "--static", "-o", str(t / "r.html")],
    "chaos --help": lambda s, t: ["chaos", "--help"],
}

# One process runs every command through the process entry (`stalwart.__main__.run`), each
# with descriptor 1 a fresh pipe whose reader is gone (torch is imported once, not 11 times).
DRIVER = """
import json, os, sys
import stalwart.__main__ as entry
for argv in json.loads(sys.argv[1]):
    read, write = os.pipe()
    os.close(read)
    os.dup2(write, 1)
    os.close(write)
    sys.stdout = open(1, "w", closefd=False)
    sys.argv = ["stalwart", *argv]
    try:
        code = entry.run()
        sys.stdout.flush()  # as the interpreter's exit does
    except SystemExit as exc:
        code = exc.code
    except BaseException as exc:
        code = repr(exc)
    sys.stderr.write("RESULT " + json.dumps([argv, code]) + "\\n")
"""


def test_every_printing_command_into_a_closed_pipe_is_quiet(save: Path, tmp_path: Path) -> None:
    commands = [make(save, tmp_path) for make in COMMANDS.values()]
    result = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(commands)], capture_output=True, text=True,
        env=cli_env(), cwd=REPO, timeout=300,
    )  # fmt: skip
    assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr, result.stderr
    codes = [json.loads(ln[7:]) for ln in result.stderr.splitlines() if ln.startswith("RESULT ")]
    assert codes == [[argv, 0] for argv in commands], result.stderr[-3000:]


def test_goodput_json_into_a_closed_pipe_exits_quietly(save: Path) -> None:
    """The issue's case as a whole process (the interpreter's final flush included)."""
    result = _into_closed_pipe(["goodput", str(save), "--json"])
    assert result.returncode == 0 and result.stderr == "", result.stderr


def test_training_into_a_closed_pipe_still_saves(tmp_path: Path) -> None:
    """Its first iteration line hit the closed pipe: the run died with a traceback, unsaved."""
    target = tmp_path / "save"
    result = _into_closed_pipe(["train", *TRAIN, "--train-iters", "2", "--save", str(target)])
    assert "Traceback" not in result.stderr and result.returncode == 0, result.stderr[-3000:]
    assert (target / "latest_checkpointed_iteration.txt").read_text() == "2\n"


def test_a_launch_refused_after_start_up_writes_no_goodput_session(save: Path, capsys) -> None:
    ledger = save / "goodput.jsonl"
    before = ledger.read_bytes()
    capsys.readouterr()
    # --train-iters 4 changes the decay end of the checkpoint's schedule: refused on resume.
    assert main(["train", *TRAIN, "--train-iters", "4", "--save", str(save)]) == 2
    out, err = capsys.readouterr()
    assert "LR schedule differs" in err and "goodput:" not in out + err
    assert ledger.read_bytes() == before


def test_an_error_line_into_a_closed_pipe_keeps_exit_code_2() -> None:
    """`stalwart nonsense 2>&1 | head`: the one-line error meets the closed pipe (exit 1 before)."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run(cli_command(["nonsense"]), stdout=write, stderr=write,
                              env=cli_env(), cwd=REPO, timeout=60)  # fmt: skip
    finally:
        os.close(write)
    assert proc.returncode == 2
