"""Full-iteration graphs on two GPUs (torchrun + NCCL + DDP): capture, replay, global skip gate.

Needs a machine with two CUDA devices (run by ``scripts/gpu_check.sh`` on the device machine).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from stalwart.reliability.rerun import EXIT_CODE_FAILED_ON_RESULT_VALIDATION

from train_utils import run_cli

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

ITERS = 20
FLAGS = [
    "train", "--preset", "tiny", "--bf16", "--train-iters", str(ITERS), "--log-interval", "1",
    "--micro-batch-size", "4", "--global-batch-size", "32", "--lr", "1e-3",
    "--lr-warmup-iters", "5", "--clip-grad", "1.0", "--no-progress-bar",
]  # fmt: skip
GRAPHS = ["--cuda-graph-impl", "full_iteration", "--optimizer-cuda-graph"]


def _losses(path: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["iteration"]: r["lm loss"] for r in rows if r.get("split") == "train"}


def test_two_rank_graphs_follow_eager_and_a_one_rank_fault_stops_both(tmp_path: Path) -> None:
    eager = run_cli([*FLAGS, "--metrics-file", str(tmp_path / "eager.jsonl")], nproc=2)
    assert eager.returncode == 0, eager.stderr[-3000:]
    graphed = run_cli([*FLAGS, *GRAPHS, "--metrics-file", str(tmp_path / "graphs.jsonl")], nproc=2)
    assert graphed.returncode == 0, graphed.stderr[-3000:]
    assert "raised to 11 for DistributedDataParallel" in graphed.stderr
    a, b = _losses(tmp_path / "eager.jsonl"), _losses(tmp_path / "graphs.jsonl")
    assert sorted(a) == sorted(b) == list(range(1, ITERS + 1))
    worst = max(abs(a[i] - b[i]) for i in a)
    print(f"two ranks: eager vs graphs worst |d lm loss| {worst:.3e}, final {a[ITERS]}, {b[ITERS]}")
    # Fused (graphs) vs foreach (eager) AdamW and bf16 kernels on other streams: not bitwise.
    assert worst < 2e-2 and b[ITERS] < b[1] - 0.5

    # A NaN on rank 1 only, after capture (iteration 15): the max-reduced gate skips the
    # optimizer replay on both ranks, the machine reruns, finds it transient and exits 17.
    tracker = tmp_path / "tracker.txt"
    injected = run_cli(
        [*FLAGS, *GRAPHS, "--error-injection-rate", "1", "--error-injection-type",
         "transient_error", "--error-injection-iterations", "15", "--error-injection-ranks", "1",
         "--result-rejected-tracker-filename", str(tracker)],
        nproc=2,
    )  # fmt: skip
    assert injected.returncode != 0
    codes = {int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", injected.stderr)}
    # The first rank to exit 17 makes torchrun SIGTERM the other (-15) if it is still running.
    assert EXIT_CODE_FAILED_ON_RESULT_VALIDATION in codes, injected.stderr[-3000:]
    assert codes <= {EXIT_CODE_FAILED_ON_RESULT_VALIDATION, -15}, injected.stderr[-3000:]
    assert "Need to rerun iteration 15" in injected.stderr  # rank 0 reran too: the gate is global
    assert "Possible transient error" in injected.stderr + injected.stdout
    assert "iteration=15" in tracker.read_text()
