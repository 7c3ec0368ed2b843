"""SIGKILL during a save never corrupts the checkpoint chain (sync and async)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from ckpt_fixtures import assert_same, make_model, make_optimizer, snapshot

from stalwart.checkpoint import CheckpointManager, layout, read_tracker

CHILD = os.path.join(os.path.dirname(__file__), "ckpt_crash_child.py")


def _wait_for_shards(save_dir: str, proc: subprocess.Popen, timeout_s: float = 60.0) -> str:
    """Wait until the child announced READY and iteration 2's DCP metadata exists in a tmp dir."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "READY", line
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for tmp in layout.list_tmp_dirs(save_dir):
            if os.path.isfile(os.path.join(tmp, layout.DCP_METADATA_FILENAME)):
                return tmp
        time.sleep(0.05)
    raise AssertionError("iteration 2 shards never appeared")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigkill_during_save_keeps_previous_checkpoint(tmp_path, mode: str) -> None:
    save_dir = str(tmp_path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(CHILD), *sys.path]))
    proc = subprocess.Popen(
        [sys.executable, CHILD, save_dir, mode], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        tmp = _wait_for_shards(save_dir, proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert read_tracker(save_dir) == 1
    assert layout.list_complete_checkpoints(save_dir) == [1]
    assert os.path.isdir(tmp)  # the half-finished save is still there, and ignored

    model = make_model(seed=7)
    opt = make_optimizer(model)
    mgr = CheckpointManager(save_dir)
    assert mgr.latest_iteration() == 1
    loaded = mgr.load(model, opt)
    assert loaded is not None and loaded.iteration == 1 and loaded.common == {"iteration": 1}
    expected = torch.load(os.path.join(save_dir, "expected_1.pt"), weights_only=False)
    assert_same(expected, snapshot(model, opt))

    mgr.save(3, model, opt, {"iteration": 3}, {})  # the next save removes the leftover
    assert not os.path.exists(tmp)
    assert read_tracker(save_dir) == 3
