"""``stalwart chaos``: the seeded schedule and flag checks (fast), and the campaign covering every
fault kind end to end (slow: 2 gloo ranks under torchrun; one test per kind against one shared
fault-free run, so pytest-xdist spreads the ~30 launches over its workers)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from shared_runs import shared_run
from stalwart.chaos.campaign import CampaignConfig, base_args, run_one
from stalwart.chaos.result import Context
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


# The campaign's job shape (9 iterations, a checkpoint every 3, 2 gloo ranks, seed 1).
SHAPE = {"seed": 1, "iterations": 9, "save_interval": 3, "nproc": 2}
SCHEDULE = {p.kind: p for p in build_schedule(list(ChaosFault), **SHAPE)}


def _context(work: Path, reference: Path) -> Context:
    config = CampaignConfig(work_dir=work, faults=list(ChaosFault), **SHAPE)
    return Context(
        work=work,
        base_args=base_args(config),
        nproc=config.nproc,
        iterations=config.iterations,
        save_interval=config.save_interval,
        reference=reference,
        timeout=config.timeout,
    )


# ``stalwart chaos`` itself runs the reference and this kind; every other kind has its own test
# against that reference (so one fault-free run serves the whole campaign).
CLI_KINDS = [ChaosFault.TORN_METRICS]


@pytest.fixture(scope="module")
def chaos_cli_run(tmp_path_factory) -> Path:
    """``stalwart chaos`` on `CLI_KINDS`, once per session (every xdist worker reads it):
    ``code``, ``stdout`` and ``chaos.json`` beside its work directory ``w``."""

    def build(path: Path) -> None:
        argv = ["--work-dir", str(path / "w"), "--json", str(path / "chaos.json"),
                "--iterations", str(SHAPE["iterations"]),
                "--save-interval", str(SHAPE["save_interval"]), "--seed", str(SHAPE["seed"]),
                "--faults", ",".join(k.value for k in CLI_KINDS)]  # fmt: skip
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            code = main_chaos(argv)
        (path / "stdout").write_text(printed.getvalue())
        (path / "code").write_text(str(code))

    return shared_run(tmp_path_factory, "chaos-cli", build)


@pytest.fixture(scope="module")
def chaos_reference(chaos_cli_run: Path) -> Path:
    """The campaign's fault-free run (the ``stalwart chaos`` run's own)."""
    data = json.loads((chaos_cli_run / "chaos.json").read_text())
    assert data["reference_problem"] is None, (chaos_cli_run / "stdout").read_text()[-3000:]
    return chaos_cli_run / "w" / "reference" / "ckpt"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "kind", [k for k in ChaosFault if k not in CLI_KINDS], ids=lambda k: k.value
)
def test_campaign_fault_kind_is_detected_and_handled_as_documented(
    kind: ChaosFault, chaos_reference: Path, tmp_path: Path
) -> None:
    """One campaign row per test (the campaign's own schedule, so xdist spreads the kinds):
    detected by its mechanism, recoverable runs bitwise equal to the fault-free run, the rest
    with their documented code."""
    res = run_one(_context(tmp_path, chaos_reference), SCHEDULE[kind])
    row = res.to_json()
    logs = {p.name: p.read_text()[-1500:] for p in sorted((tmp_path / kind.value).glob("*.log"))}
    assert res.passed, (row, logs)
    _assert_row(row, kind)


def _assert_row(row: dict, kind: ChaosFault) -> None:
    expected = EXPECTED[kind]
    assert row["kind"] == kind.value and row["iteration"] == SCHEDULE[kind].iteration
    assert row["detected"] and row["exit_code"] == expected.exit_code, row
    assert row["bitwise_equal"] is (True if expected.recoverable else None), row
    assert row["recovered"] is expected.recoverable, row


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_campaign_cli_runs_reference_then_faults_and_writes_json_and_report(
    chaos_cli_run: Path,
) -> None:
    """``stalwart chaos`` end to end: the reference run, its rows in schedule order, the JSON,
    the verdict line, exit 0 and the report."""
    printed = (chaos_cli_run / "stdout").read_text()
    data = json.loads((chaos_cli_run / "chaos.json").read_text())
    failed = {f["kind"]: f["problems"] for f in data["faults"] if not f["passed"]}
    assert (chaos_cli_run / "code").read_text() == "0" and data["passed"], (failed, printed[-3000:])
    assert [f["kind"] for f in data["faults"]] == [k.value for k in CLI_KINDS]
    for row, kind in zip(data["faults"], CLI_KINDS, strict=True):
        _assert_row(row, kind)
    assert data["reference_goodput"] is not None
    assert "chaos campaign PASSED" in printed
    report = (chaos_cli_run / "w" / "reference" / "ckpt" / "report.html").read_text()
    assert "chaos run: PASSED" in report
