"""The per-iteration logging benchmark runs on CPU at tiny sizes (a smoke test; the figure that
counts is the GPU's, gpt2-124m graphed)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import iteration_log_overhead  # type: ignore[import-not-found]

TINY = ("--num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 16 "
        "--vocab-size 256 --micro-batch-size 2")  # fmt: skip


def test_iteration_log_overhead_runs_on_cpu(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "result.json"
    argv = ["--device", "cpu", "--presets", "tiny", "--modes", "eager", "--iters", "2",
            "--rounds", "1", "--warmup", "1", "--log-interval", "2", "--num-microbatches", "1",
            "--extra", TINY, "--min-window-ms", "0", "--json", str(out)]  # fmt: skip
    assert iteration_log_overhead.main(argv) == 0
    text = capsys.readouterr().out
    assert "| off |" in text and "| ring |" in text and "per-iteration rows cost" in text
    (result,) = json.loads(out.read_text())["results"]
    assert {r["variant"] for r in result["rows"]} == {"off", "ring"}
    # The ring wrote one row per iteration it ran (warm-up included); off wrote none.
    assert result["ring_rows"] == result["iterations"] > 0
