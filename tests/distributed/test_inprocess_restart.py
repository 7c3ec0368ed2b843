"""In-process restart on 2 gloo ranks: resume exactness, bounded retries, async save.

The ranks run the CLI forked from the test's fork server with torchrun's environment
(``run_cli_on_ranks``: no torch import per process); the fallback to a torchrun restart runs
under torchrun.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from stalwart.checkpoint.safe_state import read_state_file

from dist_utils import run_cli_on_ranks
from train_utils import TINY_FLAGS, assert_params_equal, load_params, run_cli

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

COMMON = ["train", *TINY_FLAGS, "--train-iters", "12", "--seed", "3", "--global-batch-size", "8",
          "--save-interval", "4"]  # fmt: skip
FAULT = ["--inprocess-restart", "--inject-fault", "exception", "--inject-fault-rank", "1"]
ENV = {"PYTHONUNBUFFERED": "1"}


def _out(proc) -> str:
    return proc.stdout + proc.stderr


def _ok(proc) -> None:
    assert proc.returncode == 0, _out(proc)[-4000:]


def _per_rank(save: Path, rank: int) -> dict:
    return read_state_file(str(save / "iter_0000012" / f"rank_{rank:05d}.json"))


@pytest.fixture(scope="module")
def baseline(two_rank_reference: Path) -> Path:
    """COMMON's job without faults or in-process restart, to compare against bitwise (the
    session's shared 2-rank reference run)."""
    return two_rank_reference


def test_exception_in_rank1_restarts_in_process_and_matches_fault_free_run(
    tmp_path, baseline
) -> None:
    save = tmp_path / "faulty"
    args = [*COMMON, "--save", str(save), *FAULT, "--inject-fault-iteration", "6"]
    proc = run_cli_on_ranks(args, tmp_path / "logs", env=ENV)
    _ok(proc)
    out = _out(proc)
    # The log names the attempt, the failing rank, the iteration and the cause.
    assert re.search(
        r"in-process restart attempt 1: rank 1 failed at iteration 6: InjectedFault: FAULT INJECTION",
        out,
    ), out[-4000:]
    assert "in-process restart attempt 1: process group rebuilt" in out
    # Resumed from the newest checkpoint (iteration 4), never from iteration 1.
    assert re.search(r"resumed from \S+iter_0000004 at iteration 4", out), out[-4000:]
    assert "RSS" in out  # memory after finalize is measured and logged
    assert_params_equal(load_params(baseline), load_params(save))
    for rank in (0, 1):  # RNG and rerun state machine were rebuilt from the checkpoint
        assert _per_rank(save, rank)["rerun"] == _per_rank(baseline, rank)["rerun"]


def test_restart_rebuilds_dataloader_workers_and_stays_exact(tmp_path, baseline) -> None:
    """With ``--num-workers 2`` the restart closes the old workers (their read-ahead belongs to the
    failed attempt) and starts new ones at the checkpoint's position: still bitwise equal."""
    save = tmp_path / "workers"
    args = [*COMMON, "--save", str(save), *FAULT, "--inject-fault-iteration", "6",
            "--num-workers", "2"]  # fmt: skip
    proc = run_cli_on_ranks(args, tmp_path / "logs", env=ENV)
    _ok(proc)
    assert "in-process restart attempt 1: process group rebuilt" in _out(proc)
    assert_params_equal(load_params(baseline), load_params(save))


def test_async_save_in_flight_is_completed_or_discarded(tmp_path, baseline) -> None:
    save = tmp_path / "async"
    # The fault fires one iteration after the async save of iteration 4 started.
    args = [*COMMON, "--save", str(save), "--async-save", *FAULT, "--inject-fault-iteration", "5"]
    proc = run_cli_on_ranks(args, tmp_path / "logs", env=ENV)
    _ok(proc)
    out = _out(proc)
    discarded = "discarding in-flight async checkpoint" in out
    resumed_from_4 = re.search(r"resumed from \S+iter_0000004 at iteration 4", out) is not None
    assert discarded != resumed_from_4, out[-4000:]  # exactly one of the two, never half-trusted
    assert not list(save.glob("iter_*.tmp-*"))  # no partial checkpoint left behind at the end
    assert_params_equal(load_params(baseline), load_params(save))
    for rank in (0, 1):
        assert _per_rank(save, rank)["rerun"] == _per_rank(baseline, rank)["rerun"]


def test_repeatable_fault_stops_retrying_with_nonzero_exit(tmp_path) -> None:
    save = tmp_path / "repeat"
    args = [*COMMON, "--save", str(save), *FAULT, "--inject-fault-iteration", "6",
            "--inject-fault-repeat", "--inprocess-max-iterations", "3"]  # fmt: skip
    proc = run_cli_on_ranks(args, tmp_path / "logs", env=ENV)
    out = _out(proc)
    assert proc.returncode != 0, out[-4000:]
    assert proc.returncode == 75, proc.codes  # EXIT_CODE_INPROCESS_GAVE_UP, for the launcher
    assert "in-process restart attempt 2: rank 1 failed at iteration 6" in out
    assert "in-process restart attempt 3" not in out  # the same fault twice: no third attempt
    assert "giving up: the same fault happened twice" in out


def test_hang_is_caught_by_the_soft_timeout_and_recovered_in_process(tmp_path, baseline) -> None:
    save = tmp_path / "hang"
    args = [*COMMON, "--save", str(save), "--inprocess-restart", "--inprocess-soft-timeout", "6",
            "--inprocess-hard-timeout", "60", "--inprocess-heartbeat-interval", "0.5",
            "--inject-fault", "hang", "--inject-fault-rank", "1", "--inject-fault-iteration", "6"]  # fmt: skip
    proc = run_cli_on_ranks(args, tmp_path / "logs", env=ENV)
    _ok(proc)
    out = _out(proc)
    # Every rank stalls with the hung one (DDP); the first watchdog to fire reports it.
    assert re.search(
        r"in-process restart attempt 1: rank \d failed at iteration 6: NoProgress", out
    )
    assert re.search(r"resumed from \S+iter_0000004 at iteration 4", out), out[-4000:]
    assert_params_equal(load_params(baseline), load_params(save))


def test_a_dead_rank_falls_back_to_a_torchrun_restart(tmp_path, baseline) -> None:
    """In-process restart cannot bring back a killed process: torchrun restarts the whole job,
    whose new processes build a fresh in-process store, resume from the last checkpoint and end
    bitwise equal to the fault-free run."""
    save = tmp_path / "killed"
    args = [*COMMON, "--save", str(save), "--inprocess-restart", "--inject-fault", "sigkill",
            "--inject-fault-rank", "1", "--inject-fault-iteration", "6"]  # fmt: skip
    env = {**ENV, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    proc = run_cli(args, nproc=2, env=env, timeout=240,
                   torchrun_args=["--max-restarts", "1", "--monitor-interval", "0.2"])  # fmt: skip
    _ok(proc)
    out = _out(proc)
    assert "FAULT INJECTION: rank 1 fires 'sigkill' at iteration 6" in out
    assert re.search(r"resumed from \S+iter_0000004 at iteration 4", out), out[-4000:]
    assert_params_equal(load_params(baseline), load_params(save))
