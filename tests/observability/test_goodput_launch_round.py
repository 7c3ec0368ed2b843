"""Under ``stalwart launch`` the torchrun agent's process outlives its rounds: only round 0's
session starts with it; a relaunch's session starts with its own worker, so the time before it
is booked as restart downtime (split into hang at a watchdog's detection)."""

from __future__ import annotations

import os

import pytest

from stalwart.observability.goodput import session as goodput_session
from stalwart.observability.goodput.session import launcher_start_time

LAUNCHER_START, WORKER_START = 100.0, 250.0


def _started(pid: int | None = None) -> float:
    return LAUNCHER_START if pid == os.getppid() else WORKER_START


def test_only_the_first_round_starts_with_the_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(goodput_session, "process_start_time", _started)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.setenv("STALWART_LAUNCH_ROUND", "0")
    assert launcher_start_time() == LAUNCHER_START
    monkeypatch.setenv("STALWART_LAUNCH_ROUND", "3")
    assert launcher_start_time() == WORKER_START
    monkeypatch.delenv("STALWART_LAUNCH_ROUND")  # plain torchrun: its first round
    assert launcher_start_time() == LAUNCHER_START
