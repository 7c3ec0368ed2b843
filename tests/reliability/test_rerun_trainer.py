"""The rerun state machine inside the reference trainer, one rank, in process.

Errors are injected deterministically (``--error-injection-rate 1 --error-injection-iterations 3``:
the first validation call of iteration 4 as logged, loop index 3, is corrupted). Each test checks the diagnosis,
the exit code, the checkpoint (or its absence), the tracker lines, the log messages, and that the
parameters equal those of a fault-free run (a rejected iteration never steps the optimizer).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from stalwart.cli.main import main
from stalwart.distributed.process_group import DistributedContext
from stalwart.reliability.rerun import DEVICE_ID_ENV, RerunMode
from stalwart.train.trainer import Trainer, TrainOutcome, run_training

from train_utils import TINY_FLAGS, assert_params_equal, load_params, make_config

ITERS = ["--train-iters", "6", "--seed", "5"]
BAD = 3  # loop index of the injected iteration = iterations completed when it fails
LOGGED = BAD + 1  # its number in the log, the tracker and the iteration flags


def _inject(kind: str, save: Path, tracker: Path, *extra: str) -> list[str]:
    return [*ITERS, "--save", str(save), "--result-rejected-tracker-filename", str(tracker),
            "--error-injection-rate", "1", "--error-injection-type", kind,
            "--error-injection-iterations", str(LOGGED), *extra]  # fmt: skip


def _train(args: list[str]) -> tuple[TrainOutcome, dict[str, torch.Tensor]]:
    """Train in process; returns the outcome and the in-memory parameters at exit."""
    with Trainer(make_config(*args), DistributedContext()) as trainer:
        outcome = trainer.train()
        params = {k: v.detach().clone() for k, v in trainer.raw_model.state_dict().items()}
    return outcome, params


def _statuses(tracker: Path) -> list[str]:
    lines = tracker.read_text().splitlines()
    assert all(f"iteration={LOGGED} " in line for line in lines), lines
    return [line.split(" status=")[1].split()[0] for line in lines]


def _reference_loss(reference: Path, iteration: int) -> float:
    records = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("split") == "train"]
    return float(train[iteration]["loss"])  # record i logs 0-based iteration i


def _exit_reason(save: Path) -> dict[str, object]:
    return json.loads((save / "exit_reason.json").read_text())  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fault-free run with checkpoints after iterations 3 and 6 (same seed, same data) and a
    metrics file with the loss of every iteration."""
    save = tmp_path_factory.mktemp("reference")
    metrics = ["--log-interval", "1", "--metrics-file", str(save / "metrics.jsonl")]
    run_training(
        make_config(*ITERS, "--save", str(save), "--save-interval", "3", *metrics),
        DistributedContext(),
    )
    return save


