"""The framework-neutral pieces: ``stalwart.loop.Shell`` in a hand-written loop (its docstring's
shape), ``ResumableLoader``'s docstring, bad configs, and the HF callback on a plain Trainer."""

from __future__ import annotations

import doctest
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from stalwart.integrations import resumable
from stalwart.loop import ShellConfig
from stalwart.observability.dumps import TensorDumpConfig
from stalwart.observability.train_log import LogConfig
from stalwart.reliability.exit import SaveKind


def test_resumable_loader_docstring_runs() -> None:
    assert doctest.testmod(resumable, raise_on_error=True).attempted >= 5


@pytest.mark.parametrize("iters", [0, -1, True, 2.5])
def test_shell_config_rejects_bad_train_iters(iters: Any) -> None:
    with pytest.raises(ValueError, match=r"ShellConfig\.train_iters"):
        ShellConfig(train_iters=iters)


def test_shell_around_a_hand_written_step_saves_and_exits_on_sigterm(
    tmp_path: Path, capsys: Any
) -> None:
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    shell = ShellConfig(
        train_iters=10, save_dir=str(tmp_path), log=LogConfig(log_interval=1)
    ).build()
    saved, code = [], None
    try:
        shell.resumed(0)
        shell.start()
        for _ in range(10):
            with shell.iteration() as it:
                opt.zero_grad()
                loss = model(torch.ones(2, 4)).square().mean()
                loss.backward()
                opt.step()
                if it.number == 3:
                    os.kill(os.getpid(), signal.SIGTERM)  # the handler only raises a flag
            shell.record(losses={"lm loss": loss.detach()}, batch_size=2)
            decision = shell.decide()
            if decision.save is not SaveKind.NONE:
                with shell.saving():
                    saved.append(shell.completed)
            if decision.exit:
                code = shell.finish(decision)
                break
    finally:
        shell.close()
    assert code == 0 and saved == [3]
    assert json.loads((tmp_path / "exit_reason.json").read_text())["reason"] == "signal"
    out = capsys.readouterr().out
    assert "iteration 3/10 |" in out and "goodput" in out
    records = [json.loads(x) for x in (tmp_path / "goodput.jsonl").read_text().splitlines()]
    productive = [r["it"] for r in records if r.get("b") == "productive"]
    assert sorted(set(productive)) == [1, 2, 3]
    assert any(r.get("b") == "checkpoint" for r in records)


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"dumps": TensorDumpConfig(save_params_interval=1)}, "tensor dumps"),
        (
            {"log": LogConfig(log_num_zeros_in_grad=True)},
            r"ShellConfig\.log\.log_num_zeros_in_grad",
        ),
    ],
)
def test_settings_of_the_guarded_step_are_refused_without_it(
    tmp_path: Path, fields: dict[str, Any], needle: str
) -> None:
    """A framework's own step (no ``Shell.step``) cannot honour them: one line, not silence."""
    with ShellConfig(train_iters=2, save_dir=str(tmp_path), **fields).build() as shell:
        shell.start()
        refused = pytest.raises(ValueError, match=rf"^{needle}.*: needs the guarded step")
        with refused, shell.iteration():
            pass
