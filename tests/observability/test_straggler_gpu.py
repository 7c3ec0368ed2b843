"""The straggler detector's GPU fields (fake NVML on CPU) and its runtime toggle."""

from __future__ import annotations

import doctest
import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from stalwart.cli.main import main
from stalwart.observability import straggler_gpu
from stalwart.observability.straggler import STRAGGLER_FILE, StragglerDetector
from stalwart.observability.straggler_gpu import (
    GpuSample,
    NullGpuStats,
    NvmlGpuStats,
    make_gpu_stats,
)
from stalwart.observability.straggler_toggle import TOGGLE_FILE
from stalwart.observability.train_log import IntervalInfo

from dist_utils import run_distributed
from train_utils import TINY_FLAGS

CPU = torch.device("cpu")


class FakeNvml:
    """pynvml's surface that the reader uses, with one GPU's readings."""

    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1

    def __init__(self, temp: int, milliwatts: int, util: int, clock: int) -> None:
        self.values = (temp, milliwatts, util, clock)
        self.asked: list[tuple[str, Any]] = []
        self.shutdown = 0

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        self.asked.append(("temperature", sensor))
        return self.values[0]

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        return self.values[1]

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        return type("Util", (), {"gpu": self.values[2], "memory": 3})()

    def nvmlDeviceGetClockInfo(self, handle: Any, kind: int) -> int:
        self.asked.append(("clock", kind))
        return self.values[3]

    def nvmlShutdown(self) -> None:
        self.shutdown += 1


class FixedReader:
    def __init__(self, sample: GpuSample | None) -> None:
        self.sample, self.reads = sample, 0

    def read(self) -> GpuSample | None:
        self.reads += 1
        return self.sample

    def close(self) -> None:
        return None


def test_docstring_examples() -> None:
    assert doctest.testmod(straggler_gpu).failed == 0


def test_nvml_reader_asks_the_gpu_sensor_and_the_sm_clock_in_watts() -> None:
    nvml = FakeNvml(temp=67, milliwatts=612_345, util=98, clock=1980)
    reader = NvmlGpuStats(torch.device("cuda", 0), nvml=nvml, handle="h")
    assert reader.read() == GpuSample(67.0, 612.345, 98.0, 1980.0)
    assert ("temperature", nvml.NVML_TEMPERATURE_GPU) in nvml.asked
    assert ("clock", nvml.NVML_CLOCK_SM) in nvml.asked
    reader.close()
    assert nvml.shutdown == 1


def test_cpu_has_the_null_reader_and_no_gpu_fields() -> None:
    assert isinstance(make_gpu_stats(CPU), NullGpuStats)
    det = StragglerDetector(CPU)
    with det.compute():
        pass
    det.step()
    report = det.report(1)
    assert report is not None and report.gpu is None
    assert not [f for f in report.fields() if "/Rnk" in f.label]


def _fake_gather(monkeypatch: pytest.MonkeyPatch, others: list[list[float]]) -> None:
    """Rank 0's row, then the other ranks' rows, as the gather would return them."""
    from stalwart.distributed import collectives

    monkeypatch.setattr(collectives, "all_gather_floats", lambda row, group=None: [row, *others])


def test_min_max_with_their_ranks_in_megatron_form(monkeypatch, tmp_path: Path) -> None:
    nan = float("nan")
    _fake_gather(monkeypatch, [[9.0, -1.0, 74.0, 700.0, 97.0, 1755.0, 0.0],
                               [9.0, -1.0, nan, nan, nan, nan, 0.0]])  # fmt: skip
    det = StragglerDetector(
        CPU, world_size=3, run_dir=tmp_path, gpu_stats=FixedReader(GpuSample(61, 650, 99, 1980))
    )
    report = det.log_fields(IntervalInfo(10, 1, 1.0, 8, False))
    text = " | ".join(f"{f.label}: {f.fmt.format(f.value)}" for f in report)
    assert re.search(
        r"MnPwr/Rnk: 650\.00W/0 \| MxPwr/Rnk: 700\.00W/1 \| MnTmp/Rnk: 61\.00C/0 \| "
        r"MxTmp/Rnk: 74\.00C/1 \| MnUtl/Rnk: 97\.00%/1 \| MxUtl/Rnk: 99\.00%/0 \| "
        r"MnClk/Rnk: 1755\.00MHz/1 \| MxClk/Rnk: 1980\.00MHz/0",
        text,
    ), text
    scalars = det.scalars()
    assert scalars["straggler/temperature-c-max"] == 74.0
    assert scalars["straggler/clock-mhz-min"] == 1755.0
    assert scalars["straggler/power-w-min"] == 650.0
    (record,) = [json.loads(x) for x in (tmp_path / STRAGGLER_FILE).read_text().splitlines()]
    assert record["gpu"][0]["temperature_c"] == 61.0 and record["gpu"][2] is None


def test_off_at_start_times_nothing_and_the_toggle_file_turns_it_on(tmp_path: Path) -> None:
    reader = FixedReader(GpuSample(60, 500, 90, 1900))
    det = StragglerDetector(CPU, run_dir=tmp_path, enabled=False, gpu_stats=reader)
    with det.compute():
        time.sleep(0.01)
    det.step()
    assert det.report(1) is None and reader.reads == 0  # off: no timing, no NVML, no record
    (tmp_path / TOGGLE_FILE).touch()
    assert det.report(2) is None  # the request is applied after this (off) report
    assert det.enabled and not (tmp_path / TOGGLE_FILE).exists()  # consumed: one flip
    with det.compute():
        time.sleep(0.01)
    det.step()
    report = det.report(3)
    assert report is not None and report.compute_ms[0] >= 9.0 and report.num_iterations == 1
    (tmp_path / TOGGLE_FILE).touch()
    assert det.report(4) is not None and not det.enabled  # on for this one, then off
    lines = (tmp_path / STRAGGLER_FILE).read_text().splitlines()
    assert [json.loads(x)["iteration"] for x in lines] == [3, 4]


def _toggle_ranks(rank: int, world_size: int, run_dir: str) -> list[bool]:
    det = StragglerDetector(CPU, rank, world_size, run_dir=run_dir, gpu_stats=NullGpuStats())
    states = []
    for it in range(1, 4):
        with det.compute():
            time.sleep(0.002)
        det.step()
        if it == 2 and rank == 0:
            (Path(run_dir) / TOGGLE_FILE).touch()  # only rank 0 looks: rank 1 learns it
        det.report(it)
        states.append(det.enabled)
    return states


@pytest.mark.distributed
def test_every_rank_flips_at_the_same_report(tmp_path: Path) -> None:
    results = run_distributed(_toggle_ranks, world_size=2, args=(str(tmp_path),))
    assert results == [[True, False, False], [True, False, False]]


def test_disable_on_startup_in_the_trainer(tmp_path: Path, capsys) -> None:
    save = tmp_path / "run"
    save.mkdir()
    (save / TOGGLE_FILE).touch()  # turned on at the first report (iteration 1)
    args = ["train", *TINY_FLAGS, "--train-iters", "10", "--save", str(save), "--log-straggler"]
    assert main([*args, "--disable-straggler-on-startup", "--log-format", "megatron"]) == 0
    lines = (save / STRAGGLER_FILE).read_text().splitlines()
    assert [json.loads(x)["iteration"] for x in lines] == [5, 10]
    out = capsys.readouterr().out
    first = next(ln for ln in out.splitlines() if "iteration        1/" in ln)
    assert "compute ms min" not in first  # off for the first interval
    assert main(["train", *TINY_FLAGS, "--disable-straggler-on-startup"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("--disable-straggler-on-startup needs --log-straggler")
