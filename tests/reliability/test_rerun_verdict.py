"""Every checkpoint the trainer writes loads, and the persistent-error diagnosis has a way out.

Single process through the CLI (``main``), devices simulated with ``STALWART_DEVICE_ID``:

* a persistent fault at iteration 1 saves iteration 0 (before any optimizer step) and exits 16;
  the relaunch on another device diagnoses it (exit 17), it does not fail to load (exit 2);
* after the diagnosis, ``rerun_verdict.json`` names the suspect device: a launch there is
  refused in one line (exit 16), a launch elsewhere trains on past the iteration and ends
  bitwise equal to a fault-free run;
* a SIGTERM in a first iteration that did not step the optimizer saves a checkpoint that
  resumes bitwise equal to the uninterrupted run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stalwart.cli.main import main
from stalwart.reliability.rerun import DEVICE_ID_ENV

from train_utils import TINY_FLAGS, assert_params_equal, load_params

ITERS = ["--train-iters", "4", "--seed", "5"]
VERDICT_FILENAME = "rerun_verdict.json"


def _train(save: Path, *extra: str) -> int:
    return main(["train", *TINY_FLAGS, *ITERS, "--save", str(save), *extra])


def _exit_code(save: Path) -> int:
    return int(json.loads((save / "exit_reason.json").read_text())["exit_code"])


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    save = tmp_path_factory.mktemp("reference") / "save"
    assert _train(save) == 0
    return save


def test_fault_at_iteration_1_diagnosis_then_the_way_forward(
    tmp_path: Path, reference: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    save = tmp_path / "save"
    fault = ["--error-injection-rate", "1", "--error-injection-type", "persistent_error",
             "--error-injection-iterations", "1"]  # fmt: skip
    monkeypatch.setenv(DEVICE_ID_ENV, "gpu-a")
    assert _train(save, *fault) == 16 == _exit_code(save)
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "0\n"

    monkeypatch.setenv(DEVICE_ID_ENV, "gpu-b")  # the iteration-0 checkpoint loads: diagnosis
    capsys.readouterr()
    assert _train(save, *fault) == 17 == _exit_code(save)
    assert "checkpoint error" not in capsys.readouterr().err
    verdict = json.loads((save / VERDICT_FILENAME).read_text())
    assert verdict["diagnosis"] == "persistent_error" and verdict["checkpoint"] == "iter_0000000"
    assert [d for _, d in verdict["suspects"]] == ["gpu-a"]

    monkeypatch.setenv(DEVICE_ID_ENV, "gpu-a")  # the suspect device: refused, one line, 16
    capsys.readouterr()
    assert _train(save, *fault) == 16
    err = [line for line in capsys.readouterr().err.splitlines() if "stalwart train" in line]
    assert len(err) == 1 and "gpu-a produced the persistent error at iteration 1" in err[0], err

    monkeypatch.setenv(DEVICE_ID_ENV, "gpu-c")  # good hardware: trains on to the end
    assert _train(save) == 0 and _exit_code(save) == 0
    assert_params_equal(load_params(save, 4), load_params(reference, 4))


def test_verdict_after_a_later_fault_and_a_garbage_verdict_changes_nothing(
    tmp_path: Path, reference: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save = tmp_path / "save"
    fault = ["--save-interval", "2", "--error-injection-rate", "1",
             "--error-injection-type", "persistent_error", "--error-injection-iterations", "4"]  # fmt: skip
    monkeypatch.setenv(DEVICE_ID_ENV, "gpu-a")
    assert _train(save, *fault) == 16 == _exit_code(save)
    monkeypatch.setenv(DEVICE_ID_ENV, "gpu-b")
    assert _train(save, *fault) == 17 == _exit_code(save)
    good = (save / VERDICT_FILENAME).read_bytes()
    (save / VERDICT_FILENAME).write_bytes(b"\x80\x04 not a verdict")
    assert _train(save, *fault) == 17 == _exit_code(save)  # as before: rerun, diagnose
    (save / VERDICT_FILENAME).write_bytes(good)
    assert _train(save, "--save-interval", "2") == 0 and _exit_code(save) == 0
    assert_params_equal(load_params(save, 4), load_params(reference, 4))


def test_sigterm_in_a_first_iteration_without_a_step_resumes_exactly(tmp_path: Path) -> None:
    """``--iterations-to-skip 1``: iteration 1 consumes its data without stepping; the SIGTERM
    there saves a checkpoint whose optimizer has no state. Saving it used to initialise the
    live optimizer with a zero step (step count 1), so the resumed run silently diverged."""
    reference, save = tmp_path / "reference", tmp_path / "save"
    flags = ["--exit-signal-handler", "--iterations-to-skip", "1", "--save-interval", "4"]
    assert _train(reference, *flags) == 0
    stop = ["--inject-fault", "sigterm", "--inject-fault-iteration", "1"]
    assert _train(save, *flags, *stop) == 0
    assert json.loads((save / "exit_reason.json").read_text())["reason"] == "signal"
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "1\n"
    assert _train(save, *flags) == 0
    assert_params_equal(load_params(save, 4), load_params(reference, 4))
