"""``--rewind-on-spike`` in the reference trainer, one rank, in process.

The spike is injected into the spiky-loss check of iteration 7 as a ``correct_result`` (it
reproduces on every rerun, wherever it runs: the data's, an application error). The trainer
rewinds to its newest checkpoint (iteration 5), trains 6 again, skips 7-8 (the window) and ends
bitwise equal to a run with ``--iterations-to-skip 7 8``; a process killed after the rewind
relaunches from iteration 5 and skips 7-8 too (the tracker file). With ``--rewind-lr-scale`` the
learning rate is scaled from iteration 6 on, in the uninterrupted run and the relaunched one
alike (bitwise), and the log shows it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from stalwart.cli.main import main
from stalwart.distributed.process_group import DistributedContext
from stalwart.reliability.faults import InjectedFault
from stalwart.train.trainer import Trainer, TrainOutcome

from train_utils import TINY_FLAGS, assert_params_equal, make_config

ITERS = ["--train-iters", "10", "--seed", "5", "--save-interval", "5"]
SPIKE = [
    "--no-check-for-nan-in-loss-and-grad",
    "--check-for-spiky-loss",
    "--error-injection-rate",
    "1",
    "--error-injection-type",
    "correct_result",
    "--error-injection-iterations",
    "7",
]
REWIND = ["--rewind-on-spike", "--rewind-skip-window", "2"]
ON = ["--rewind-on-spike", "--check-for-spiky-loss", "--result-rejected-tracker-filename", "t"]
CRASH = ["--inject-fault", "exception", "--inject-fault-iteration", "9"]


def _train(save: Path, *args: str) -> tuple[TrainOutcome, dict[str, torch.Tensor]]:
    tracker = ["--result-rejected-tracker-filename", str(save.parent / "tracker.txt")]
    config = make_config(*ITERS, "--save", str(save), *tracker, *args)
    with Trainer(config, DistributedContext()) as trainer:
        outcome = trainer.train()
        params = {k: v.detach().clone() for k, v in trainer.raw_model.state_dict().items()}
    return outcome, params


def _crash_then_relaunch(save: Path, *args: str) -> tuple[TrainOutcome, dict[str, torch.Tensor]]:
    with pytest.raises(InjectedFault):  # after the rewind, before the next save
        _train(save, *SPIKE, *args, *CRASH)
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "5\n"
    return _train(save, *SPIKE, *args)


@pytest.fixture(scope="module")
def skipped(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The same run with the window in ``--iterations-to-skip`` from the start."""
    save = tmp_path_factory.mktemp("skipped") / "ckpt"
    return _train(save, "--iterations-to-skip", "7", "8")[1]


def test_a_reproduced_spike_rewinds_skips_the_window_and_ends_as_if_skipped(
    tmp_path: Path, skipped: dict[str, torch.Tensor], capsys: pytest.CaptureFixture[str]
) -> None:
    save = tmp_path / "ckpt"
    outcome, params = _train(save, *SPIKE, *REWIND)
    assert (outcome.exit_code, outcome.iteration) == (0, 10)
    assert_params_equal(params, skipped)
    out = capsys.readouterr().out
    assert "spike rewind 1 of 3: Spiky loss nan at iteration 7 reproduced (in place)" in out
    assert "iter_0000005 (5 iterations); skipping iterations 7-8" in out
    lines = (tmp_path / "tracker.txt").read_text().splitlines()
    rewound = [x.split(" iteration=")[1].split()[0] for x in lines if "rewind_skipped" in x]
    assert rewound == ["7", "8"]
    spans = [json.loads(x) for x in (save / "goodput.jsonl").read_text().splitlines()]
    # Iteration 6 trained again (lost work), the restore booked as restart time.
    assert any(s.get("b") == "lost_work" and s.get("it") == 6 for s in spans)
    assert any(s.get("b") == "restart" for s in spans)


def test_a_relaunch_after_the_rewind_skips_the_window_too(
    tmp_path: Path, skipped: dict[str, torch.Tensor]
) -> None:
    outcome, params = _crash_then_relaunch(tmp_path / "ckpt", *REWIND)
    assert (outcome.exit_code, outcome.iteration) == (0, 10)
    assert_params_equal(params, skipped)


def test_the_lr_scale_holds_from_the_restored_iteration_in_a_relaunch_too(
    tmp_path: Path, skipped: dict[str, torch.Tensor]
) -> None:
    scale = [*REWIND, "--rewind-lr-scale", "0.5", "--log-interval", "1"]
    metrics = ["--metrics-file", str(tmp_path / "a" / "m.jsonl")]
    _, whole = _train(tmp_path / "a" / "ckpt", *SPIKE, *scale, *metrics)
    _, relaunched = _crash_then_relaunch(tmp_path / "b" / "ckpt", *scale)
    assert_params_equal(relaunched, whole)
    assert any(not torch.equal(whole[k], skipped[k]) for k in whole)
    plain_metrics = ["--log-interval", "1", "--metrics-file", str(tmp_path / "c.jsonl")]
    _train(tmp_path / "c" / "ckpt", "--iterations-to-skip", "7", "8", *plain_metrics)
    # The last line of each iteration (6 is logged twice: before the rewind and after it).
    rates = {m["iteration"]: m["lr"] for m in _metrics(tmp_path / "a" / "m.jsonl")}
    plain = {m["iteration"]: m["lr"] for m in _metrics(tmp_path / "c.jsonl")}
    assert rates[5] == plain[5] and rates[6] == 0.5 * plain[6] and rates[10] == 0.5 * plain[10]


def _metrics(path: Path) -> list[dict[str, float]]:
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    return [r for r in rows if r.get("split", "train") == "train" and r.get("lr") is not None]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--rewind-on-spike"], "--rewind-on-spike needs --check-for-spiky-loss"),
        (
            ["--rewind-on-spike", "--check-for-spiky-loss"],
            "--rewind-on-spike needs --result-rejected-tracker-filename",
        ),
        (["--rewind-skip-window", "3"], "--rewind-skip-window needs --rewind-on-spike"),
        (["--rewind-skip-window", "0"], "--rewind-skip-window"),
        (["--rewind-lr-scale", "0"], "--rewind-lr-scale"),
        (["--rewind-lr-scale", "nan"], "--rewind-lr-scale"),
        (["--rewind-lr-scale", "1.5"], "--rewind-lr-scale"),
        (["--max-rewinds", "0"], "--max-rewinds"),
        (["--max-rewinds", "-3"], "--max-rewinds"),
        (
            [*ON, "--optimizer-cuda-graph"],
            "--rewind-on-spike is not supported with --cuda-graph-impl",
        ),
        (
            [*ON, "--save", "a", "--load", "b"],
            "--rewind-on-spike restores the newest checkpoint of --save",
        ),
    ],
)
def test_bad_values_exit_2_in_one_line(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", *TINY_FLAGS, "--train-iters", "1", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
