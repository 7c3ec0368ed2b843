"""``stalwart chaos``: the seeded schedule and flag checks (fast), and a campaign covering every
fault kind end to end (slow: 2 gloo ranks under torchrun, ~20 launches)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stalwart.chaos.schedule import EXPECTED, ChaosFault, build_schedule, parse_faults
from stalwart.cli.chaos import main_chaos


def test_schedule_is_seeded_and_respects_the_job_shape() -> None:
    kinds = list(ChaosFault)
    plans = build_schedule(kinds, seed=7, iterations=12, save_interval=3, nproc=2)
    assert plans == build_schedule(kinds, seed=7, iterations=12, save_interval=3, nproc=2)
    assert [p.kind for p in plans] == kinds
    others = build_schedule(kinds, seed=8, iterations=12, save_interval=3, nproc=2)
    assert plans != others
    for plan in plans:
        assert 0 <= plan.rank < 2
        at_a_save = (ChaosFault.SIGKILL_ASYNC_SAVE, ChaosFault.CORRUPT_CHECKPOINT,
                     ChaosFault.CONCURRENT_JOB, ChaosFault.CORRUPT_METADATA)  # fmt: skip
        if plan.kind in at_a_save:
            assert plan.iteration % 3 == 0 and 6 <= plan.iteration < 12
            assert plan.rank == 0
        elif plan.kind in (ChaosFault.DISK_FULL, ChaosFault.TORN_METRICS):
            assert plan.iteration % 3 == 0 and 3 <= plan.iteration < 9
        else:
            assert 4 <= plan.iteration < 12  # after the first checkpoint, before the end
    assert set(EXPECTED) == set(ChaosFault)


def test_parse_faults() -> None:
    assert parse_faults("all") == list(ChaosFault)
    assert parse_faults("hang, sigkill,hang") == [ChaosFault.HANG, ChaosFault.SIGKILL]
    with pytest.raises(ValueError, match="--faults: unknown fault 'meteor'"):
        parse_faults("hang,meteor")


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--faults", "meteor"], "--faults"),
        (["--iterations", "5"], "--iterations"),
        (["--save-interval", "1"], "--save-interval"),
        (["--nproc-per-node", "1"], "--nproc-per-node"),
        (["--device", "tpu"], "--device"),
        (["--no-such-flag"], "--no-such-flag"),
        (["--jobs", "0"], "--jobs"),
        (["--timeout", "nan"], "--timeout"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(argv, flag, capsys, tmp_path) -> None:
    assert main_chaos([*argv, "--work-dir", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("stalwart chaos: error: ") and flag in err


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_campaign_covers_every_fault_kind_and_passes(tmp_path: Path, capsys) -> None:
    """Every fault kind once (9 iterations, a checkpoint every 3): detected by its mechanism,
    recoverable runs bitwise equal to the fault-free run, the rest with their documented code."""
    out = tmp_path / "chaos.json"
    argv = ["--work-dir", str(tmp_path / "w"), "--json", str(out), "--iterations", "9",
            "--save-interval", "3", "--seed", "1", "--jobs", "3"]  # fmt: skip
    code = main_chaos(argv)
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    failed = {f["kind"]: f["problems"] for f in data["faults"] if not f["passed"]}
    assert code == 0 and data["passed"], (failed, printed[-3000:])
    rows = {f["kind"]: f for f in data["faults"]}
    assert list(rows) == [k.value for k in ChaosFault]
    for kind, row in rows.items():
        expected = EXPECTED[ChaosFault(kind)]
        assert row["detected"] and row["exit_code"] == expected.exit_code, row
        assert row["bitwise_equal"] is (True if expected.recoverable else None), row
        assert row["recovered"] is expected.recoverable, row
    assert "chaos campaign PASSED" in printed
    report = (tmp_path / "w" / "reference" / "ckpt" / "report.html").read_text()
    assert "chaos run: PASSED" in report
