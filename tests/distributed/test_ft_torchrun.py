"""Issue 4 at the trainer level: hangs, signals, crashes and exits under torchrun (2 gloo ranks).

Every scenario trains the same 12-iteration job and must end bitwise equal to one uninterrupted
reference run (checkpointed every 3 iterations, so intermediate iterations compare too).
Launches that need no torchrun (no restart, no signal to the launcher: the resumes, the exits)
run the CLI on ranks forked from the test's fork server (``run_cli_on_ranks``).
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
from ft_utils import LiveRun, logged_iterations, read_tracker

from dist_utils import run_cli_on_ranks
from train_utils import TINY_FLAGS, assert_params_equal, load_params, run_cli

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

COMMON = ["train", *TINY_FLAGS, "--train-iters", "12", "--seed", "3",
          "--global-batch-size", "8", "--log-interval", "1"]  # fmt: skip
STEP_TIMEOUT = 2.0
FT = ["--enable-ft", "--ft-num-warmup-iters", "2",
      "--ft-timeouts", f"setup=60,step={STEP_TIMEOUT},checkpointing=60,out_of_section=30"]  # fmt: skip
RESTART = ["--max-restarts", "1", "--monitor-interval", "0.2"]
TORCHRUN_SIGKILL = "closing signal SIGKILL"  # torchrun's line when a worker overran the 30 s window


def _slow_commit(iteration: int, seconds: float) -> list[str]:
    """Rank 0 sleeps inside the commit window of checkpoint ``iteration`` (the manager's
    ``before_commit`` hook, reached through ``--inject-fault-phase commit``)."""
    return ["--inject-fault", "hang", "--inject-fault-phase", "commit",
            "--inject-fault-iteration", str(iteration), "--inject-fault-rank", "0",
            "--inject-fault-hang-seconds", str(seconds)]  # fmt: skip


def _ok(proc) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _exit_reason(save: Path) -> dict:
    return json.loads((save / "exit_reason.json").read_text())


@pytest.fixture(scope="module")
def reference(two_rank_reference: Path) -> Path:
    """COMMON's job without faults, checkpointed every 3 (shared with the other torchrun tests)."""
    return two_rank_reference


def _first_hang_report(save: Path) -> tuple[Path, dict]:
    """The hang report of whichever rank's watchdog fired first. The peer of the sleeping rank
    blocks in the same step's collective, so both fire within milliseconds; the first kill makes
    torchrun tear the other rank down, possibly before its report is written."""
    paths = sorted((save / "ft_logs").glob("ft_hang_rank*.json"), key=lambda p: p.stat().st_mtime)
    assert paths, f"no hang report in {save / 'ft_logs'}"
    return paths[0], json.loads(paths[0].read_text())


def test_hang_in_step_is_killed_and_restart_resumes_from_newer_non_persistent(
    tmp_path, reference
) -> None:
    """Rank 1 sleeps in ``step`` at iteration 8: a monitor kills within timeout + 2 s, torchrun
    restarts, the job resumes from the non-persistent checkpoint of 6 (newer than the persistent
    4) and ends equal to the reference."""
    save = tmp_path / "ckpt"
    args = [*COMMON, "--save", str(save), *FT, "--save-interval", "4",
            "--non-persistent-save-interval", "2",
            "--inject-fault", "hang", "--inject-fault-iteration", "8", "--inject-fault-rank", "1"]  # fmt: skip
    proc = run_cli(args, nproc=2, torchrun_args=RESTART, timeout=150)
    _ok(proc)
    report_path, report = _first_hang_report(save)
    assert report["section"] == "step" and report["timeout_s"] == STEP_TIMEOUT
    assert report["elapsed_s"] <= STEP_TIMEOUT + 2.0  # detection latency
    fired = json.loads((save / ".stalwart_fault_fired_hang_8_1").read_text())["time"]
    assert report_path.stat().st_mtime - fired <= STEP_TIMEOUT + 2.0 + 1.5  # + stack-dump wait
    assert "resumed from" in proc.stdout
    assert f"{save / 'non_persistent' / 'iter_0000006'} at iteration 6" in proc.stdout
    assert logged_iterations(proc.stdout)[-6:] == list(range(6 + 1, 13))
    assert _exit_reason(save)["reason"] == "finished"
    assert_params_equal(load_params(save), load_params(reference, 12))


def test_sigterm_to_torchrun_saves_exits_signal_and_resume_is_exact(tmp_path, reference) -> None:
    """SIGTERM to torchrun mid-run (async saves, slow commits): every rank saves the iteration
    it stopped at well inside torchrun's 30 s window, exit reason ``signal``; the resume starts at
    the next iteration (zero lost) and ends bitwise equal to the uninterrupted run."""
    save = tmp_path / "ckpt"
    args = [*COMMON, "--save", str(save), "--exit-signal-handler", "--async-save",
            "--save-interval", "1", *_slow_commit(4, 3.0)]  # fmt: skip
    job = LiveRun(args)
    try:
        job.wait_for_iteration(3)
        sent = job.signal_launcher(signal.SIGTERM)
        job.wait(60)
        exit_s = time.monotonic() - sent
    finally:
        job.close()
    out = job.output
    reason = _exit_reason(save)
    stopped = reason["iteration"]
    assert reason["reason"] == "signal", out[-3000:]
    assert 3 <= stopped < 12
    assert read_tracker(save) == stopped == logged_iterations(out)[-1]  # async save finalized
    assert f"exiting program after SIGTERM at iteration {stopped}" in out
    assert TORCHRUN_SIGKILL not in out and exit_s < 15.0, (exit_s, out[-3000:])
    print(f"SIGTERM to job end: {exit_s:.2f} s (torchrun allows 30 s)")

    proc = run_cli_on_ranks([*COMMON, "--save", str(save)], tmp_path / "launch1")
    _ok(proc)
    assert f"at iteration {stopped}" in proc.stdout
    assert logged_iterations(proc.stdout) == list(range(stopped + 1, 13))
    assert_params_equal(load_params(save), load_params(reference, 12))


