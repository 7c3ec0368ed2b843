"""The terminal's log records (issue 44 item 2): by default warnings and the notices (a saved or
loaded checkpoint) only; ``--verbose`` adds every INFO line; ``--logging-level`` (Megatron's
flag: an integer, or a level's name) sets the level exactly; both at once is one line, exit 2."""

from __future__ import annotations

from pathlib import Path

from train_utils import TINY_FLAGS, run_cli

STARTUP_INFO = "INFO stalwart.reliability.rerun.machine: RerunStateMachine initialized"


def _train(save: Path, *flags: str) -> tuple[str, str]:
    proc = run_cli(["train", *TINY_FLAGS, "--train-iters", "2", "--save", str(save), *flags])
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout, proc.stderr


def test_default_verbose_and_logging_level(tmp_path: Path) -> None:
    _, err = _train(tmp_path / "a")
    assert " INFO " not in err and STARTUP_INFO not in err, err
    saved = f"saved checkpoint iteration 2 to {tmp_path / 'a'}/iter_0000002 in "
    assert err.startswith(saved), err  # a notice: its message alone
    _, err = _train(tmp_path / "b", "--verbose")
    assert STARTUP_INFO in err and "INFO stalwart.checkpoint: saved checkpoint iteration 2" in err
    _, err = _train(tmp_path / "c", "--logging-level", "30")  # warnings only: no notice either
    assert err == "", err
    _, err = _train(tmp_path / "d", "--logging-level", "info")
    assert STARTUP_INFO in err


def test_bad_values_are_one_line(tmp_path: Path) -> None:
    for flags, text in (
        (["--verbose", "--logging-level", "20"], "--verbose and --logging-level"),
        (["--logging-level", "loud"], "argument --logging-level: expected an integer in [0, 50]"),
        (["--logging-level", "60"], "argument --logging-level: expected an integer in [0, 50]"),
        (["--log-format", "json"], "argument --log-format: invalid choice: 'json'"),
    ):
        proc = run_cli(["train", *TINY_FLAGS, "--train-iters", "1", *flags])
        assert proc.returncode == 2, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and text in proc.stderr, proc.stderr
