"""``--num-workers``: DataLoader workers change nothing but who reads the data.

The trainer with workers ends bitwise equal to the trainer without them, resumes exactly, and a
job-wide SIGTERM (a scheduler's ``scancel`` signals every process, workers included) still ends
in a save at the agreed iteration from which the run continues exactly.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from stalwart.distributed.process_group import DistributedContext
from stalwart.train.trainer import run_training

from train_utils import (
    REPO,
    TINY_FLAGS,
    assert_params_equal,
    cli_command,
    cli_env,
    load_params,
    make_config,
)

COMMON = ["--train-iters", "8", "--seed", "11", "--global-batch-size", "8"]  # 2 micro-batches


def test_workers_train_bitwise_like_the_loop_and_resume_exactly(tmp_path) -> None:
    plain, workers = tmp_path / "plain", tmp_path / "workers"
    run_training(make_config(*COMMON, "--save", str(plain)), DistributedContext())
    first = make_config(*COMMON, "--save", str(workers), "--num-workers", "2",
                        "--exit-interval", "3")  # fmt: skip
    assert run_training(first, DistributedContext()).iteration == 3
    # Resume with a different worker count: the checkpoint holds the loop's position only.
    rest = make_config(*COMMON, "--save", str(workers), "--num-workers", "1")
    outcome = run_training(rest, DistributedContext())
    assert (outcome.iteration, outcome.exit_code) == (8, 0)
    assert_params_equal(load_params(workers), load_params(plain))


@pytest.mark.slow
def test_sigterm_to_the_whole_process_group_saves_and_resumes_exactly(tmp_path) -> None:
    save = tmp_path / "ckpt"
    args = [*TINY_FLAGS, *COMMON, "--train-iters", "200", "--log-interval", "1",
            "--save", str(save), "--num-workers", "2", "--exit-signal-handler"]  # fmt: skip
    proc = subprocess.Popen(
        cli_command(["train", *args]),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=cli_env(),
        cwd=REPO,
        start_new_session=True,  # its own process group: the job, as a scheduler sees it
    )
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "iteration 4/" in line:
            break
    workers = _children(proc.pid)
    assert len(workers) == 2, (workers, "".join(lines))
    # The workers ignore SIGTERM (DataLoaderWorkerSignalGuard), the trainer handles it.
    assert all(_ignores_sigterm(pid) for pid in workers), workers
    assert not _ignores_sigterm(proc.pid)
    os.killpg(proc.pid, signal.SIGTERM)  # trainer and workers, like scancel
    rest, _ = proc.communicate(timeout=120)
    out = "".join(lines) + rest
    assert proc.returncode == 0, out[-3000:]
    assert "DataLoader worker" not in out, out[-3000:]
    reason = json.loads((save / "exit_reason.json").read_text())
    assert reason["reason"] == "signal", reason
    stopped = reason["iteration"]
    assert (
        stopped >= 4 and (save / "latest_checkpointed_iteration.txt").read_text() == f"{stopped}\n"
    )
    assert not any(_alive(pid) for pid in workers)

    # Same schedule (200 iterations), both stopped at stopped + 2 by the exit interval.
    until = ["--train-iters", "200", "--exit-interval", str(stopped + 2)]
    straight = tmp_path / "straight"
    run_training(make_config(*COMMON, *until, "--save", str(straight)), DistributedContext())
    resumed = make_config(*COMMON, *until, "--save", str(save), "--num-workers", "2")
    assert run_training(resumed, DistributedContext()).iteration == stopped + 2
    assert_params_equal(load_params(save), load_params(straight))


def _children(pid: int) -> list[int]:
    import psutil

    return [p.pid for p in psutil.Process(pid).children(recursive=True)]


def _ignores_sigterm(pid: int) -> bool:
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigIgn:"))
    return bool(mask >> (signal.SIGTERM - 1) & 1)


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
