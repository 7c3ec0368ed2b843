"""On the device: the straggler detector's NVML fields are real readings in sane ranges.

Needs ``pynvml`` (``nvidia-ml-py``); without it the module is skipped, unless
``STALWART_REQUIRE_NVML=1`` (scripts/gpu_check.sh's ``nvml_straggler`` step), which makes a
missing pynvml a failure instead of a silent skip.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from gpu_only import GPU_ONLY
from stalwart.observability.straggler import StragglerDetector
from stalwart.observability.straggler_gpu import NvmlGpuStats, make_gpu_stats

pytestmark = GPU_ONLY

if not os.environ.get("STALWART_REQUIRE_NVML"):
    pytest.importorskip("pynvml", reason="nvidia-ml-py not installed (the nvml extra)")


def _busy(device: torch.device, seconds: float) -> None:
    """Keep the GPU busy with matmuls for about ``seconds`` (NVML's utilisation window)."""
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(20):
            a = (a @ a).tanh_()
        torch.cuda.synchronize(device)


def test_nvml_fields_are_real_readings_in_sane_ranges() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    reader = make_gpu_stats(device, log=pytest.fail)  # pytest.fail: NVML must open here
    assert isinstance(reader, NvmlGpuStats)
    idle = reader.read()
    _busy(device, 2.0)
    busy = reader.read()
    print(f"\nNVML idle: {idle}\nNVML busy: {busy}")
    assert idle is not None and busy is not None
    for sample in (idle, busy):
        assert 10.0 <= sample.temperature_c <= 100.0
        assert 20.0 <= sample.power_w <= 1500.0  # H200 SXM: up to 700 W
        assert 0.0 <= sample.utilization_pct <= 100.0
        assert 100.0 <= sample.clock_mhz <= 3500.0
    assert busy.utilization_pct >= 50.0  # the matmuls ran through NVML's sample window
    assert busy.power_w > 100.0 and busy.clock_mhz >= 500.0
    reader.close()


def test_detector_reports_megatron_gpu_fields_on_the_device() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    det = StragglerDetector(device)
    weight = torch.randn(4096, 4096, device=device)
    for _ in range(5):
        with det.compute():
            x = weight
            for _ in range(10):
                x = (x @ weight).tanh_()
        det.step()
    report = det.report(5)
    assert report is not None and report.gpu is not None and report.gpu[0] is not None
    fields = {f.label: f.fmt.format(f.value) for f in report.fields()}
    print(f"\nstraggler GPU fields: {fields}")
    for label in ("MnPwr/Rnk", "MxPwr/Rnk", "MnTmp/Rnk", "MxTmp/Rnk", "MnUtl/Rnk", "MxUtl/Rnk",
                  "MnClk/Rnk", "MxClk/Rnk"):  # fmt: skip
        assert label in fields and fields[label].endswith("/0"), (label, fields)
    scalars = report.scalars()
    assert 10.0 <= scalars["straggler/temperature-c-max"] <= 100.0
    assert 100.0 <= scalars["straggler/clock-mhz-min"] <= 3500.0
    det.close()
