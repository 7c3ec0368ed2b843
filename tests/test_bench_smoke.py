"""The check-overhead benchmark runs on CPU at tiny sizes (a smoke test; figures are the GPU's)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import check_overhead  # type: ignore[import-not-found]

TINY = ("--num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 16 "
        "--vocab-size 256 --micro-batch-size 2")  # fmt: skip


def test_check_overhead_runs_on_cpu(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    argv = ["--device", "cpu", "--presets", "tiny", "--modes", "eager", "--iters", "2",
            "--rounds", "1", "--warmup", "1", "--num-microbatches", "2", "--extra", TINY,
            "--min-window-ms", "0", "--json", str(out)]  # fmt: skip
    assert check_overhead.main(argv) == 0
    text = capsys.readouterr().out
    assert "| off |" in text and "| checks |" in text and "checks cost" in text
    rows = {
        r["variant"]: r for r in __import__("json").loads(out.read_text())["results"][0]["rows"]
    }
    assert rows["off"]["lookahead_used_of_launched"] == [0, 0]  # truly off: nothing launched
    assert rows["checks"]["lookahead_used_of_launched"][1] > 0


def test_check_ops_runs_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    import check_ops  # type: ignore[import-not-found]

    argv = ["--device", "cpu", "--presets", "tiny", "--warmup", "1", "--iters", "1",
            "--num-microbatches", "2", "--extra", TINY, "-v"]  # fmt: skip
    assert check_ops.main(argv) == 0
    text = capsys.readouterr().out
    assert "| off |" in text and "| checks |" in text and "checks add" in text
    assert "host reads (checks): {'tolist at stalwart/reliability/rerun/checks/buffer.py" in text


def test_cross_entropy_fusion_runs_on_cpu(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import cross_entropy_fusion  # type: ignore[import-not-found]

    out = tmp_path / "result.json"
    assert cross_entropy_fusion.main(["--smoke", "--json", str(out)]) == 0
    assert "| fused |" in capsys.readouterr().out
    result = __import__("json").loads(out.read_text())
    assert result["check"]["grad_w_rel"] < 1e-5 and result["check"]["loss_diff"] < 1e-5
    assert [r["variant"] for r in result["rows"]] == ["unfused", "fused"]


def test_attention_backends_runs_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    import attention_backends  # type: ignore[import-not-found]

    assert attention_backends.main(["--smoke"]) == 0
    assert "| math |" in capsys.readouterr().out


def test_trace_gaps_reads_a_chrome_trace(tmp_path: Path) -> None:
    """Busy time is the union of the device intervals; a gap lists the host ops inside it."""
    import trace_gaps  # type: ignore[import-not-found]

    def event(cat: str, name: str, ts: float, dur: float) -> dict:
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}

    trace = {"traceEvents": [
        event("kernel", "gemm", 0, 100), event("kernel", "gemm", 50, 100),  # overlap: 0-150
        event("gpu_memcpy", "Memcpy HtoD", 400, 50),  # a 250 us gap before it
        event("kernel", "softmax", 460, 40),  # a 10 us gap: under --min-gap-us
        event("cpu_op", "aten::item", 140, 200), event("cpu_op", "aten::add", 10, 20),
    ]}  # fmt: skip
    path = tmp_path / "trace.json"
    path.write_text(__import__("json").dumps(trace))
    result = trace_gaps.summarize(str(path), iterations=2, top=5, min_gap_us=20.0)
    assert result["span_ms"] == pytest.approx(0.5 / 2)
    assert result["busy_ms"] == pytest.approx(0.24 / 2)  # 150 + 50 + 40 us
    assert result["idle_ms"] == pytest.approx(0.26 / 2)
    (gap,) = result["top_gaps"]
    assert gap["us"] == 250 and gap["before"] == "gemm" and gap["after"] == "Memcpy HtoD"
    assert gap["host"] == ["aten::item"]
    assert result["top_kernels_ms"][0] == ("gemm", pytest.approx(0.2 / 2))


def test_checkpoint_save_bench_measures_the_checksums(capsys, tmp_path: Path) -> None:
    import checkpoint_save  # type: ignore[import-not-found]

    out = tmp_path / "ckpt.json"
    argv = ["--preset", "tiny", "--device", "cpu", "--repeats", "1", "--warmup", "0",
            "--json", str(out)]  # fmt: skip
    assert checkpoint_save.main(argv) == 0
    text = capsys.readouterr().out
    assert "| async-no-checksums |" in text and "checksums: one pass alone" in text
    assert "of the async save's total" in text
    result = __import__("json").loads(out.read_text())
    assert len(result["manifest_s"]) == 1 and set(result["samples_s"]) == set(checkpoint_save.MODES)


def test_local_snapshot_runs_on_cpu(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Every variant took every due snapshot (the benchmark checks it), the table prints."""
    import local_snapshot  # type: ignore[import-not-found]

    out = tmp_path / "result.json"
    argv = ["--device", "cpu", "--preset", "tiny", "--iters", "10", "--rounds", "1"]
    argv += ["--warmup", "10", "--num-microbatches", "1", "--extra", TINY]
    argv += ["--local-dir", str(tmp_path)]
    argv += ["--json", str(out)]
    assert local_snapshot.main(argv) == 0
    assert "| local |" in capsys.readouterr().out
    result = __import__("json").loads(out.read_text())
    assert result["snapshots"] == {
        "local": {"snapshots": 2, "newest": 20},
        "in_memory": {"snapshots": 2, "newest": 20},
    }
