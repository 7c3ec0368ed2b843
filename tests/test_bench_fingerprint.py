"""The fingerprint-overhead benchmark runs on CPU at tiny sizes (a smoke test; figures are the
GPU's): every variant is timed and each fingerprinting one fingerprinted every iteration."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import fingerprint_overhead  # type: ignore[import-not-found]

TINY = ("--num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 16 "
        "--vocab-size 256 --micro-batch-size 2")  # fmt: skip


def test_fingerprint_overhead_runs_on_cpu(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "result.json"
    argv = ["--device", "cpu", "--preset", "tiny", "--modes", "eager", "--iters", "2",
            "--rounds", "1", "--warmup", "1", "--num-microbatches", "2",
            "--sample-fraction", "0.5", "--extra", TINY, "--json", str(out)]  # fmt: skip
    assert fingerprint_overhead.main(argv) == 0
    text = capsys.readouterr().out
    assert "| off |" in text and "| sampled |" in text and "| full |" in text
    assert "sampled fingerprint costs" in text and "full fingerprint costs" in text
    (result,) = json.loads(out.read_text())["results"]
    rows = {r["variant"]: r for r in result["rows"]}
    assert rows["off"]["fingerprints"] == {"recorded": 0, "iterations": 3}
    for name, groups in (("sampled", 2), ("full", 1)):
        fp = rows[name]["fingerprints"]
        assert fp["recorded"] == fp["iterations"] == 3  # warm-up 1 + 1 round of 2
        assert fp["groups"] == groups and fp["with_grad"] == fp["parameters"] > 0
    assert result["target"] is None  # the target is the H200's, at gpt2-124m


def test_fingerprint_overhead_refuses_a_variant_that_does_not_fingerprint(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A fingerprinting variant whose gate is missing (the flags built none) is an error, not
    a figure of nothing."""
    monkeypatch.setattr(
        fingerprint_overhead, "variant_flags", lambda f: {"off": [], "sampled": [], "full": []}
    )
    argv = ["--device", "cpu", "--preset", "tiny", "--modes", "eager", "--iters", "1",
            "--rounds", "1", "--warmup", "0", "--extra", TINY]  # fmt: skip
    assert fingerprint_overhead.main(argv) == 1  # the next mode would still be measured
    assert "sampled: the flags" in capsys.readouterr().out


def test_fingerprint_overhead_refuses_a_fingerprint_that_did_not_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A world of one must still fingerprint: a step that skips it voids the figure."""
    from stalwart.reliability.rerun.machine import RerunStateMachine

    monkeypatch.setattr(RerunStateMachine, "record_replicas", lambda self, *a, **k: None)
    argv = ["--device", "cpu", "--preset", "tiny", "--modes", "eager", "--iters", "1",
            "--rounds", "1", "--warmup", "0", "--extra", TINY]  # fmt: skip
    assert fingerprint_overhead.main(argv) == 1
    assert "RuntimeError: sampled: 0 fingerprints in 1 steps" in capsys.readouterr().out
