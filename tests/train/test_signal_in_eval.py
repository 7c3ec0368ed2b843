"""A SIGTERM that arrives during evaluation stops the run at the evaluated iteration (Megatron's
behaviour), with its save: the exit inputs agreed inside the step are agreed again after the
evaluation, on evaluating iterations only."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from stalwart.cli.main import main
from stalwart.loop import ShellConfig
from stalwart.loop.step import StepResult
from stalwart.reliability.agreement import IterationAgreement
from stalwart.reliability.exit import ExitConfig, SaveKind

from train_utils import TINY_FLAGS, run_cli

SIGTERM_IN_EVAL = [
    "--exit-signal-handler", "--train-iters", "8", "--eval-interval", "3", "--eval-iters", "1",
    "--save-interval", "100", "--log-interval", "1",
    "--inject-fault", "sigterm", "--inject-fault-iteration", "3", "--inject-fault-phase", "eval",
]  # fmt: skip


def _stopped_at(save: Path) -> tuple[str, int, int, str]:
    reason = json.loads((save / "exit_reason.json").read_text())
    tracker = (save / "latest_checkpointed_iteration.txt").read_text().strip()
    return reason["reason"], reason["exit_code"], reason["iteration"], tracker


def test_sigterm_during_evaluation_stops_at_the_evaluated_iteration(tmp_path: Path) -> None:
    save = tmp_path / "save"
    assert main(["train", *TINY_FLAGS, "--seed", "5", "--save", str(save), *SIGTERM_IN_EVAL]) == 0
    assert _stopped_at(save) == ("signal", 0, 3, "3")
    records = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    assert max(r["iteration"] for r in records if r.get("split") == "train") == 3
    assert any(r.get("split") == "validation" and r["iteration"] == 3 for r in records)


@pytest.mark.distributed
def test_sigterm_during_evaluation_on_two_ranks(tmp_path: Path) -> None:
    """Under torchrun the drill's SIGTERM goes to the agent, which forwards it to both ranks
    (torchrun itself then exits 1; the workers save and exit 0)."""
    save = tmp_path / "save"
    proc = run_cli(["train", *TINY_FLAGS, "--seed", "5", "--save", str(save), *SIGTERM_IN_EVAL],
                   nproc=2, timeout=240)  # fmt: skip
    assert "exiting program after SIGTERM at iteration 3" in proc.stdout, proc.stderr[-3000:]
    assert _stopped_at(save) == ("signal", 0, 3, "3")
    train = [json.loads(x) for x in (save / "metrics.jsonl").read_text().splitlines()]
    assert max(r["iteration"] for r in train if r.get("split") == "train") == 3


def test_agree_again_reads_the_inputs_anew_and_keeps_the_steps() -> None:
    class Probe:
        needs_agreement = True
        value = (0, 1.0)

        def local(self) -> tuple[int, float]:
            return self.value

    probe = Probe()
    agreement = IterationAgreement(probe)  # type: ignore[arg-type]
    agreement.begin()
    assert agreement.finish().signal_number == 0
    probe.value = (15, 2.0)  # the signal arrives during the evaluation
    again = agreement.agree_again()
    assert (again.signal_number, again.elapsed_minutes_max) == (15, 2.0)
    probe.value = (0, 3.0)
    assert agreement.agree_again().signal_number == 15  # what was agreed is kept
    assert agreement.finish().signal_number == 15


def test_the_shell_agrees_again_after_its_evaluation(tmp_path: Path) -> None:
    shell = ShellConfig(
        train_iters=10, save_dir=str(tmp_path), exit=ExitConfig(exit_signal_handler=True)
    ).build()
    decisions: list[Any] = []
    try:
        shell.resumed(0)
        shell.start()
        for it in (1, 2):
            result = StepResult(losses={"lm loss": torch.tensor(1.0)})  # agreed in the step
            if it == 2:
                with shell.evaluation():
                    os.kill(os.getpid(), signal.SIGTERM)  # the handler only raises a flag
            decisions.append(shell.decide(result))
    finally:
        shell.close()
    assert [d.exit for d in decisions] == [False, True]
    assert decisions[1].save is not SaveKind.NONE
