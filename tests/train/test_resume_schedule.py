"""Resume hazards are said, not silent: a changed LR schedule follows Megatron's rule
(refused by default; ``--override-opt-param-scheduler``: this run's wins;
``--use-checkpoint-opt-param-scheduler``: the checkpoint's wins), and a checkpoint already at or
past the end of the run exits 0 (reason finished) in one line. Real resumes of a 4-iteration
checkpoint, through the CLI where the exit code and the printed lines matter."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from stalwart.cli.main import main
from stalwart.distributed.process_group import DistributedContext
from stalwart.train.schedule import learning_rate_at
from stalwart.train.schedule_resume import (
    SchedulePolicy,
    ScheduleSettings,
    decide_schedule,
    differences,
    policy_of,
    settings_from_state,
)
from stalwart.train.trainer import run_training

from train_utils import TINY_FLAGS, assert_params_equal, load_params, make_config

BASE = ["--seed", "11", "--min-lr", "1e-4", "--log-interval", "1"]


def _files(root: Path) -> dict[str, bytes]:
    """Every file, the goodput ledger included (a refused start writes no session to it)."""
    files = (p for p in root.rglob("*") if p.is_file())
    return {str(p.relative_to(root)): p.read_bytes() for p in files}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of 4 iterations (``--train-iters 4``: the decay ends at 4) with its checkpoint."""
    save = tmp_path_factory.mktemp("base") / "ckpt"
    run_training(
        make_config(*BASE, "--train-iters", "4", "--save", str(save)), DistributedContext()
    )
    return save


@pytest.fixture
def save(checkpoint: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "ckpt"
    shutil.copytree(checkpoint, copy)
    return copy


def _resume(save: Path, *flags: str, metrics: Path | None = None) -> int:
    extra = ["--metrics-file", str(metrics)] if metrics else []
    return main(["train", *TINY_FLAGS, *BASE, "--save", str(save), *extra, *flags])


def _lrs(metrics: Path) -> dict[int, float]:
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {r["iteration"]: r["lr"] for r in records if r.get("split") == "train"}


def _schedule_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "LR schedule" in r.getMessage()]


