"""Two ranks under torchrun/gloo: resume is exact, and the checkpoint reshards to one rank."""

from __future__ import annotations

import shutil

import pytest

from train_utils import TINY_FLAGS, assert_params_equal, load_params, run_cli

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

COMMON = ["train", *TINY_FLAGS, "--train-iters", "12", "--seed", "3", "--global-batch-size", "8"]


def _ok(proc) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_two_ranks_resume_exact_and_reshard_to_one(tmp_path) -> None:
    straight, split = tmp_path / "straight", tmp_path / "split"
    _ok(run_cli([*COMMON, "--save", str(straight)], nproc=2))
    _ok(run_cli([*COMMON, "--save", str(split), "--exit-interval", "6"], nproc=2))
    assert (split / "latest_checkpointed_iteration.txt").read_text() == "6\n"
    shutil.copytree(split, tmp_path / "reshard")
    _ok(run_cli([*COMMON, "--save", str(split)], nproc=2))
    assert_params_equal(load_params(straight), load_params(split))

    # The 2-rank checkpoint at iteration 6 resumes on one rank (2 micro-batches per iteration).
    proc = run_cli([*COMMON, "--save", str(tmp_path / "reshard")], nproc=1)
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
    _ok(run_cli([*common, "--save", str(ddp)], nproc=2))
    _ok(run_cli([*common, "--save", str(fsdp), "--use-torch-fsdp2"], nproc=2))
    a, b = load_params(ddp), load_params(fsdp)
    for key in a:  # same math, different reduction order
        assert (a[key] - b[key]).abs().max() < 1e-4, key
