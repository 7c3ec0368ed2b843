"""Shared test fixtures: makes tests/ importable for helpers such as dist_utils."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

import session_guard

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")
# A `stalwart train` without --save writes a default run directory under $STALWART_RUNS_DIR
# (else ./runs): tests and the subprocesses they start write it into a temporary directory,
# never into the checkout.
if "STALWART_RUNS_DIR" not in os.environ:
    _RUNS = tempfile.mkdtemp(prefix="stalwart-test-runs-")
    os.environ["STALWART_RUNS_DIR"] = _RUNS
    atexit.register(shutil.rmtree, _RUNS, True)


@pytest.fixture(scope="session")
def two_rank_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``--save`` of the fault-free 12-iteration tiny job on 2 gloo ranks (seed 3, global batch
    8, checkpoints every 3), trained once per test session: read it, never write into it."""
    from shared_runs import build_two_rank_reference, shared_run

    return shared_run(tmp_path_factory, "two-rank-reference", build_two_rank_reference) / "ckpt"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The session is over: from here on only its summary and the interpreter's exit run. If
    they hang (a thread the exit waits for, a destructor, a CUDA synchronize), the stacks are
    printed and the process ends with code 1. Then what failed tests left (their frames,
    cyclic garbage) is freed while CUDA is whole, not at the interpreter's shutdown
    (`session_guard`)."""
    if session_guard.is_pytest_main_process(sys.argv, os.environ):
        session_guard.arm_exit_watchdog(session_guard.exit_timeout())
    session_guard.release_leftovers()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    line = session_guard.leftovers()
    if line is not None:
        terminalreporter.write_line(line, yellow=True)
