"""A hang under torchrun (2 gloo ranks) at default escalation settings: every rank is torn down
within the step timeout + 10 s, and the soft tier's stack dump is in the run directory before
the kill. Rank 1 sleeps inside a step; rank 0 waits for it in the step's collective."""

from __future__ import annotations

import json
import time

import pytest
from ft_utils import LiveRun

from train_utils import TINY_FLAGS

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEP_TIMEOUT = 3.0


def test_hang_tears_every_rank_down_within_the_step_timeout_plus_10s(tmp_path) -> None:
    save = tmp_path / "ckpt"
    args = ["train", *TINY_FLAGS, "--train-iters", "40", "--global-batch-size", "8",
            "--log-interval", "1", "--save", str(save), "--enable-ft",
            "--ft-num-warmup-iters", "2", "--ft-timeouts", f"step={STEP_TIMEOUT:g}",
            "--inject-fault", "hang", "--inject-fault-iteration", "6",
            "--inject-fault-rank", "1"]  # fmt: skip
    job = LiveRun(args, torchrun_args=["--max-restarts", "0", "--monitor-interval", "0.2"])
    try:
        code = job.wait(180)
        down = time.time()  # torchrun has reaped every worker
    finally:
        job.close()
    assert code != 0
    fired = json.loads((save / ".stalwart_fault_fired_hang_6_1").read_text())["time"]
    torn_down = down - fired
    print(f"hang -> all ranks down: {torn_down:.2f} s (step timeout {STEP_TIMEOUT:g} s)")
    assert torn_down <= STEP_TIMEOUT + 10.0, job.output[-3000:]
    logs = save / "ft_logs"
    stacks = logs / "stacks_rank1.txt"
    assert "_hang" in stacks.read_text()  # the hung rank's stacks (faulthandler, all threads)
    report = logs / "ft_hang_rank1.json"
    assert stacks.stat().st_mtime <= report.stat().st_mtime  # dumped before the kill
    assert json.loads(report.read_text())["tiers"][0] == "soft"
    monitor_log = (logs / "monitor_rank1.log").read_text()
    assert "hard tier: aborted the worker's process groups" in monitor_log
