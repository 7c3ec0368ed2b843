"""The rerun state machine end to end: 2 gloo ranks under torchrun, the real CLI, real restarts.

Rank 1 is injected at iteration 3 as logged, loop index 2 (``--error-injection-rate 1
--error-injection-iterations 3 --error-injection-ranks 1``); rank 0 stays clean, so the ranks must agree on every decision.

How "a different GPU" is simulated on one machine (``$STALWART_DEVICE_ID``):

* ``torchrun --max-restarts 1`` with an unchanged environment restarts the ranks on the *same*
  device (``cpu:<LOCAL_RANK>``): the restarted job must exit 16 again without a diagnosis;
  the attribution then completes in a separate command with ``STALWART_DEVICE_ID=gpu-b``.
* ``torchrun --max-restarts 1 --no-python python -c WRAPPER`` where the wrapper derives the device
  id from ``TORCHELASTIC_RESTART_COUNT``: the automatic restart lands on "another GPU" and
  completes the attribution within one torchrun invocation, as a scheduler that avoids the
  suspicious node would.

torchrun restarts on any non-zero exit and itself exits 1 when out of restarts, so the rerun exit
codes are read from ``exit_reason.json`` and from torchrun's per-worker ``exitcode`` lines.
Launches without restarts run the CLI on ranks forked from the test's fork server
(``run_cli_on_ranks``), which gives every rank's own exit code.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from stalwart.distributed.process_group import DistributedContext
from stalwart.train.trainer import run_training

from dist_utils import RankExits, run_cli_on_ranks
from train_utils import REPO, TINY_FLAGS, assert_params_equal, load_params, make_config

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TRAIN = [*TINY_FLAGS, "--train-iters", "4", "--global-batch-size", "8", "--seed", "5"]
BAD = 2
WRAPPER = (
    "import os, sys\n"
    "os.environ['STALWART_DEVICE_ID'] = "
    "f\"gpu{os.environ['LOCAL_RANK']}-restart{os.environ['TORCHELASTIC_RESTART_COUNT']}\"\n"
    "from stalwart.__main__ import run\n"
    "sys.exit(run())\n"
)


def _torchrun(
    args: list[str], *, restarts: int = 0, env: dict[str, str] | None = None, wrapper: bool = False
) -> subprocess.CompletedProcess[str]:
    launcher = [sys.executable, "-m", "stalwart.distributed.torchrun", "--standalone",
                "--nproc-per-node", "2", "--max-restarts", str(restarts)]  # fmt: skip
    program = ["--no-python", sys.executable, "-c", WRAPPER] if wrapper else ["-m", "stalwart"]
    inherited = {k: v for k, v in os.environ.items() if k != "STALWART_DEVICE_ID"}
    # Known torchrun issue (pytorch#135712): with the rendezvous TCPStore shared with the workers,
    # a restarted gloo group may read the previous attempt's peer addresses (connection refused).
    full_env = {**inherited, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    full_env.update(env or {})
    return subprocess.run(
        [*launcher, *program, "train", *TRAIN, *args],
        capture_output=True, text=True, env=full_env, timeout=240, cwd=REPO,
    )  # fmt: skip


def _ranks(args: list[str], log_dir: Path, env: dict[str, str] | None = None) -> RankExits:
    """A launch without restarts: the CLI on 2 ranks forked from the fork server (the same
    training, exit codes and logs as under torchrun, without ~4 s of CPU per process importing
    torch); the launches that test torchrun's restarts stay on torchrun."""
    argv = ["train", *TRAIN, *args]
    return run_cli_on_ranks(argv, log_dir, env=env, unset=("STALWART_DEVICE_ID",), timeout_s=240)


def _injected(kind: str, save: Path, tracker: Path, *, peer: bool = False) -> list[str]:
    """The injection flags; ``peer=False``: Megatron's exit-16 flow (no peer replay)."""
    return ["--save", str(save), "--result-rejected-tracker-filename", str(tracker),
            "--error-injection-rate", "1", "--error-injection-type", kind,
            "--error-injection-iterations", str(BAD + 1), "--error-injection-ranks", "1",
            "--rerun-peer-replay" if peer else "--no-rerun-peer-replay"]  # fmt: skip


def _worker_exit_codes(proc: subprocess.CompletedProcess[str]) -> list[int]:
    """The first worker exit code torchrun observed in each failed attempt (the root cause; the
    other rank may be SIGTERMed by torchrun before it exits by itself)."""
    return [int(c) for c in re.findall(r"failed \(exitcode: (-?\d+)\) local_rank", proc.stderr)]


