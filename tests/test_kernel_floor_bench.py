"""bench/kernel_floor.py runs on CPU in its smoke mode, and its kernel sum adds what it should."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import kernel_floor  # type: ignore[import-not-found]

import kernel_sum  # type: ignore[import-not-found]


def _kernel(name: str, start: float, end: float, annotation: bool = False) -> SimpleNamespace:
    return SimpleNamespace(
        name=name,
        device_type=DeviceType.CUDA,
        time_range=SimpleNamespace(start=start, end=end),
        is_user_annotation=annotation,
    )


def test_kernel_summary_sums_kernels_and_merges_overlaps() -> None:
    events = [
        _kernel("sm90_xmma_gemm_bf16bf16", 0.0, 600.0),
        _kernel("triton_per_fused_native_layer_norm_0", 500.0, 800.0),  # overlaps (2 streams)
        _kernel("void at::native::vectorized_elementwise_kernel", 1000.0, 1100.0),
        SimpleNamespace(name="cudaGraphLaunch", device_type=DeviceType.CPU),  # host: not counted
        _kernel("## Call CompiledFxGraph ##", 0.0, 1100.0, annotation=True),  # a range, no kernel
    ]
    summary = kernel_sum.kernel_summary(events, iters=2, device_type="cuda")
    assert summary["kernel_ms"] == pytest.approx(1.0 / 2)  # 1000 us of kernels over 2 iterations
    assert summary["busy_ms"] == pytest.approx(0.9 / 2)  # the union: 0-800 and 1000-1100
    assert summary["num_kernels"] == 1.5
    assert summary["by_category"] == pytest.approx({"gemm": 0.3, "triton": 0.15, "other": 0.05})


def test_kernel_floor_smoke_runs_on_cpu(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "kernel_floor.json"
    assert kernel_floor.main(["--smoke", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| weights_residual |" in text and "kernel floor, tiny" in text
    rows = {r["variant"]: r for r in json.loads(out.read_text())["results"][0]["rows"]}
    assert set(rows) == {"plain_eager", "today", "weights_residual"}
    for row in rows.values():
        assert row["median_ms"] > 0 and row["min_ms"] <= row["median_ms"] <= row["max_ms"]
        assert row["floor"]["kernel_ms"] > 0 and row["floor"]["wall_ms"] == row["median_ms"]
    assert rows["today"]["vs_baseline"] > 0 and rows["weights_residual"]["vs_today"] > 0
