from __future__ import annotations

import time

import pytest
import torch

from stalwart.observability.energy import EnergyConfig, EnergyMeter, NullEnergyMeter
from stalwart.observability.train_log import IntervalInfo


def _info(it: int, n: int = 1) -> IntervalInfo:
    return IntervalInfo(
        iteration=it,
        num_iterations=n,
        elapsed_ms_per_iteration=1.0,
        consumed_samples=0,
        is_first=False,
    )


def test_cpu_not_available_logged_once() -> None:
    messages: list[str] = []
    meter = EnergyConfig(log_energy=True).build(torch.device("cpu"), log=messages.append)
    assert isinstance(meter, EnergyMeter) and not meter.available
    meter.start()
    for it in range(1, 4):
        assert meter.log_fields(_info(it)) == []
        assert meter.lap(1) is None
    assert meter.scalars() == {}
    assert len(messages) == 1
    assert messages[0].startswith("energy: not available (") and "cpu" in messages[0]
    meter.close()


def test_null_meter() -> None:
    meter = EnergyConfig().build(torch.device("cpu"))
    assert isinstance(meter, NullEnergyMeter)
    meter.start()
    assert meter.lap(5) is None and meter.log_fields(_info(1)) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_energy_counter() -> None:
    messages: list[str] = []
    meter = EnergyMeter(torch.device("cuda", 0), log=messages.append)
    assert meter.available, messages
    meter.start()
    x = torch.randn(4096, 4096, device="cuda")
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 1.0:
        x = (x @ x).tanh_()
    torch.cuda.synchronize()
    fields = {f.label: f.value for f in meter.log_fields(_info(10, n=10))}
    scalars = meter.scalars()
    print(f"\nenergy fields: {fields}")
    assert 10.0 < scalars["power/gpu"] < 2000.0
    assert scalars["iter-energy/gpu"] > 0.0
    meter.close()