def test_sigkill_during_async_save_resumes_from_previous_complete(tmp_path, reference) -> None:
    """Node loss (SIGKILL to torchrun and all workers) while the async save of iteration 8 is
    being committed: the tracker still names 4, and the resume from 4 ends equal to the
    reference (the partial iteration-8 directory is never loaded)."""
    save = tmp_path / "ckpt"
    args = [*COMMON, "--save", str(save), "--async-save", "--save-interval", "4",
            *_slow_commit(8, 3.0)]  # fmt: skip
    job = LiveRun(args)

    def in_commit_of_8() -> bool:
        tracker = save / "latest_checkpointed_iteration.txt"
        written = list(save.glob("iter_0000008.tmp-*/.metadata"))
        return bool(written) and tracker.exists() and tracker.read_text() == "4\n"

    try:
        job.wait_for(in_commit_of_8, 90, "the async save of iteration 8 to be written")
        job.kill_all()
        job.wait(30)
    finally:
        job.close()
    assert read_tracker(save) == 4
    assert not (save / "iter_0000008").exists()

    proc = run_cli_on_ranks([*COMMON, "--save", str(save)], tmp_path / "launch2")
    _ok(proc)
    assert f"{save / 'iter_0000004'} at iteration 4" in proc.stdout
    assert not list(save.glob("*.tmp-*"))  # the next save removed the partial one
    assert_params_equal(load_params(save), load_params(reference, 12))


def test_interval_phase_and_duration_exits_agree_and_lose_nothing(tmp_path, reference) -> None:
    """Exit at 5 (``--exit-interval``), at 8 (``--phase-transition-iterations``), at 9
    (``--exit-duration-in-mins``): each saves, writes its reason, exits 0 on both ranks at the
    same iteration, and the chain is bitwise equal to the reference at 9."""
    save = tmp_path / "ckpt"
    base = [*COMMON, "--save", str(save)]
    exits = ["--exit-interval", "5", "--phase-transition-iterations", "8"]
    expected = [(exits, "interval", 5), (exits, "phase", 8),
                (["--exit-duration-in-mins", "0.001"], "duration", 9)]  # fmt: skip
    start = 0
    for extra, reason, iteration in expected:
        proc = run_cli_on_ranks([*base, *extra], tmp_path / reason)
        _ok(proc)  # a rank that disagreed would hang in the save or exit non-zero
        assert logged_iterations(proc.stdout) == list(range(start + 1, iteration + 1))
        record = _exit_reason(save)
        assert (record["reason"], record["iteration"]) == (reason, iteration), proc.stdout[-2000:]
        assert read_tracker(save) == iteration
        start = iteration
    assert_params_equal(load_params(save), load_params(reference, 9))


def test_learned_timeouts_are_written_reloaded_and_used(tmp_path, reference) -> None:
    """``--calc-ft-timeouts`` writes ft_state.json; the next job loads it and enforces the
    learned values (a learned ``step`` of 30 s, the floor of learned timeouts, catches a hang
    that the configured 100 s would not), and learns ``setup`` after its persistent load."""
    save = tmp_path / "ckpt"
    ft = ["--enable-ft", "--calc-ft-timeouts", "--ft-num-warmup-iters", "1",
          "--ft-timeouts", "setup=60,step=100,checkpointing=90,out_of_section=60"]  # fmt: skip
    _ok(run_cli_on_ranks([*COMMON, "--save", str(save), *ft, "--save-interval", "4",
                 "--exit-interval", "8"], tmp_path / "launch4"))  # fmt: skip
    state_path = save / "ft_state.json"
    state = json.loads(state_path.read_text())
    assert "checkpointing" in state["calculated_sections"]
    assert state["timeouts"]["checkpointing"] == 30.0  # max(floor 30 s, 5 x observed) != 90
    assert state["timeouts"]["step"] == 100.0  # too few timed steps to learn it

    # Pretend an earlier, longer job learned a 30 s step timeout (a smaller one is rejected).
    state["timeouts"]["step"] = 30.0
    state["calculated_sections"] = sorted({*state["calculated_sections"], "step"})
    state_path.write_text(json.dumps(state))
    args = [*COMMON, "--save", str(save), *ft, "--save-interval", "4",
            "--inject-fault", "hang", "--inject-fault-iteration", "10", "--inject-fault-rank", "0"]  # fmt: skip
    proc = run_cli(args, nproc=2, torchrun_args=RESTART, timeout=150)
    _ok(proc)
    assert "using learned timeouts for checkpointing, step" in proc.stdout + proc.stderr
    assert "rejected learned timeouts" not in proc.stdout + proc.stderr
    _, report = _first_hang_report(save)
    assert report["timeout_s"] == 30.0 and report["section"] == "step"
    assert "setup" in json.loads(state_path.read_text())["calculated_sections"]
    assert_params_equal(load_params(save), load_params(reference, 12))


def test_unwritable_save_dir_fails_on_both_ranks_before_training(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    proc = run_cli_on_ranks(
        [*COMMON, "--save", str(blocker / "ckpt")], tmp_path / "launch5", timeout_s=90
    )
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("stalwart train: error")]
    assert len(errors) == 2 and all("--save" in e and "not writable" in e for e in errors), errors
    assert not logged_iterations(proc.stdout)
    assert blocker.read_text() == "not a directory"
