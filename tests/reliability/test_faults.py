"""Fault injection: validation, fire-once semantics (memory + marker), and each kind's effect."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from stalwart.reliability.faults import (
    FaultInjectionConfig,
    FaultInjector,
    FaultKind,
    InjectedFault,
    NullFaultInjector,
    build_fault_injector,
)

SRC = str(Path(__file__).resolve().parents[2] / "src")

RUNNER = textwrap.dedent(
    """
    import os, signal, subprocess, sys
    from stalwart.reliability.faults import FaultInjector
    kind, marker_dir = sys.argv[1], sys.argv[2]
    if kind == "sigterm-flag":
        from stalwart.reliability.signals import DistributedSignalHandler
        with DistributedSignalHandler(signal.SIGTERM) as h:
            FaultInjector("sigterm", 3, 0, marker_dir).maybe_inject(3, 0)
            print("flag", h.received, flush=True)
        sys.exit(0)
    inj = FaultInjector(kind, 3, 0, marker_dir, hang_seconds=None)
    for it in range(1, 5):
        inj.maybe_inject(it, 0)
    print("survived", flush=True)
    """
)


def _run(
    tmp_path: Path, kind: str, timeout: float, env: dict | None = None
) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "runner.py"
    script.write_text(RUNNER)
    full_env = {**os.environ, "PYTHONPATH": SRC, **(env or {})}
    return subprocess.run(
        [sys.executable, str(script), kind, str(tmp_path / "markers")],
        capture_output=True, text=True, timeout=timeout, env=full_env,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"inject_fault": "explode", "inject_fault_iteration": 1}, "--inject-fault"),
        ({"inject_fault": "hang"}, "--inject-fault-iteration"),
        ({"inject_fault": "hang", "inject_fault_iteration": 0}, "--inject-fault-iteration"),
        ({"inject_fault": "hang", "inject_fault_iteration": 1, "inject_fault_rank": -1}, "--inject-fault-rank"),
        ({"inject_fault": "hang", "inject_fault_iteration": 1, "inject_fault_hang_seconds": 0}, "--inject-fault-hang-seconds"),
        ({"inject_fault": "hang", "inject_fault_iteration": 1, "inject_fault_phase": "x"}, "--inject-fault-phase"),
    ],
)  # fmt: skip
def test_config_validation(kwargs: dict, flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        FaultInjectionConfig(**kwargs)


def test_build_null_and_rank_range(tmp_path: Path) -> None:
    assert isinstance(build_fault_injector(FaultInjectionConfig(), tmp_path), NullFaultInjector)
    cfg = FaultInjectionConfig(
        inject_fault="exception", inject_fault_iteration=2, inject_fault_rank=3
    )
    with pytest.raises(ValueError, match="--inject-fault-rank"):
        build_fault_injector(cfg, tmp_path, world_size=2)
    inj = build_fault_injector(cfg, tmp_path, world_size=4)
    assert isinstance(inj, FaultInjector) and inj.kind is FaultKind.EXCEPTION


def test_exception_fires_once_only_on_target(tmp_path: Path) -> None:
    inj = FaultInjector("exception", 5, 1, tmp_path)
    inj.maybe_inject(5, 0)  # other rank
    inj.maybe_inject(4, 1)  # other iteration
    inj.maybe_inject(5, 1, phase="eval")  # other phase
    with pytest.raises(InjectedFault, match="rank 1 fires 'exception' at iteration 5"):
        inj.maybe_inject(5, 1)
    inj.maybe_inject(5, 1)  # in-memory flag: no second firing
    assert (tmp_path / ".stalwart_fault_fired_exception_5_1").exists()


def test_marker_prevents_firing_after_restart(tmp_path: Path) -> None:
    with pytest.raises(InjectedFault):
        FaultInjector("exception", 2, 0, tmp_path).maybe_inject(2, 0)
    restarted = FaultInjector("exception", 2, 0, tmp_path)  # a fresh process after the restart
    restarted.maybe_inject(2, 0)
    assert restarted.fired
    other = FaultInjector("exception", 3, 0, tmp_path)  # a different fault is not blocked
    with pytest.raises(InjectedFault):
        other.maybe_inject(3, 0)


def test_bounded_hang_returns(tmp_path: Path) -> None:
    start = time.monotonic()
    FaultInjector("hang", 1, 0, tmp_path, hang_seconds=0.2).maybe_inject(1, 0)
    assert 0.2 <= time.monotonic() - start < 2.0


def test_sigkill_kills_own_process_once(tmp_path: Path) -> None:
    first = _run(tmp_path, "sigkill", timeout=10)
    assert first.returncode == -9
    assert "FAULT INJECTION" in first.stderr
    second = _run(tmp_path, "sigkill", timeout=10)  # the restarted job passes the iteration
    assert second.returncode == 0 and "survived" in second.stdout


def test_unbounded_hang_is_detected_by_timeout(tmp_path: Path) -> None:
    with pytest.raises(subprocess.TimeoutExpired):
        _run(tmp_path, "hang", timeout=1.5)


def test_sigterm_to_self_sets_exit_flag(tmp_path: Path) -> None:
    out = _run(tmp_path, "sigterm-flag", timeout=10)
    assert out.returncode == 0 and "flag True" in out.stdout


def test_sigterm_goes_to_parent_under_torchrun(tmp_path: Path) -> None:
    # A stand-in for the torchrun agent: a parent that waits for its child, killed by SIGTERM.
    parent = tmp_path / "agent.py"
    parent.write_text(
        "import subprocess, sys\n"
        f"subprocess.run([sys.executable, {str(tmp_path / 'runner.py')!r}, 'sigterm', sys.argv[1]])\n"
        "print('agent survived')\n"
    )
    (tmp_path / "runner.py").write_text(RUNNER)
    env = {**os.environ, "PYTHONPATH": SRC, "TORCHELASTIC_RUN_ID": "test"}
    out = subprocess.run(
        [sys.executable, str(parent), str(tmp_path / "markers")],
        capture_output=True, text=True, timeout=10, env=env,
    )  # fmt: skip
    assert out.returncode == -15 and "agent survived" not in out.stdout
