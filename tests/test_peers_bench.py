"""bench/peers.py on CPU (``--smoke``: a tiny Llama, no compile): stalwart's trainer and the
Hugging Face Trainer each run in their own process and land in one table and one JSON with
every field; torchtitan is skipped with the reason (not installed here, or no GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIELDS = (
    "ms_median",
    "ms_min",
    "ms_max",
    "tokens_per_s",
    "tflops",
    "first_iteration_s",
    "steady_s",
)


def test_peers_smoke_table_and_json(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(REPO / "bench" / "peers.py"), "--smoke", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "peers.json").read_text())
    rows = {r["peer"]: r for r in report["rows"]}
    assert set(rows) == {"stalwart", "torchtitan", "hf"}
    for peer in ("stalwart", "hf"):
        row = rows[peer]
        assert all(row.get(f) is not None for f in FIELDS), (peer, row)
        assert len(row["windows_ms"]) == 2 and row["ms_min"] <= row["ms_median"] <= row["ms_max"]
        assert row["tokens_per_s"] == pytest.approx(128 / (row["ms_median"] / 1e3))
    assert "--check-for-spiky-loss" in rows["stalwart"]["mode"]
    assert "LlamaForCausalLM (sdpa)" in rows["hf"]["mode"]
    assert rows["torchtitan"]["error"].startswith("skipped: torchtitan")
    assert rows["stalwart"]["vs_fastest_peer"] == pytest.approx(
        rows["stalwart"]["tokens_per_s"] / rows["hf"]["tokens_per_s"]
    )
    assert "6 x matmul parameters" in report["flop_formula"]
    assert report["flops_per_iteration"] > 0 and report["tokens_per_iteration"] == 4 * 32
    table = (tmp_path / "peers.md").read_text()
    for header in ("ms / iteration", "tokens/s", "TFLOP/s", "MFU", "peak GiB", "first iteration"):
        assert header in table
    assert "| stalwart | " in table and "| hf | " in table and "| torchtitan | skipped" in table
    with tarfile.open(tmp_path / "traces.tar.gz") as tar:
        names = tar.getnames()
    assert {"stalwart-trace.json", "hf-trace.json", "stalwart-log.txt"} <= set(names)


def test_profile_summary_of_a_device_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Chrome trace of two iterations: busy and idle time, time by kernel kind, the gaps."""
    sys.path.insert(0, str(REPO / "bench"))
    import peer_report  # type: ignore[import-not-found]

    def kernel(name: str, ts: float, dur: float) -> dict[str, object]:
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}

    events = [
        kernel("sm90_xmma_gemm_bf16bf16", 0.0, 600.0),
        kernel("triton_per_fused_rms_norm_0", 600.0, 100.0),
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 700.0, "dur": 100.0},
        kernel("flash_fwd_kernel", 1000.0, 800.0),  # a 200 us gap before it
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 850.0, "dur": 100.0},
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    summary = peer_report.profile_summary(str(path), iterations=2)
    assert summary is not None
    assert summary["span_ms"] == pytest.approx(0.9) and summary["busy_ms"] == pytest.approx(0.8)
    assert summary["kinds_ms"] == pytest.approx(
        {"gemm": 0.3, "attention": 0.4, "triton": 0.05, "copy": 0.05}
    )
    (gap,) = summary["top_gaps"]
    assert gap["us"] == 200.0 and gap["host"] == ["cudaGraphLaunch"]
    peer_report.print_profiles({"rows": [{"peer": "x", "profile": summary}]})
    out = capsys.readouterr().out
    assert "span 0.9, busy 0.8, idle 0.1 (11.1%" in out and "attention 0.4 (44%)" in out