def test_transient_error_exits_17_without_checkpoint(
    tmp_path: Path, reference: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    save, tracker = tmp_path / "ckpt", tmp_path / "tracker.txt"
    outcome, params = _train(_inject("transient_error", save, tracker))
    assert (outcome.exit_code, outcome.iteration) == (17, BAD)
    assert not list(save.glob("iter_*"))  # resume from the previous checkpoint instead
    assert _exit_reason(save)["exit_code"] == 17 and _exit_reason(save)["reason"] == "rerun"
    assert _statuses(tracker) == ["initial_run", "first_rerun_not_reproducible"]
    assert "Possible transient error!" in caplog.text
    assert "Exiting now. The job can be resumed from a previous checkpoint." in caplog.text
    assert_params_equal(params, load_params(reference, BAD))


def test_persistent_error_same_device_16_again_then_other_device_17(
    tmp_path: Path,
    reference: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    caplog.set_level(logging.INFO)
    save, tracker = tmp_path / "ckpt", tmp_path / "tracker.txt"
    args = _inject("persistent_error", save, tracker)
    monkeypatch.setenv(DEVICE_ID_ENV, "gpu-a")
    outcome, params = _train(args)
    assert (outcome.exit_code, outcome.iteration) == (16, BAD)
    assert (save / "latest_checkpointed_iteration.txt").read_text() == f"{BAD}\n"
    assert "Need to rerun on a different GPU to verify correctness" in caplog.text
    assert "Saving a checkpoint and exiting now" in caplog.text
    assert_params_equal(params, load_params(reference, BAD))
    assert_params_equal(load_params(save, BAD), load_params(reference, BAD))

    caplog.clear()  # restarted on the same device: exit 16 again, no new tracker line
    outcome, _ = _train(args)
    assert (outcome.exit_code, outcome.iteration) == (16, BAD)
    assert "Got rescheduled on the same GPU that produced the suspicious result" in caplog.text
    assert _statuses(tracker) == ["initial_run", "first_rerun_reproducible"]

    caplog.clear()  # restarted on another device: the value is clean there
    monkeypatch.setenv(DEVICE_ID_ENV, "gpu-b")
    outcome, params = _train(args)
    assert (outcome.exit_code, outcome.iteration) == (17, BAD)
    assert "Possible persistent error!" in caplog.text
    assert "A checkpoint at the last iteration already exists" in caplog.text
    assert _statuses(tracker)[-1] == "second_rerun_not_reproducible"
    last = tracker.read_text().splitlines()[-1]
    assert "device=gpu-b" in last
    # The restarted run replayed iteration 3 with the checkpointed data position and RNG: its
    # clean value is exactly the fault-free loss of that iteration (1 micro-batch, 1 rank).
    assert float(last.split(" result=")[1].split()[0]) == _reference_loss(reference, BAD)
    assert _exit_reason(save)["exit_code"] == 17
    assert_params_equal(params, load_params(reference, BAD))


def test_correct_result_then_tracker_skips_that_iteration(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    caplog.set_level(logging.INFO)
    save, tracker = tmp_path / "ckpt", tmp_path / "tracker.txt"
    args = _inject("correct_result", save, tracker)
    monkeypatch.setenv(DEVICE_ID_ENV, "gpu-a")
    assert _train(args)[0].exit_code == 16
    monkeypatch.setenv(DEVICE_ID_ENV, "gpu-b")
    assert _train(args)[0].exit_code == 17
    assert "Correct result (but possible Application error)" in caplog.text
    assert _statuses(tracker) == [
        "initial_run", "first_rerun_reproducible", "second_rerun_reproducible"
    ]  # fmt: skip

    # Resume without injection: the tracker lists iteration 4 (two reproducible reports of
    # rank 0), the loop skips exactly it; the rerun verdict (correct_result) has already
    # dropped the pending rerun of it.
    caplog.clear()
    capsys.readouterr()
    clean = [*ITERS, "--save", str(save), "--result-rejected-tracker-filename", str(tracker)]
    outcome, _ = _train(clean)
    assert (outcome.exit_code, outcome.iteration) == (0, 6)
    assert f"Will skip these iterations from tracker file: [{LOGGED}]" in caplog.text
    assert f"rerun verdict correct_result for iteration {LOGGED}" in caplog.text
    assert f"skipping iteration {LOGGED} (--iterations-to-skip)" in capsys.readouterr().out
    assert "Second rerun" not in caplog.text


@pytest.mark.parametrize("kind", ["transient_error", "persistent_error"])
def test_spiky_loss_is_not_fatal_and_training_continues(
    tmp_path: Path, reference: Path, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    caplog.set_level(logging.INFO)
    save, tracker = tmp_path / "ckpt", tmp_path / "tracker.txt"
    # Without the NaN checks the first validation call of an iteration is the spiky-loss check.
    args = _inject(
        kind, save, tracker, "--no-check-for-nan-in-loss-and-grad", "--check-for-spiky-loss"
    )
    outcome, params = _train(args)
    assert (outcome.exit_code, outcome.iteration) == (0, 6)
    assert "Continuing normal execution because the failed validation was not fatal" in caplog.text
    assert "Spiky loss" in tracker.read_text()
    # The replayed pass (same data, same RNG) produced the gradients that were applied.
    assert_params_equal(params, load_params(reference, 6))


def test_report_determinism_stats_prints_stats_and_trains_normally(
    tmp_path: Path, reference: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    outcome, params = _train([*ITERS, "--rerun-mode", "report_stats", "--check-for-spiky-loss"])
    assert outcome.exit_code == 0
    assert "Stats on computation determinism in validation calls" in caplog.text
    assert "From validation call 'found NaN in local forward loss calculation'" in caplog.text
    assert "all identical" in caplog.text  # CPU replay is bitwise
    assert_params_equal(params, load_params(reference, 6))


def test_evaluation_runs_with_validation_disabled(reference: Path) -> None:
    modes: list[RerunMode] = []
    config = make_config(*ITERS, "--eval-interval", "2", "--eval-iters", "1")
    with Trainer(config, DistributedContext()) as trainer:
        sm, original = trainer.machine, trainer.step.runners.evaluate

        def spy(**kwargs):  # type: ignore[no-untyped-def]
            modes.append(sm.get_mode())
            sm.validate_result(torch.tensor(1.0), torch.isnan, "eval loss")  # allowed here
            return original(**kwargs)

        trainer.step.runners.evaluate = spy
        assert trainer.train().exit_code == 0
        assert sm.get_mode() is RerunMode.VALIDATE_RESULTS
        params = {k: v.detach().clone() for k, v in trainer.raw_model.state_dict().items()}
    assert modes == [RerunMode.DISABLED] * 3
    assert_params_equal(params, load_params(reference, 6))  # evaluation changes nothing


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--error-injection-type", "bitflip"], "--error-injection-type"),
        (["--error-injection-rate", "-1"], "--error-injection-rate"),
        (["--error-injection-rate", "1", "--rerun-mode", "disabled"], "--error-injection-rate"),
        (["--error-injection-iterations", "3"], "--error-injection-iterations"),
        (["--error-injection-rate", "1", "--error-injection-iterations", "0"],
         "--error-injection-iterations"),
        (["--error-injection-rate", "1", "--error-injection-ranks", "x"], "--error-injection-ranks"),
        (["--iterations-to-skip", "0"], "--iterations-to-skip"),
        (["--rerun-mode", "validate"], "--rerun-mode"),
        (["--result-rejected-tracker-filename", "/proc/nope/tracker.txt"],
         "--result-rejected-tracker-filename"),
    ],
)  # fmt: skip
def test_bad_rerun_flags_exit_2_with_one_line(
    capsys: pytest.CaptureFixture[str], args: list[str], needle: str
) -> None:
    with pytest.raises(SystemExit) as info:
        raise SystemExit(main(["train", *TINY_FLAGS, "--train-iters", "1", *args]))
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "Traceback" not in err
    assert len(err.splitlines()) == 1, err


def test_an_iteration_to_skip_is_logged_as_skipped_not_as_a_nan_iteration(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--iterations-to-skip 2``: its line counts one skipped iteration, no NaN iteration, and
    shows no loss (it printed ``lm loss: NAN`` and ``number of nan iterations: 1``)."""
    outcome, _ = _train(["--train-iters", "3", "--seed", "5", "--log-interval", "1",
                         "--iterations-to-skip", "2", "--log-format", "megatron"])  # fmt: skip
    assert (outcome.exit_code, outcome.iteration) == (0, 3)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if " iteration " in ln]
    by_it = {int(ln.split(" iteration ")[1].split("/")[0]): ln for ln in lines if "/" in ln}
    assert "number of skipped iterations:   1 | number of nan iterations:   0 |" in by_it[2]
    assert "lm loss" not in by_it[2] and "NAN" not in by_it[2]
    for it in (1, 3):
        assert "number of skipped iterations:   0 | number of nan iterations:   0 |" in by_it[it]
        assert "lm loss: " in by_it[it]


def test_large_grads_injected_through_the_cli_is_not_fatal_and_training_continues(
    tmp_path: Path, reference: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``--check-for-large-grads`` alone: the iteration's first validation call is the gradient
    check, so the injection lands there. Non-fatal: rerun, continue, the tracker names it, the
    parameters equal the fault-free run's (the replayed pass's gradients were applied)."""
    caplog.set_level(logging.INFO)
    save, tracker = tmp_path / "ckpt", tmp_path / "tracker.txt"
    args = _inject(
        "transient_error", save, tracker, "--no-check-for-nan-in-loss-and-grad",
        "--check-for-large-grads",
    )  # fmt: skip
    outcome, params = _train(args)
    assert (outcome.exit_code, outcome.iteration) == (0, 6)
    assert "Continuing normal execution because the failed validation was not fatal" in caplog.text
    text = tracker.read_text()
    assert "large grads" in text and _statuses(tracker) == [
        "initial_run", "first_rerun_not_reproducible"
    ]  # fmt: skip
    assert_params_equal(params, load_params(reference, 6))
