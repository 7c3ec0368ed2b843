"""``--rerun-transient-policy continue`` in the reference trainer, one rank, in process.

A transient fault is injected in iteration 4's first check (``--error-injection-type
transient_error``): under ``continue`` the job does not exit, the rerun's result is applied and
the final weights equal the fault-free run's bitwise; the event is in the tracker file, the
ledger's ``rerun`` bucket and the log. Over ``--rerun-transient-budget``: exit 17 naming the
device in ``suspect_devices.json``, with the iteration's start saved; a relaunch on that device
is refused (exit 16), one elsewhere trains on to the fault-free weights. The count survives a
relaunch (it is in the checkpoint).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from stalwart.cli.main import main
from stalwart.distributed.process_group import DistributedContext
from stalwart.reliability.rerun import DEVICE_ID_ENV
from stalwart.reliability.rerun.attribution.verdict_file import SuspectDeviceError
from stalwart.train.trainer import Trainer, TrainOutcome

from train_utils import TINY_FLAGS, assert_params_equal, make_config

ITERS = ["--train-iters", "6", "--seed", "5"]
CONTINUE = ["--rerun-transient-policy", "continue"]


def _inject(*iterations: int) -> list[str]:
    return [
        "--error-injection-rate",
        "1",
        "--error-injection-type",
        "transient_error",
        "--error-injection-iterations",
        *map(str, iterations),
    ]


def _train(*args: str) -> tuple[TrainOutcome, dict[str, torch.Tensor]]:
    with Trainer(make_config(*ITERS, *args), DistributedContext()) as trainer:
        outcome = trainer.train()
        params = {k: v.detach().clone() for k, v in trainer.raw_model.state_dict().items()}
    return outcome, params


@pytest.fixture(scope="module")
def fault_free() -> dict[str, torch.Tensor]:
    return _train()[1]


def test_continue_does_not_exit_and_ends_bitwise_equal_to_the_fault_free_run(
    tmp_path: Path, fault_free: dict[str, torch.Tensor], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    save, tracker = tmp_path / "ckpt", tmp_path / "tracker.txt"
    args = ["--save", str(save), "--result-rejected-tracker-filename", str(tracker)]
    outcome, params = _train(*args, *_inject(4), *CONTINUE)
    assert (outcome.exit_code, outcome.iteration) == (0, 6)
    assert_params_equal(params, fault_free)
    lines = tracker.read_text().splitlines()
    assert [x.split(" status=")[1].split()[0] for x in lines] == [
        "initial_run",
        "first_rerun_not_reproducible",
    ]
    assert "Possible transient error!" in caplog.text
    assert "Transient error 1 of at most 2 on this device!" in caplog.text
    assert "Continuing with the rerun's result of iteration 4" in caplog.text
    spans = [json.loads(x) for x in (save / "goodput.jsonl").read_text().splitlines()]
    assert any(s.get("b") == "rerun" and s.get("it") == 3 for s in spans)  # the replay
    assert not list(save.glob("rerun_verdict.json"))


def test_over_the_budget_exits_17_naming_the_device_and_a_relaunch_elsewhere_trains_on(
    tmp_path: Path, fault_free: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    save = tmp_path / "ckpt"
    monkeypatch.setenv(DEVICE_ID_ENV, "gpu-a")
    args = ["--save", str(save), *_inject(2, 4), *CONTINUE, "--rerun-transient-budget", "1"]
    outcome, _ = _train(*args)
    assert (outcome.exit_code, outcome.iteration) == (17, 3)  # the second transient, at 4
    suspects = json.loads((save / "suspect_devices.json").read_text())
    assert suspects["diagnosis"] == "repeated_transient_errors"
    assert suspects["source"] == "transient_budget"
    assert [(s["rank"], s["device"]) for s in suspects["suspects"]] == [(0, "gpu-a")]
    assert suspects["checkpoint"] == "iter_0000003"
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "3\n"
    assert json.loads((save / "exit_reason.json").read_text())["exit_code"] == 17

    with pytest.raises(
        SuspectDeviceError,
        match=r"this rank's device \S+/gpu-a produced the repeated transient errors at iteration 4",
    ):
        _train("--save", str(save))  # the same device: refused (the CLI exits 16)
    monkeypatch.setenv(DEVICE_ID_ENV, "gpu-b")
    outcome, params = _train("--save", str(save))
    assert (outcome.exit_code, outcome.iteration) == (0, 6)
    assert_params_equal(params, fault_free)


def test_the_count_survives_a_relaunch(tmp_path: Path) -> None:
    """Budget 1: a transient at iteration 2, an exit at 3 (saved), the relaunch's transient at
    iteration 5 is the device's second in the run: exit 17."""
    save = tmp_path / "ckpt"
    args = ["--save", str(save), *_inject(2, 5), *CONTINUE, "--rerun-transient-budget", "1"]
    first, _ = _train(*args, "--exit-interval", "3")
    assert (first.exit_code, first.iteration) == (0, 3)
    second, _ = _train(*args)
    assert (second.exit_code, second.iteration) == (17, 4)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--rerun-transient-policy", "maybe"], "--rerun-transient-policy"),
        (
            ["--rerun-transient-budget", "2"],
            "--rerun-transient-budget needs --rerun-transient-policy continue",
        ),
        ([*CONTINUE, "--rerun-transient-budget", "-1"], "--rerun-transient-budget"),
        (
            [*CONTINUE, "--rerun-mode", "disabled"],
            "--rerun-transient-policy continue needs --rerun-mode validate_results",
        ),
    ],
)
def test_bad_values_exit_2_in_one_line(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", *TINY_FLAGS, "--train-iters", "1", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
