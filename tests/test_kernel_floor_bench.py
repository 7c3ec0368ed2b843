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


def _kernel(
    name: str, start: float, end: float, annotation: bool = False, cid: int = 0
) -> SimpleNamespace:
    return SimpleNamespace(
        name=name,
        device_type=DeviceType.CUDA,
        time_range=SimpleNamespace(start=start, end=end),
        is_user_annotation=annotation,
        id=cid,
    )


def _host(name: str, start: float, end: float, cid: int = 0) -> SimpleNamespace:
    return SimpleNamespace(
        name=name, device_type=DeviceType.CPU, time_range=SimpleNamespace(start=start, end=end),
        id=cid, cpu_parent=None,
    )  # fmt: skip


def test_idle_gaps_split_small_and_large_and_name_the_host_work() -> None:
    """A replay's per-kernel boundaries are small gaps; the device waiting for a late
    ``cudaGraphLaunch`` after a host read is a large one, attributed to both."""
    events = [
        _kernel("sm90_gemm", 0.0, 100.0, cid=1),
        _kernel("triton_poi_fused_add_0", 100.5, 200.0, cid=2),  # 0.5 us: a graph node boundary
        _kernel("flash_bwd", 150.0, 260.0, cid=3),  # a second stream: no gap
        _kernel("## Call CompiledFxGraph ##", 0.0, 2000.0, annotation=True),  # not device work
        _kernel("triton_red_fused_sum_1", 1260.0, 1300.0, cid=4),  # 1000 us after flash_bwd
        _host("aten::_local_scalar_dense", 190.0, 310.0),
        _host("cudaStreamSynchronize", 200.0, 300.0, cid=9),
        _host("cudaGraphLaunch", 1250.0, 1259.0, cid=4),
        _host("aten::mm", 2000.0, 2100.0),  # after the gap: not named
    ]
    gaps = kernel_sum.idle_gaps(events, iters=2, device_type="cuda", gap_us=5.0)
    assert gaps["idle_ms"] == pytest.approx(1000.5 / 1e3 / 2)
    assert gaps["small_ms"] == pytest.approx(0.5 / 1e3 / 2) and gaps["num_small"] == 0.5
    assert gaps["large_ms"] == pytest.approx(1.0 / 2) and gaps["num_large"] == 0.5
    assert gaps["large_ms_by_launcher"] == pytest.approx({"cudaGraphLaunch": 0.5})
    (largest, small) = gaps["largest"]
    assert largest == {
        "us": 1000.0, "at_ms": 0.26, "before": "flash_bwd", "after": "triton_red_fused_sum_1",
        "launched_by": "cudaGraphLaunch",
        "host": ["aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaGraphLaunch"],
    }  # fmt: skip
    assert small["us"] == 0.5 and small["before"] == "sm90_gemm"
    # 1300 us from the first kernel to the last over 2 iterations; the large gap starts in the
    # first iteration's share (the window's drained start), so none is left after it.
    assert gaps["span_ms"] == pytest.approx(0.65) and gaps["steady_large_ms"] == 0.0


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
    assert [k["name"] for k in summary["top_kernels"]] == [
        "sm90_xmma_gemm_bf16bf16", "triton_per_fused_native_layer_norm_0",
        "void at::native::vectorized_elementwise_kernel",
    ]  # fmt: skip
    assert summary["top_kernels"][0] == {"name": "sm90_xmma_gemm_bf16bf16", "ms": 0.3, "count": 0.5}


def test_kernel_floor_smoke_runs_on_cpu(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "kernel_floor.json"
    assert kernel_floor.main(["--smoke", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| weights_residual |" in text and "kernel floor, tiny" in text
    rows = {r["variant"]: r for r in json.loads(out.read_text())["results"][0]["rows"]}
    assert set(rows) == {"plain_eager", "today", "weights_residual", "weights_residual_clip"}
    for row in rows.values():
        assert row["median_ms"] > 0 and row["min_ms"] <= row["median_ms"] <= row["max_ms"]
        assert row["floor"]["kernel_ms"] > 0 and row["floor"]["wall_ms"] == row["median_ms"]
    assert rows["today"]["vs_baseline"] > 0 and rows["weights_residual"]["vs_today"] > 0
    assert "device idle, tiny" in text
    assert rows["today"]["launched_per_iter"] == 1.0  # the guarded step launches ahead
    assert "launched_per_iter" not in rows["plain_eager"]
    assert (
        rows["today"]["floor"]["gaps"]["idle_ms"] >= 0 and rows["today"]["floor"]["gaps"]["largest"]
    )


def test_trainer_run_flags_parse_with_its_iterations_and_log_interval() -> None:
    """The trainer's TFLOP/s run replaces the bench's placeholder values (a filter on them once
    dropped --train-iters' value: "unrecognized arguments: 1234" on the H200)."""
    from stalwart.cli.args import parse_train_args

    args = kernel_floor._parser().parse_args(["--device", "cpu", "--trainer-iters", "150"])
    flags = kernel_floor.trainer_flags(args, "weights_residual")
    parsed = parse_train_args(flags)
    assert parsed.train_iters == 150 and parsed.log_interval == 25 and parsed.seed == 1234
    assert "--bf16-compute-weights" in flags and "--check-for-large-grads" in flags
    kernel_floor.config_of(flags)  # the whole run config builds
