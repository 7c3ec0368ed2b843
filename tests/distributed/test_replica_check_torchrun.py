"""Silent data corruption between DDP replicas, end to end (2 gloo ranks running the CLI,
forked from the test's fork server as torchrun's workers would be: ``run_cli_on_ranks``).

``--inject-fault bitflip`` flips one bit of one weight on rank 1 only: nothing errors, the
replicas silently diverge. ``--check-weight-hash-across-dp-replicas-interval`` must catch it at
its next check, exit 17 without writing a checkpoint from the diverged weights, and the relaunch
must resume from the last (checked) checkpoint and end bitwise equal to a fault-free run.
"""

from __future__ import annotations

import json

import pytest
from ft_utils import logged_iterations, read_tracker

from dist_utils import run_cli_on_ranks
from train_utils import TINY_FLAGS, assert_params_equal, load_params

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

COMMON = ["train", *TINY_FLAGS, "--train-iters", "8", "--seed", "3", "--global-batch-size", "8",
          "--log-interval", "1", "--save-interval", "2"]  # fmt: skip
CHECK = ["--check-weight-hash-across-dp-replicas-interval", "4"]


def test_bitflip_on_one_replica_is_caught_and_the_relaunch_is_exact(tmp_path) -> None:
    reference = tmp_path / "reference"
    proc = run_cli_on_ranks([*COMMON, "--save", str(reference)], tmp_path / "reference-logs")
    assert proc.returncode == 0, proc.stderr[-3000:]

    save = tmp_path / "ckpt"
    fault = ["--inject-fault", "bitflip", "--inject-fault-iteration", "3",
             "--inject-fault-rank", "1"]  # fmt: skip
    proc = run_cli_on_ranks([*COMMON, "--save", str(save), *CHECK, *fault], tmp_path / "fault-logs")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    reason = json.loads((save / "exit_reason.json").read_text())
    assert (reason["reason"], reason["exit_code"], reason["iteration"]) == (
        "replica_mismatch", 17, 3,
    ), reason  # fmt: skip
    # Caught inside the step of iteration 4 (the in-step fingerprint, before its optimizer step:
    # 3 iterations completed), not at 8; named rank and weight.
    # Two replicas: nothing tells which one is right, and the message says so.
    assert "no majority tells which replica is right: ranks [0] vs ranks [1]" in out, out[-3000:]
    assert "word_embeddings.weight" in reason["detail"]
    assert read_tracker(save) == 2  # the diverged state of iteration 4 was never saved
    assert not (save / "iter_0000004").exists()

    proc = run_cli_on_ranks(
        [*COMMON, "--save", str(save), *CHECK, *fault], tmp_path / "relaunch-logs"
    )  # fired once
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert logged_iterations(proc.stdout)[0] == 3
    assert_params_equal(load_params(save), load_params(reference))


def test_check_before_every_save_even_off_interval(tmp_path) -> None:
    """Interval 5, saves every 2: the flip at 3 is caught by the check before the save of 4."""
    save = tmp_path / "ckpt"
    args = [*COMMON, "--save", str(save), "--check-weight-hash-across-dp-replicas-interval", "5",
            "--inject-fault", "bitflip", "--inject-fault-iteration", "3",
            "--inject-fault-rank", "0"]  # fmt: skip
    proc = run_cli_on_ranks(args, tmp_path / "logs")
    assert proc.returncode != 0
    reason = json.loads((save / "exit_reason.json").read_text())
    assert (reason["reason"], reason["iteration"]) == ("replica_mismatch", 4), reason
    assert "ranks [0] vs ranks [1]" in reason["detail"]
