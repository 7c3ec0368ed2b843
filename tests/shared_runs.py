"""One expensive fault-free run shared by every test (and every pytest-xdist worker) that
compares against it, instead of one copy per test module.

The first caller builds the run under a file lock in the session's common temp directory;
the others wait for the lock and read the finished directory. A build that failed leaves no
``.done`` marker, so the next caller builds it again (and fails the same way, in its own test).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock


def shared_run(factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """``<session temp>/<name>``, built once by ``build(path)`` across all xdist workers."""
    base = factory.getbasetemp()
    # Under xdist each worker's basetemp is <session>/popen-gwN; the session directory is shared.
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    path = root / name
    with FileLock(str(root / f"{name}.lock")):
        if not (path / ".done").exists():
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True)
            build(path)
            (path / ".done").write_text("")
    return path


# The fault-free 2-rank job that the torchrun fault tests compare against (checkpoints at 3, 6,
# 9 and 12): tests/distributed/test_ft_torchrun.py, test_trainer_torchrun.py and
# test_inprocess_restart.py each trained their own copy of it. Its 2 ranks are forked from the
# fork server (no torchrun): the torchrun runs that end bitwise equal to it also check that the
# two launches train alike.
REFERENCE_ARGS = ["--train-iters", "12", "--seed", "3", "--global-batch-size", "8",
                  "--save-interval", "3"]  # fmt: skip


def build_two_rank_reference(path: Path) -> None:
    from dist_utils import run_cli_on_ranks
    from train_utils import TINY_FLAGS

    proc = run_cli_on_ranks(
        ["train", *TINY_FLAGS, *REFERENCE_ARGS, "--save", str(path / "ckpt")], path / "logs"
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
