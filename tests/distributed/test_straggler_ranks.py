from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from stalwart.observability.straggler import STRAGGLER_FILE, StragglerDetector

from dist_utils import run_distributed


def _body(rank: int, world_size: int, run_dir: str) -> tuple[list[int], list[float], int]:
    det = StragglerDetector(torch.device("cpu"), rank, world_size, threshold=1.5, run_dir=run_dir)
    for _ in range(2):
        with det.compute():
            time.sleep(0.005 if rank == 0 else 0.05)  # rank 1 is slow inside compute
        det.step()
    report = det.report(iteration=2)
    slowest = report.slowest[0][0]
    return report.stragglers, report.compute_ms, slowest


@pytest.mark.distributed
def test_slow_rank_is_named(tmp_path: Path) -> None:
    results = run_distributed(_body, world_size=2, args=(str(tmp_path),))
    for stragglers, compute_ms, slowest in results:
        assert stragglers == [1]
        assert slowest == 1
        assert compute_ms[1] > 1.5 * compute_ms[0]
    lines = (tmp_path / STRAGGLER_FILE).read_text().splitlines()
    assert len(lines) == 1  # only rank 0 writes
    assert json.loads(lines[0])["stragglers"] == [1]
