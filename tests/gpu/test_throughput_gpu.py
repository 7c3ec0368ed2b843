"""On the device: the peak table knows the GPU in use, so MFU is logged there."""

from __future__ import annotations

import torch

from gpu_only import GPU_ONLY
from stalwart.observability.throughput import device_peak_tflops, peak_tflops

pytestmark = GPU_ONLY


def test_the_device_in_use_has_a_peak() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    name = torch.cuda.get_device_name(device)
    peak = device_peak_tflops(device, "bf16")
    print(f"\n{name}: bf16 dense peak {peak} TFLOP/s")
    assert peak is not None and peak == peak_tflops(name, "bf16")
    if "H200" in name or "H100" in name:
        assert peak in (989.4, 835.5, 756.5)  # SXM, NVL, PCIe
    assert device_peak_tflops(device, "bf16", override=500.0) == 500.0