def _statuses(tracker: Path) -> list[tuple[int, str]]:
    out = []
    for line in tracker.read_text().splitlines():
        assert f"iteration={BAD + 1} " in line, line  # numbered as logged
        out.append((int(line.split(" rank=")[1].split()[0]), line.split(" status=")[1].split()[0]))
    return out


def _exit_code(save: Path) -> int:
    return int(json.loads((save / "exit_reason.json").read_text())["exit_code"])


def _log(proc: subprocess.CompletedProcess[str]) -> str:
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """Fault-free 2-rank run (checkpoints at 2 and 4), in report_determinism_stats mode: every
    iteration is replayed, which must change nothing and print the determinism statistics."""
    save = tmp_path_factory.mktemp("reference")
    run = _ranks(["--save", str(save), "--save-interval", "2", "--rerun-mode", "report_stats"],
                 save.parent / "reference-logs")  # fmt: skip
    assert run.codes == [0, 0], run.log[-4000:]
    return save, run.log


def test_determinism_stats_are_printed_by_rank_0(reference: tuple[Path, str]) -> None:
    log = reference[1]
    assert (
        "[rank0] WARNING stalwart.reliability.rerun.machine: Stats on computation determinism"
        in log
    )
    assert "[rank1] WARNING stalwart.reliability.rerun.machine: Stats" not in log
    assert "From validation call 'found NaN in local grad norm" in log  # DDP comm-hook check


def test_persistent_error_restart_same_device_then_other_device(
    tmp_path: Path, reference: tuple[Path, str], caplog: pytest.LogCaptureFixture
) -> None:
    save, tracker = tmp_path / "ckpt", tmp_path / "tracker.txt"
    args = _injected("persistent_error", save, tracker)

    proc = _torchrun(args, restarts=1)  # the automatic restart lands on the same devices
    log = _log(proc)
    assert proc.returncode != 0
    assert _worker_exit_codes(proc) == [16, 16], proc.stderr[-3000:]
    assert log.count("Saving a checkpoint and exiting now") == 1
    assert f"resumed from {save}/iter_{BAD:07d} at iteration {BAD}" in log
    assert "[rank1] ERROR" in log and "Got rescheduled on the same GPU" in log
    assert "Please resume the job from the same checkpoint on another GPU" in log
    assert _statuses(tracker) == [(1, "initial_run"), (1, "first_rerun_reproducible")]
    assert _exit_code(save) == 16
    assert sorted(p.name for p in save.glob("iter_*")) == [f"iter_{BAD:07d}"]
    # The rejected iteration never stepped the optimizer, on either rank.
    assert_params_equal(load_params(save, BAD), load_params(reference[0], BAD))
    shutil.copytree(save, tmp_path / "copy")

    run = _ranks(args, tmp_path / "gpu-b", env={"STALWART_DEVICE_ID": "gpu-b"})  # moved elsewhere
    log = run.log
    assert run.codes == [17, 17], log[-3000:]
    assert "Possible persistent error!" in log
    assert "A checkpoint at the last iteration already exists" in log
    assert _statuses(tracker)[-1] == (1, "second_rerun_not_reproducible")
    assert _exit_code(save) == 17
    verdict = json.loads((save / "rerun_verdict.json").read_text())
    assert verdict["diagnosis"] == "persistent_error" and verdict["iteration"] == BAD
    assert [d for _, d in verdict["suspects"]] == ["cpu:1"]  # rank 1's device of the first launch

    run = _ranks(args, tmp_path / "suspect")  # back on the suspect devices: refused, exit 16
    assert run.codes == [16, 16], run.log[-3000:]
    assert f"cpu:1 produced the persistent error at iteration {BAD + 1}" in run.log
    assert "iteration 3/" not in run.log and "iteration        3/" not in run.log

    run = _ranks(["--save", str(save)], tmp_path / "gpu-c", env={"STALWART_DEVICE_ID": "gpu-c"})
    assert run.codes == [0, 0], run.log[-4000:]  # good hardware
    assert "training on from" in run.log and _exit_code(save) == 0
    assert_params_equal(load_params(save, 4), load_params(reference[0], 4))

    # Resuming that 2-rank checkpoint on 1 rank ignores the rerun state (world size changed).
    caplog.set_level(logging.WARNING)
    copy = tmp_path / "copy"
    outcome = run_training(
        make_config(*TRAIN[len(TINY_FLAGS) :], "--save", str(copy)), DistributedContext()
    )
    assert (outcome.exit_code, outcome.iteration) == (0, 4)
    assert "World size changed (2 -> 1): rerun state ignored" in caplog.text
    assert "Second rerun" not in caplog.text


