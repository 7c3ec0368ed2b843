"""Tokens/s, TFLOP/s per GPU and MFU: the peak table, the log line's tail, metrics and sinks."""

from __future__ import annotations

import doctest
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from stalwart.cli.main import main
from stalwart.observability import throughput
from stalwart.observability.sinks import NullSink
from stalwart.observability.throughput import (
    compute_dtype,
    device_peak_tflops,
    interval_throughput,
    peak_tflops,
)
from stalwart.observability.timer_names import INTERVAL_TIME
from stalwart.observability.timers import Timers, TimingLogOption
from stalwart.observability.train_log import LogConfig, TrainingLog

from train_utils import TINY_FLAGS


def test_docstring_examples() -> None:
    assert doctest.testmod(throughput).failed == 0


@pytest.mark.parametrize(
    ("name", "dtype", "peak"),
    [
        ("NVIDIA H200", "bf16", 989.4),
        ("NVIDIA H100 80GB HBM3", "bf16", 989.4),  # SXM
        ("NVIDIA H100 PCIe", "bf16", 756.5),
        ("NVIDIA H100 NVL", "fp16", 835.5),
        ("NVIDIA H200 NVL", "bf16", 835.5),
        ("NVIDIA GH200 480GB", "bf16", 989.4),
        ("NVIDIA H200", "tf32", 494.7),
        ("NVIDIA H200", "fp32", 66.9),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
        ("NVIDIA A100-PCIE-40GB", "tf32", 156.0),
        ("NVIDIA A10G", "bf16", 70.0),
        ("NVIDIA A10", "bf16", 125.0),
        ("NVIDIA L40S", "bf16", 362.1),
        ("NVIDIA L40", "bf16", 181.0),
        ("NVIDIA L4", "bf16", 121.0),
        ("NVIDIA B200", "bf16", 2250.0),
        ("NVIDIA GB200", "bf16", 2500.0),
        ("AMD Instinct MI300X", "bf16", 1307.4),
        ("Tesla V100-SXM2-32GB", "fp16", 125.0),
        ("Tesla V100-SXM2-32GB", "bf16", None),  # no bf16 on Volta: no MFU, not a made-up peak
        ("NVIDIA GeForce GTX 1080", "fp32", None),  # unknown device
        ("cpu", "bf16", None),
    ],
)
def test_peak_table_lookup(name: str, dtype: str, peak: float | None) -> None:
    assert peak_tflops(name, dtype) == peak


def test_peak_lookup_refuses_an_unknown_dtype_and_cpu_has_no_peak() -> None:
    with pytest.raises(ValueError, match="dtype must be one of"):
        peak_tflops("NVIDIA H200", "bfloat16")
    assert device_peak_tflops(torch.device("cpu"), "bf16") is None
    assert device_peak_tflops(torch.device("cpu"), "bf16", override=123.0) == 123.0
    assert compute_dtype(True, False) == "bf16" and compute_dtype(False, True) == "fp16"
    assert compute_dtype(False, False) in ("fp32", "tf32")


def test_interval_rates_by_hand() -> None:
    r = interval_throughput(
        flops_per_iteration=8e12,
        tokens_per_iteration=4096,
        elapsed_ms=250.0,
        world_size=4,
        peak_tflops_per_gpu=400.0,
    )
    assert r.tokens_per_second == pytest.approx(4096 / 0.25)
    assert r.tokens_per_second_per_gpu == pytest.approx(4096 / 0.25 / 4)
    assert r.tflops_per_gpu == pytest.approx(8e12 / (0.25 * 1e12 * 4))  # 8 TFLOP/s per GPU
    assert r.mfu_percent == pytest.approx(100 * 8 / 400)
    none = interval_throughput(
        flops_per_iteration=None,
        tokens_per_iteration=None,
        elapsed_ms=250.0,
        world_size=1,
        peak_tflops_per_gpu=400.0,
    )
    assert (none.tokens_per_second, none.tflops_per_gpu, none.mfu_percent) == (None, None, None)


class RecSink(NullSink):
    def __init__(self) -> None:
        self.calls: list[tuple[str, float, int]] = []

    def add_scalars(self, values, step):  # type: ignore[no-untyped-def]
        self.calls.extend((k, float(v), step) for k, v in values.items())


TAIL = re.compile(
    r"number of nan iterations:   0 \| tokens per second: (\d+) \|"
    r" tokens per second per GPU: (\d+) \|(?: throughput per GPU \(TFLOP/s/GPU\): ([\d.]+) \|)?"
    r"(?: MFU: ([\d.]+)% \|)?$"
)


