"""``stalwart launch`` over the real trainer: 3 gloo ranks on fake devices, a persistent fault
on one device, diagnosed by peer replay (exit 17, ``suspect_devices.json``), relaunched
without that device on 2 ranks (the global batch kept: 2 -> 3 micro-batches per rank, the DCP
checkpoint of 3 ranks resumed by 2), trained to the end, bitwise equal to the fault-free job
that changes world size at the same checkpoint."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from stalwart.observability.goodput.reader import read_ledger
from stalwart.observability.goodput.records import summarize

from dist_utils import run_cli_on_ranks
from train_utils import REPO, TINY_FLAGS, assert_params_equal, load_params

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ITERS, BAD = 6, 4  # the fault at iteration 4 as logged: peer replay saves iteration 3
TRAIN = [*TINY_FLAGS, "--train-iters", str(ITERS), "--global-batch-size", "24", "--seed", "3",
         "--save-interval", "2", "--log-interval", "1"]  # fmt: skip
FAULT = ["--error-injection-rate", "1", "--error-injection-type", "persistent_error",
         "--error-injection-iterations", str(BAD), "--error-injection-devices", "dev-b"]  # fmt: skip


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STALWART_")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src")}


def test_persistent_fault_on_a_device_relaunches_without_it(tmp_path: Path) -> None:
    save = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "stalwart", "launch", "--nproc-per-node", "3", "--devices",
           "dev-a,dev-b,dev-c", "--max-restarts", "2", "--monitor-interval", "0.2", "--",
           *TRAIN, *FAULT, "--save", str(save)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=400, cwd=REPO)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    host = socket.gethostname()
    assert "Peer replay verdict" in log and "persistent error on rank 1" in log, log[-5000:]
    assert (f"stalwart launch: exclude: exit 17: suspect device(s) {host}/dev-b: relaunching "
            "without them on 2 rank(s) (dev-a, dev-c), global batch 24 kept: 3 micro-batches "
            "per rank") in log  # fmt: skip
    assert "this launch does not run on a suspect device" in log
    suspects = json.loads((save / "suspect_devices.json").read_text())["suspects"]
    assert [(s["host"], s["device"]) for s in suspects] == [(host, "dev-b")]
    summary = summarize(read_ledger(save / "goodput.jsonl"))
    assert [a.get("action") for a in summary.actions] == ["exclude", "finished"]
    assert (
        summary.sessions[-1].resumed_at == BAD - 1 and summary.sessions[-1].end_reason == "finished"
    )
    events = [json.loads(line) for line in (save / "events.jsonl").read_text().splitlines()]
    assert [e["detail"].split(":")[0] for e in events if e["kind"] == "launch"] == [
        "exclude",
        "finished",
    ]

    # The fault-free job with the same world-size change: 3 ranks to iteration 3, 2 from there.
    ref = tmp_path / "ref"
    first = run_cli_on_ranks(["train", *TRAIN, "--save", str(ref), "--exit-interval", str(BAD - 1)],
                             tmp_path / "ref3", world_size=3, timeout_s=240)  # fmt: skip
    assert first.codes == [0, 0, 0], first.log[-3000:]
    second = run_cli_on_ranks(["train", *TRAIN, "--save", str(ref)], tmp_path / "ref2",
                              world_size=2, timeout_s=240)  # fmt: skip
    assert second.codes == [0, 0], second.log[-3000:]
    assert_params_equal(load_params(save, ITERS), load_params(ref, ITERS))