def test_correct_result_attributed_by_automatic_restart_then_skipped(tmp_path: Path) -> None:
    """One torchrun with 2 restarts: attempt 0 exits 16, attempt 1 ("another GPU") diagnoses a
    correct result and exits 17, attempt 2 reads the tracker and skips exactly that iteration."""
    save, tracker = tmp_path / "ckpt", tmp_path / "tracker.txt"
    proc = _torchrun(_injected("correct_result", save, tracker), restarts=2, wrapper=True)
    log = _log(proc)
    assert proc.returncode == 0, log[-4000:]
    assert _worker_exit_codes(proc) == [16, 17], log[-4000:]
    assert "Correct result (but possible Application error)" in log
    assert _statuses(tracker) == [
        (1, "initial_run"), (1, "first_rerun_reproducible"), (1, "second_rerun_reproducible")
    ]  # fmt: skip
    assert "device=gpu1-restart1" in tracker.read_text().splitlines()[-1]
    assert f"Will skip these iterations from tracker file: [{BAD + 1}]" in log
    assert f"rerun verdict correct_result for iteration {BAD + 1}" in log  # drops the rerun mark
    assert f"skipping iteration {BAD + 1} (--iterations-to-skip)" in log
    assert "exiting program at iteration 4" in log
    assert json.loads((save / "exit_reason.json").read_text())["reason"] == "finished"


def test_persistent_error_diagnosed_by_peer_replay_in_one_launch(
    tmp_path: Path, reference: tuple[Path, str]
) -> None:
    """The same scenario as the exit-16 flow above, with the peer replay: one launch reaches the
    same verdict (persistent error, rank 1's device), saves the pre-iteration state and exits 17;
    a launch elsewhere resumes bitwise equal to no fault."""
    save, tracker = tmp_path / "ckpt", tmp_path / "tracker.txt"
    args = _injected("persistent_error", save, tracker, peer=True)

    run = _ranks(args, tmp_path / "peer")
    log = run.log
    assert run.codes == [17, 17], log[-3000:]
    assert "Replaying iteration 3 on a peer replica: rank 1 on rank 0" in log
    assert "Peer replay verdict" in log and "persistent error on rank 1" in log
    assert _statuses(tracker) == [
        (1, "initial_run"), (1, "first_rerun_reproducible"), (1, "peer_replay_not_reproducible")
    ]  # fmt: skip
    assert _exit_code(save) == 17
    verdict = json.loads((save / "rerun_verdict.json").read_text())
    assert (verdict["diagnosis"], verdict["source"]) == ("persistent_error", "peer_replay")
    assert verdict["iteration"] == BAD and verdict["checkpoint"] == f"iter_{BAD:07d}"
    suspects = json.loads((save / "suspect_devices.json").read_text())
    assert [(s["rank"], s["device"]) for s in suspects["suspects"]] == [(1, "cpu:1")]
    assert suspects["checkpoint"] == f"iter_{BAD:07d}"
    assert_params_equal(load_params(save, BAD), load_params(reference[0], BAD))

    # (A relaunch on the suspect devices is refused by the same verdict file and code as in the
    # exit-16 flow above, tested there.)
    run = _ranks(["--save", str(save)], tmp_path / "gpu-c", env={"STALWART_DEVICE_ID": "gpu-c"})
    assert run.codes == [0, 0], run.log[-4000:]  # good hardware
    assert "training on from" in run.log and _exit_code(save) == 0
    assert_params_equal(load_params(save, 4), load_params(reference[0], 4))


def test_correct_result_diagnosed_by_peer_replay_then_skipped(tmp_path: Path) -> None:
    """As the automatic-restart test above, in one launch: the peer reproduces the value (a
    correct result: exit 17, the iteration saved), the relaunch skips exactly that iteration."""
    save, tracker = tmp_path / "ckpt", tmp_path / "tracker.txt"
    args = _injected("correct_result", save, tracker, peer=True)
    # Two launches, not a torchrun restart (the test above covers those): the same relaunch.
    first = _ranks(args, tmp_path / "fault")
    assert first.codes == [17, 17], first.log[-4000:]
    assert "Correct result (but possible Application error)" in first.log
    assert _statuses(tracker) == [
        (1, "initial_run"), (1, "first_rerun_reproducible"), (1, "peer_replay_reproducible")
    ]  # fmt: skip
    second = _ranks(args, tmp_path / "relaunch")
    assert second.codes == [0, 0], second.log[-4000:]
    assert f"Will skip these iterations from tracker file: [{BAD + 1}]" in second.log
    assert f"skipping iteration {BAD + 1} (--iterations-to-skip)" in second.log
    assert "exiting program at iteration 4" in second.log
    assert not (save / "suspect_devices.json").exists()
