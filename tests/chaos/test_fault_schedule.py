"""The fault-schedule scenario's plan and flags (the run itself is opt-in: minutes long;
``stalwart chaos --fault-schedule``, docs/reliability.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart.chaos.fault_schedule import EXPECTED_ACTIONS, check_shape, schedule


def test_five_faults_evenly_spaced_each_kind_once() -> None:
    plan = schedule(1200)
    assert [(f.kind, f.iteration) for f in plan] == [
        ("hang", 200), ("sigkill", 400), ("transient_nan", 600), ("sigterm", 800),
        ("persistent_device", 1000),
    ]  # fmt: skip
    # One launch action per fault, then the end.
    assert EXPECTED_ACTIONS == ["restart", "restart", "restart", "preempted", "exclude", "finished"]


def test_every_fault_has_checkpoints_before_it() -> None:
    check_shape(1200, 100)
    with pytest.raises(
        ValueError, match=r"--iterations \(1100\) must be at least 12 x --save-interval \(100\)"
    ):
        check_shape(1100, 100)


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--iterations", "100", "--save-interval", "50"], "must be at least 12 x --save-interval"),
     (["--faults", "hang"], "--fault-schedule runs its own faults on 2 CPU ranks"),
     (["--timeout", "0"], "--timeout: must be > 0"),
     (["--json", "/"], "--json '/' is a directory")],
)  # fmt: skip
def test_bad_schedule_flags_are_one_line(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from stalwart.cli.chaos import main_chaos

    assert main_chaos(["--fault-schedule", *args]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err, err


def test_fork_workers_goes_to_every_launch_and_only_with_the_schedule(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from stalwart.chaos.fault_schedule import DEVICES, ScheduleConfig, _launcher
    from stalwart.cli.chaos import main_chaos

    forked = ScheduleConfig(tmp_path, 1200, 100, fork_workers=True)
    assert "--fork-workers" in _launcher(forked, 2, DEVICES, 4)
    assert "--fork-workers" not in _launcher(ScheduleConfig(tmp_path, 1200, 100), 2, DEVICES, 4)
    assert main_chaos(["--fork-workers"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "stalwart chaos: error: --fork-workers goes with --fault-schedule"
