"""The exit decision table (priority order), config validation and exit_reason.json."""

from __future__ import annotations

import json
import logging
import signal
from pathlib import Path

import pytest

from stalwart.reliability.exit import (
    ExitConfig,
    ExitDecision,
    ExitInputs,
    ExitReason,
    SaveKind,
    decide,
    exit_message,
    gather_exit_inputs,
    write_exit_reason,
)
from stalwart.reliability.signals import DistributedSignalHandler

P, NP, NO = SaveKind.PERSISTENT, SaveKind.NON_PERSISTENT, SaveKind.NONE
CFG = ExitConfig(
    exit_signal_handler=True,
    exit_duration_in_mins=60,
    exit_interval=1000,
    phase_transition_iterations=(150, 50),
    save_interval=100,
    non_persistent_save_interval=10,
)
SIG = ExitInputs(signal_received=True)
LATE = ExitInputs(elapsed_minutes_max=61.0)
CALM = ExitInputs(elapsed_minutes_max=59.0)


@pytest.mark.parametrize(
    ("iteration", "inputs", "kwargs", "expected"),
    [
        # 1. signal beats everything, saves persistently even at a non-persistent iteration
        (10, SIG, {}, (P, True, ExitReason.SIGNAL)),
        (7, ExitInputs(True, 99.0), {}, (P, True, ExitReason.SIGNAL)),
        (7, SIG, {"can_save": False}, (NO, True, ExitReason.SIGNAL)),
        (7, SIG, {"already_saved": True}, (NO, True, ExitReason.SIGNAL)),
        # 2. regular saves: persistent wins when both intervals match
        (100, CALM, {}, (P, False, None)),
        (20, CALM, {}, (NP, False, None)),
        (7, CALM, {}, (NO, False, None)),
        (20, CALM, {"can_save": False}, (NO, False, None)),
        # 3. duration: save unless saved; a non-persistent iteration is upgraded to persistent
        (7, LATE, {}, (P, True, ExitReason.DURATION)),
        (20, LATE, {}, (P, True, ExitReason.DURATION)),
        (7, LATE, {"already_saved": True}, (NO, True, ExitReason.DURATION)),
        # 4. exit interval and phase transitions
        (1000, CALM, {}, (P, True, ExitReason.INTERVAL)),
        (50, CALM, {}, (P, True, ExitReason.PHASE)),
        (150, LATE, {}, (P, True, ExitReason.DURATION)),
        # 5. finished
        (33, CALM, {"finished": True}, (P, True, ExitReason.FINISHED)),
        (33, CALM, {"finished": True, "can_save": False}, (NO, True, ExitReason.FINISHED)),
    ],
)
def test_decision_table(iteration: int, inputs: ExitInputs, kwargs: dict, expected: tuple) -> None:
    d = decide(iteration, inputs, CFG, **kwargs)
    assert (d.save, d.exit, d.reason) == expected


def test_signal_ignored_without_handler_flag() -> None:
    cfg = ExitConfig(save_interval=5, exit_signal_handler=False)
    assert decide(5, SIG, cfg) == ExitDecision(P, False, None, "")


def test_everything_disabled_never_exits() -> None:
    cfg = ExitConfig(exit_signal_handler=False)
    assert not cfg.needs_agreement
    for it in range(1, 50):
        assert decide(it, ExitInputs(True, 1e9), cfg) == ExitDecision()


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"exit_signal": "SIGKILL"}, "--exit-signal"),
        ({"exit_duration_in_mins": -1.0}, "--exit-duration-in-mins"),
        ({"exit_interval": -3}, "--exit-interval"),
        ({"save_interval": 2.5}, "--save-interval"),
        ({"non_persistent_save_interval": -1}, "--non-persistent-save-interval"),
        ({"phase_transition_iterations": (5, 5)}, "--phase-transition-iterations"),
        ({"phase_transition_iterations": (0,)}, "--phase-transition-iterations"),
    ],
)
def test_config_validation(kwargs: dict, flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        ExitConfig(**kwargs)


def test_the_signal_handler_is_on_unless_turned_off_by_name() -> None:
    """Whatever else a loop sets, a SIGTERM saves: the README's ``ExitConfig(save_interval=100)``
    turned the handler off before (issue 41)."""
    for cfg in (ExitConfig(), ExitConfig(save_interval=100), ExitConfig(exit_interval=7)):
        assert cfg.exit_signal_handler and cfg.handles_signals, cfg
        assert decide(5, SIG, cfg).reason is ExitReason.SIGNAL
    assert not ExitConfig(exit_signal_handler=False).handles_signals


def test_config_normalises_signal_and_phases() -> None:
    cfg = ExitConfig(exit_signal="usr1", phase_transition_iterations=(9, 3))
    assert cfg.exit_signal is signal.SIGUSR1 and cfg.phase_transition_iterations == (3, 9)


def test_gather_without_group_and_without_need() -> None:
    with DistributedSignalHandler(signal.SIGUSR1) as handler:
        handler._received = signal.SIGUSR1
        cfg = ExitConfig(exit_signal_handler=True, exit_signal="SIGUSR1")
        assert gather_exit_inputs(cfg, handler, 3.0) == ExitInputs(True, 3.0, signal.SIGUSR1)
        off = ExitConfig(exit_signal_handler=False)
        assert gather_exit_inputs(off, handler, 3.0) == ExitInputs(False, 3.0)


def test_write_exit_reason(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG):  # the exit line says why; this one is DEBUG
        path = write_exit_reason(tmp_path / "save", ExitReason.SIGNAL, 42, "received SIGTERM")
    data = json.loads(path.read_text())
    assert path.name == "exit_reason.json"
    assert data["reason"] == "signal" and data["iteration"] == 42 and data["exit_code"] == 0
    assert data["detail"] == "received SIGTERM" and {"time", "hostname", "pid"} <= data.keys()
    assert "exit reason signal at iteration 42" in caplog.text
    assert [p.name for p in path.parent.iterdir()] == ["exit_reason.json"]  # no temp left


def test_exit_message() -> None:
    msg = exit_message(decide(7, SIG, CFG), 7)
    assert msg == "exiting program after SIGTERM at iteration 7"
    assert "minutes" in exit_message(decide(7, LATE, CFG), 7)
