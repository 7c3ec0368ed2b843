"""Two gloo ranks: resume is exact, and the checkpoint reshards to one rank.

The ranks run the CLI as torchrun's workers would, forked from the test's fork server
(``run_cli_on_ranks``: no torch import per process); torchrun itself is tested where it matters
(restarts, signals to the launcher: test_ft_torchrun.py, test_rerun_torchrun.py).
"""

from __future__ import annotations

import shutil

import pytest

from dist_utils import run_cli_on_ranks
from train_utils import TINY_FLAGS, assert_params_equal, load_params

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

COMMON = ["train", *TINY_FLAGS, "--train-iters", "12", "--seed", "3", "--global-batch-size", "8"]


def _ok(proc) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_two_ranks_resume_exact_and_reshard_to_one(tmp_path, two_rank_reference) -> None:
    straight, split = two_rank_reference, tmp_path / "split"  # COMMON's job, uninterrupted
    _ok(
        run_cli_on_ranks(
            [*COMMON, "--save", str(split), "--exit-interval", "6"], tmp_path / "launch1"
        )
    )
    assert (split / "latest_checkpointed_iteration.txt").read_text() == "6\n"
    shutil.copytree(split, tmp_path / "reshard")
    _ok(run_cli_on_ranks([*COMMON, "--save", str(split)], tmp_path / "launch2"))
    assert_params_equal(load_params(straight), load_params(split))

    # The 2-rank checkpoint at iteration 6 resumes on one rank (2 micro-batches per iteration).
    proc = run_cli_on_ranks([*COMMON, "--save", str(tmp_path / "reshard")], tmp_path, world_size=1)
    _ok(proc)
    assert "resumed from" in proc.stdout and "at iteration 6" in proc.stdout
    one_rank = load_params(tmp_path / "reshard")
    two_rank = load_params(straight)
    # Same samples per global batch; only the reduction order differs, so close, not bitwise.
    for key in one_rank:
        assert (one_rank[key] - two_rank[key]).abs().max() < 1e-4, key


def test_fsdp2_two_ranks_trains_like_ddp(tmp_path) -> None:
    ddp, fsdp = tmp_path / "ddp", tmp_path / "fsdp"
    # 2 micro-batches per rank: gradient accumulation with deferred reduction in both wrappers.
    common = [*COMMON, "--train-iters", "6", "--global-batch-size", "16"]
    _ok(run_cli_on_ranks([*common, "--save", str(ddp)], tmp_path / "launch3"))
    _ok(run_cli_on_ranks([*common, "--save", str(fsdp), "--use-torch-fsdp2"], tmp_path / "launch4"))
    a, b = load_params(ddp), load_params(fsdp)
    for key in a:  # same math, different reduction order
        assert (a[key] - b[key]).abs().max() < 1e-4, key


def test_ramp_blend_and_workers_on_two_ranks_resume_exact(tmp_path) -> None:
    """The data features together on 2 ranks: a 2-source blend read by a DataLoader worker per
    rank under a batch-size ramp (4 -> 8 -> 12 samples, 1 -> 3 micro-batches per rank); a stop
    inside the ramp and a resume (without workers) end bitwise equal to the straight run."""
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    b.write_text("0123456789 " * 1500)
    args = ["train", *TINY_FLAGS, "--seed", "4", "--micro-batch-size",
            "2", "--global-batch-size", "12", "--rampup-batch-size", "4", "4", "24",
            "--train-samples", "60", "--lr-warmup-iters", "0", "--lr-warmup-samples", "8",
            "--data-path", "0.7", str(a), "0.3", str(b)]  # fmt: skip
    straight, split = tmp_path / "straight", tmp_path / "split"
    _ok(
        run_cli_on_ranks(
            [*args, "--save", str(straight), "--num-workers", "1"], tmp_path / "launch5"
        )
    )
    stop = ["--num-workers", "1", "--exit-interval", "4"]
    _ok(run_cli_on_ranks([*args, "--save", str(split), *stop], tmp_path / "launch6"))
    assert (split / "latest_checkpointed_iteration.txt").read_text() == "4\n"
    proc = run_cli_on_ranks([*args, "--save", str(split)], tmp_path / "launch7")
    _ok(proc)
    assert "at iteration 4" in proc.stdout
    assert_params_equal(load_params(straight), load_params(split))
