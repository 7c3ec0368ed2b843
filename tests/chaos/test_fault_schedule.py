"""The fault-schedule scenario's plan and flags (the run itself is opt-in: minutes long;
``stalwart chaos --fault-schedule``, docs/reliability.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart.chaos.fault_schedule import EXPECTED_ACTIONS, check_shape, schedule


def test_five_faults_evenly_spaced_each_kind_once() -> None:
    plan = schedule(1200)
    assert [(f.kind, f.iteration) for f in plan] == [
        ("hang", 200),
        ("sigkill", 400),
        ("transient_nan", 600),
        ("sigterm", 800),
        ("persistent_device", 1000),
    ]
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
    [
        (["--iterations", "100", "--save-interval", "50"], "must be at least 12 x --save-interval"),
        (["--faults", "hang"], "--fault-schedule runs its own faults on 2 CPU ranks"),
        (["--timeout", "0"], "--timeout: must be > 0"),
        (["--json", "/"], "--json '/' is a directory"),
    ],
)
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


def test_lost_work_per_fault_is_what_the_next_session_recomputed() -> None:
    from stalwart.chaos.fault_schedule import lost_work_per_fault
    from stalwart.observability.goodput.records import Bucket, SessionSummary, Span

    def session(name: str, resumed: int | None, last: int) -> SessionSummary:
        return SessionSummary(name, 0.0, 1.0, None, 0, 0, resumed, last, 0.0, 0.0)

    sessions = [session("a", None, 230), session("b", 220, 420), session("c", 420, 600)]
    spans = [
        Span(Bucket.LOST_WORK, 10.0, 10.5, "b", 221),
        Span(Bucket.LOST_WORK, 10.5, 10.75, "b", 222),
        Span(Bucket.PRODUCTIVE, 11.0, 12.0, "b", 300),
    ]
    assert lost_work_per_fault(sessions, spans) == [
        {"completed": 230, "resumed_at": 220, "recomputed": 10, "lost_work_s": 0.75},
        {"completed": 420, "resumed_at": 420, "recomputed": 0, "lost_work_s": 0.0},
    ]


def test_local_checkpoints_go_to_every_launch_of_the_schedule(tmp_path: Path) -> None:
    from stalwart.chaos.fault_schedule import ScheduleConfig, _non_persistent

    assert _non_persistent(ScheduleConfig(tmp_path, 1200, 100), tmp_path) == ([], {})
    config = ScheduleConfig(
        tmp_path, 1200, 100, non_persistent_interval=20, non_persistent_type="local"
    )
    flags, env = _non_persistent(config, tmp_path / "job")
    assert flags == [
        "--non-persistent-save-interval",
        "20",
        "--non-persistent-ckpt-type",
        "local",
        "--non-persistent-local-ckpt-dir",
        str(tmp_path / "job" / "local"),
        "--replication",
    ]
    assert env == {"STALWART_FAKE_NODE_SIZE": "1"}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--non-persistent-save-interval", "20"],
            "--non-persistent-save-interval goes with --fault-schedule",
        ),
        (
            ["--fault-schedule", "--non-persistent-ckpt-type", "local"],
            "local needs --non-persistent-save-interval",
        ),
        (["--fault-schedule", "--non-persistent-ckpt-type", "in_memory"], "invalid choice"),
    ],
)
def test_non_persistent_flags_of_the_schedule_are_checked(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from stalwart.cli.chaos import main_chaos

    assert main_chaos(args) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err, err


def test_transient_policy_continue_goes_to_every_launch_and_ends_no_launch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from stalwart.chaos.fault_schedule import ScheduleConfig, _policy, expected_actions
    from stalwart.cli.chaos import main_chaos

    assert _policy(ScheduleConfig(tmp_path, 1200, 100)) == []
    config = ScheduleConfig(tmp_path, 1200, 100, transient_policy="continue")
    assert _policy(config) == ["--rerun-transient-policy", "continue"]
    # The transient fault costs a replay, not a relaunch: one action fewer.
    assert expected_actions("continue") == [
        "restart",
        "restart",
        "preempted",
        "exclude",
        "finished",
    ]
    assert expected_actions("exit") == EXPECTED_ACTIONS
    assert main_chaos(["--rerun-transient-policy", "continue"]) == 2
    err = capsys.readouterr().err
    assert (
        err.strip() == "stalwart chaos: error: --rerun-transient-policy goes with --fault-schedule"
    )


def test_a_fault_recovered_in_place_costs_its_rerun_spans() -> None:
    from stalwart.chaos.fault_schedule import in_place_fault
    from stalwart.observability.goodput.records import Bucket, Span

    spans = [
        Span(Bucket.PRODUCTIVE, 10.0, 10.5, "a", 599),
        Span(Bucket.RERUN, 10.5, 10.52, "a", 599),
        Span(Bucket.RERUN, 10.52, 10.55, "a", 599),
        Span(Bucket.RERUN, 11.0, 11.5, "a", 700),  # another iteration's rerun
    ]
    row = in_place_fault(600, spans)
    assert row["action"] == "continue" and row["recomputed"] == 0
    assert row["rerun_s"] == pytest.approx(0.05)