def _run_log(tmp_path: Path, peak: float | None, **cfg: Any) -> tuple[list[str], list[dict], Any]:
    lines: list[str] = []
    sink = RecSink()
    timers = Timers(0, TimingLogOption.MINMAX, device=torch.device("cpu"))
    log = TrainingLog(
        LogConfig(**{"log_interval": 2, "log_timestamp": False, "log_format": "megatron", **cfg}),
        train_iters=4,
        sink=sink,
        timers=timers,
        rank=0,
        world_size=2,
        flops_per_iteration=3e9,
        metrics_file=str(tmp_path / "metrics.jsonl"),
        print_fn=lines.append,
        seq_length=16,
        peak_tflops_per_gpu=peak,
    )
    timers(INTERVAL_TIME).start(barrier=True)
    for it in range(1, 5):
        log.on_iteration(
            it,
            losses={"lm loss": torch.tensor(2.0)},
            learning_rate=1e-3,
            global_batch_size=8,
            consumed_samples=8 * it,
            grad_norm=None,
            skipped=False,
        )
    log.close()
    path = tmp_path / "metrics.jsonl"
    records = [json.loads(x) for x in path.read_text().splitlines()]
    return lines, records, sink


def test_every_log_line_and_record_has_tokens_tflops_and_mfu(tmp_path: Path) -> None:
    lines, records, sink = _run_log(tmp_path, peak=0.5)
    assert [r["iteration"] for r in records] == [1, 2, 4]
    for line, rec in zip(lines, records, strict=True):
        m = TAIL.search(line)
        assert m is not None, line
        seconds = rec["elapsed_ms"] / 1000.0
        assert rec["tokens_per_second"] == pytest.approx(8 * 16 / seconds)
        assert rec["tokens_per_second_per_gpu"] == pytest.approx(8 * 16 / seconds / 2)
        assert rec["throughput_tflops_per_gpu"] == pytest.approx(3e9 / (seconds * 1e12 * 2))
        assert rec["mfu_percent"] == pytest.approx(100 * rec["throughput_tflops_per_gpu"] / 0.5)
        assert int(m.group(1)) == round(rec["tokens_per_second"])
        assert int(m.group(2)) == round(rec["tokens_per_second_per_gpu"])
        assert float(m.group(3)) == pytest.approx(rec["throughput_tflops_per_gpu"], abs=0.06)
        assert float(m.group(4)) == pytest.approx(rec["mfu_percent"], abs=0.06)
        # One spelling: Megatron's field, in the tail without --log-throughput (here).
        assert line.count("throughput per GPU (TFLOP/s/GPU)") == 1
        assert "TFLOP/s/GPU" not in line.split("number of nan iterations")[0]
    for key in ("tokens-per-second", "tokens-per-second-per-gpu", "throughput", "mfu-percent"):
        assert sorted(s for k, _, s in sink.calls if k == key) == [1, 2, 4], key


def test_without_a_peak_mfu_is_left_out_and_the_flag_wins(tmp_path: Path) -> None:
    lines, records, sink = _run_log(tmp_path / "a", peak=None)
    assert all("MFU" not in line and "tokens per second: " in line for line in lines)
    assert all(r["mfu_percent"] is None and r["tokens_per_second"] > 0 for r in records)
    assert not [k for k, _, _ in sink.calls if k == "mfu-percent"]
    # --peak-tflops over the table's value; with --log-throughput TFLOP/s is Megatron's field.
    lines, records, _ = _run_log(tmp_path / "b", peak=1e6, peak_tflops=0.5, log_throughput=True)
    assert all(
        r["mfu_percent"] == pytest.approx(200 * r["throughput_tflops_per_gpu"]) for r in records
    )
    assert all(" throughput per GPU (TFLOP/s/GPU): " in line for line in lines)
    assert all("TFLOP/s" not in line.split("nan iterations")[1] for line in lines)
    with pytest.raises(ValueError, match="--peak-tflops"):
        LogConfig(peak_tflops=0.0)


def test_the_trainer_logs_tokens_and_mfu_from_peak_tflops(tmp_path: Path, capsys) -> None:
    metrics = tmp_path / "metrics.jsonl"
    args = ["train", *TINY_FLAGS, "--train-iters", "5", "--metrics-file", str(metrics)]
    assert main([*args, "--peak-tflops", "2"]) == 0
    out = capsys.readouterr().out
    (line,) = [ln for ln in out.splitlines() if "iteration 5/5 |" in ln]  # the compact line
    assert re.search(r" \| [\d.]+k? tok/s \| MFU [\d.]+%", line), line
    last = json.loads(metrics.read_text().splitlines()[-1])
    assert last["tokens_per_second"] == pytest.approx(
        last["global_batch_size"] * 32 * 1000 / last["elapsed_ms"]
    )
    assert last["mfu_percent"] == pytest.approx(50 * last["throughput_tflops_per_gpu"])
    metrics.unlink()
    assert main(args) == 0  # CPU: no peak, so no MFU
    assert json.loads(metrics.read_text().splitlines()[-1])["mfu_percent"] is None
    assert "MFU" not in capsys.readouterr().out
