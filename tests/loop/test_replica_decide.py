"""The shell's one replica check on the weights: due at its interval and before every save, one
``exit.decide`` per ``Shell.decide`` whatever it finds, and a mismatch exits 17 without saving
(it outranks the save the iteration was due)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from stalwart.loop import ShellConfig, shell_exit
from stalwart.reliability.exit import ExitConfig, ExitReason, SaveKind
from stalwart.reliability.rerun import RerunConfig
from stalwart.reliability.rerun.attribution.fingerprints import ReplicaCheckResult
from stalwart.reliability.rerun.attribution.replicas import ReplicaCheck


def _run(tmp_path: Path, monkeypatch: Any, mismatch_at: int | None) -> dict[str, Any]:
    """Four iterations (replica interval 2, saves every 3); what was decided, saved, checked."""
    decides: list[int] = []
    real_decide = shell_exit.decide

    def counted(iteration: int, *args: Any, **kwargs: Any) -> Any:
        decides.append(iteration)
        return real_decide(iteration, *args, **kwargs)

    monkeypatch.setattr(shell_exit, "decide", counted)
    model = torch.nn.Linear(4, 1)
    rerun = RerunConfig(rerun_mode="disabled", check_weight_hash_across_dp_replicas_interval=2)
    shell = ShellConfig(
        train_iters=4, save_dir=str(tmp_path), exit=ExitConfig(save_interval=3), rerun=rerun
    ).build()
    check = shell.machine.replicas
    assert isinstance(check, ReplicaCheck)  # built with rerun mode disabled too
    checked: list[int] = []
    real_check = check.check

    def spied(module: torch.nn.Module) -> ReplicaCheckResult:
        checked.append(shell.completed)
        if shell.completed == mismatch_at:
            return ReplicaCheckResult(
                False, [1], ["weight"], reference_ranks=[0], has_majority=False
            )
        return real_check(module)

    monkeypatch.setattr(check, "check", spied)
    saved: list[int] = []
    decisions: dict[int, Any] = {}
    try:
        shell.resumed(0)
        shell.start()
        shell.watch(model)
        for _ in range(4):
            with shell.iteration():
                model.weight.data.add_(0.1)
            decides_before = len(decides)
            decision = shell.decide()
            assert len(decides) == decides_before + 1  # one exit.decide per iteration
            decisions[shell.completed] = decision
            if decision.save is not SaveKind.NONE:
                with shell.saving():
                    saved.append(shell.completed)
            if decision.exit:
                shell.finish(decision)
                break
    finally:
        shell.close()
    return {"decides": decides, "checked": checked, "saved": saved, "decisions": decisions}


def test_the_weights_are_checked_at_the_interval_and_before_each_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = _run(tmp_path, monkeypatch, mismatch_at=None)
    assert out["decides"] == [1, 2, 3, 4]
    assert out["checked"] == [2, 3, 4]  # 2, 4: the interval; 3, 4: a save (4: the last one)
    assert out["saved"] == [3, 4]


def test_a_mismatch_before_a_save_exits_17_without_saving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = _run(tmp_path, monkeypatch, mismatch_at=3)
    assert out["decides"] == [1, 2, 3]
    assert out["saved"] == []
    decision = out["decisions"][3]
    assert decision.exit and decision.exit_code == 17 and decision.save is SaveKind.NONE
    assert decision.reason is ExitReason.REPLICA_MISMATCH
    assert "no majority tells which replica is right" in decision.detail