def test_longer_train_iters_is_refused_in_one_line_naming_the_flags(
    save: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _files(save)
    assert _resume(save, "--train-iters", "8") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "decay end (--lr-decay-iters, else --train-iters) 4 -> 8" in err
    assert "--override-opt-param-scheduler" in err and "--use-checkpoint-opt-param-scheduler" in err
    assert "learning rate of the next iteration 1.000e-04 -> " in err  # what the change would do
    assert _files(save) == before  # nothing trained, nothing written


def test_a_changed_lr_is_refused_too(save: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _resume(save, "--train-iters", "6", "--lr-decay-iters", "4", "--lr", "2e-3") == 2
    err = capsys.readouterr().err
    assert "--lr 0.001 -> 0.002" in err and len(err.strip().splitlines()) == 1


def test_override_takes_this_runs_schedule_with_one_warning(
    save: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    metrics = tmp_path / "m.jsonl"
    assert (
        _resume(save, "--train-iters", "8", "--override-opt-param-scheduler", metrics=metrics) == 0
    )
    lines = _schedule_lines(caplog)
    assert len(lines) == 1 and "--override-opt-param-scheduler" in lines[0], lines
    assert "4 -> 8" in lines[0]
    config = make_config(*BASE, "--train-iters", "8")
    expected = {i + 1: learning_rate_at(i, config.optim, 8) for i in range(4, 8)}
    assert _lrs(metrics) == pytest.approx(expected, rel=1e-6)
    assert expected[5] > 1e-4  # the re-planned decay: the LR went back up (said in the warning)


def test_use_checkpoint_keeps_the_checkpoints_schedule_as_if_it_was_never_changed(
    save: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    metrics = tmp_path / "m.jsonl"
    flags = ["--train-iters", "8", "--use-checkpoint-opt-param-scheduler"]
    assert _resume(save, *flags, metrics=metrics) == 0
    lines = _schedule_lines(caplog)
    assert len(lines) == 1 and "kept from the checkpoint" in lines[0], lines
    lrs = _lrs(metrics)
    assert sorted(lrs) == [5, 6, 7, 8] and all(v == pytest.approx(1e-4) for v in lrs.values())
    # The same run as one that always had the checkpoint's schedule (decay end 4), bitwise.
    straight = tmp_path / "straight"
    run_training(
        make_config(*BASE, "--train-iters", "8", "--lr-decay-iters", "4", "--save", str(straight)),
        DistributedContext(),
    )
    assert_params_equal(load_params(save, 8), load_params(straight, 8))
    # The checkpoint it wrote records that schedule: a plain resume to 10 with it is accepted.
    assert _resume(save, "--train-iters", "10", "--lr-decay-iters", "4") == 0


def test_the_same_schedule_spelled_differently_resumes_silently(
    save: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    assert _resume(save, "--train-iters", "6", "--lr-decay-iters", "4") == 0
    assert _schedule_lines(caplog) == []


def test_no_load_optim_uses_this_runs_schedule_and_says_so(
    save: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    assert _resume(save, "--train-iters", "6", "--no-load-optim") == 0
    lines = _schedule_lines(caplog)
    assert len(lines) == 1 and "--no-load-optim" in lines[0] and "4 -> 6" in lines[0], lines


def test_both_scheduler_flags_are_refused(save: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--override-opt-param-scheduler", "--use-checkpoint-opt-param-scheduler"]
    assert _resume(save, "--train-iters", "8", *flags) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "mutually exclusive" in err


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--train-iters", "2"], "is at iteration 4, already past --train-iters 2"),
        (["--train-iters", "4"], "is at iteration 4, already at --train-iters 4"),
        (
            ["--train-samples", "8", "--lr-warmup-iters", "0"],
            "already past --train-samples 8 (2 iterations)",
        ),
    ],
)
def test_a_checkpoint_at_or_past_the_end_exits_0_finished_in_one_line(
    save: Path, capsys: pytest.CaptureFixture[str], flags: list[str], needle: str
) -> None:
    before = _files(save)
    assert _resume(save, *flags) == 0
    out = capsys.readouterr().out
    said = [line for line in out.splitlines() if needle in line]
    assert len(said) == 1 and said[0].startswith("exiting program at iteration 4 (finished:"), out
    assert "nothing to train; pass a larger" in said[0]
    reason = json.loads((save / "exit_reason.json").read_text())
    assert (reason["reason"], reason["exit_code"], reason["iteration"]) == ("finished", 0, 4)
    assert needle in reason["detail"]
    logs = ("exit_reason.json", "events.jsonl", "goodput.jsonl")  # the exit is recorded
    after = _files(save)
    assert {k: v for k, v in after.items() if k not in logs} == {
        k: v for k, v in before.items() if k not in logs
    }  # no new checkpoint, nothing trained


# ----------------------------------------------------------------------- the pure decision
S = ScheduleSettings("iterations", 1e-3, 1e-4, 2, 100, "cosine")


def test_decision_table() -> None:
    longer = ScheduleSettings("iterations", 1e-3, 1e-4, 2, 200, "cosine")
    assert decide_schedule(S, S, SchedulePolicy.REFUSE).warning is None
    assert decide_schedule(None, longer, SchedulePolicy.REFUSE).settings == longer  # old ckpt
    with pytest.raises(ValueError, match="100 -> 200"):
        decide_schedule(S, longer, SchedulePolicy.REFUSE, (1e-4, 5e-4))
    assert decide_schedule(S, longer, SchedulePolicy.OVERRIDE).settings == longer
    assert decide_schedule(S, longer, SchedulePolicy.USE_CHECKPOINT).settings == S
    assert decide_schedule(S, longer, SchedulePolicy.NOT_LOADED).settings == longer
    assert policy_of(False, False, load_optim=False) is SchedulePolicy.NOT_LOADED
    assert policy_of(True, False, True) is SchedulePolicy.OVERRIDE
    assert policy_of(False, True, True) is SchedulePolicy.USE_CHECKPOINT
    assert policy_of(False, False, True) is SchedulePolicy.REFUSE


def test_what_does_not_shape_the_curve_is_not_a_difference() -> None:
    constant = ScheduleSettings("iterations", 1e-3, 0.0, 2, 100, "constant")
    assert (
        differences(constant, ScheduleSettings("iterations", 1e-3, 1e-4, 2, 500, "constant")) == []
    )
    samples = ScheduleSettings("samples", 1e-3, 1e-4, 2, 100, "cosine")
    assert differences(S, samples) == [
        "schedule unit (--train-iters or --train-samples): iterations -> samples"
    ]


@pytest.mark.parametrize(
    "state",
    [
        None,
        "garbage",
        {"lr": 1e-3},
        {
            "lr": "x",
            "min_lr": 0,
            "lr_warmup_iters": 0,
            "lr_decay_iters": None,
            "train_iters": 4,
            "lr_decay_style": "cosine",
        },
        {
            "lr": float("nan"),
            "min_lr": 0,
            "lr_warmup_iters": 0,
            "lr_decay_iters": None,
            "train_iters": 4,
            "lr_decay_style": "cosine",
        },
        {
            "lr": 1e-3,
            "min_lr": 0,
            "lr_warmup_iters": 0,
            "lr_decay_iters": None,
            "train_iters": 4,
            "lr_decay_style": "WSD",
        },
    ],
)
def test_a_damaged_scheduler_record_is_not_compared(state: object) -> None:
    assert settings_from_state(state) is None
