"""Tokens/s, TFLOP/s per GPU and MFU of a log interval, and the peak of the device in use.

MFU (model FLOPs utilisation, as PaLM and torchtitan define it) is the model's FLOPs per second
per GPU over the device's dense peak for the compute dtype. The peak comes from
:data:`PEAK_TFLOPS`, a table of known accelerators matched on the device name that torch
reports, or from ``--peak-tflops`` (a device the table lacks, a clock-limited part). On CPU or an
unknown device there is no peak and MFU is left out, never guessed::

    >>> peak_tflops("NVIDIA H200", "bf16")
    989.4
    >>> peak_tflops("NVIDIA A100-SXM4-80GB", "fp16")
    312.0
    >>> peak_tflops("cpu", "bf16") is None
    True
    >>> m = interval_throughput(flops_per_iteration=4e12, tokens_per_iteration=8192,
    ...                         elapsed_ms=100.0, world_size=8, peak_tflops_per_gpu=989.4)
    >>> round(m.tokens_per_second), round(m.tflops_per_gpu, 2), round(m.mfu_percent, 2)
    (81920, 5.0, 0.51)

Pure functions of host values: the elapsed time is the interval timer's, already read at the
log step, so nothing here touches the device.
"""

from __future__ import annotations

import math
import types
from collections.abc import Mapping
from dataclasses import dataclass

import torch

# Dense (no 2:4 sparsity) peak TFLOP/s per GPU by compute dtype, from the vendors' data sheets.
# "tf32": fp32 matmuls on tensor cores (torch.set_float32_matmul_precision("high")), "fp32":
# without them. The first pattern contained in the lower-cased device name wins, so a variant
# (PCIe, NVL) comes before its family's default (SXM), a longer name before its prefix (a100, a10).
_p = types.MappingProxyType  # read-only: the table is module-level

PEAK_TFLOPS: tuple[tuple[str, Mapping[str, float]], ...] = (
    ("gb200", _p({"bf16": 2500.0, "fp16": 2500.0, "fp8": 5000.0, "tf32": 1250.0, "fp32": 80.0})),
    ("b200", _p({"bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0, "tf32": 1100.0, "fp32": 75.0})),
    ("b100", _p({"bf16": 1750.0, "fp16": 1750.0, "fp8": 3500.0, "tf32": 875.0, "fp32": 60.0})),
    ("h200 nvl", _p({"bf16": 835.5, "fp16": 835.5, "fp8": 1670.5, "tf32": 417.5, "fp32": 60.0})),
    ("h100 nvl", _p({"bf16": 835.5, "fp16": 835.5, "fp8": 1670.5, "tf32": 417.5, "fp32": 60.0})),
    ("h100 pcie", _p({"bf16": 756.5, "fp16": 756.5, "fp8": 1513.0, "tf32": 378.0, "fp32": 51.2})),
    # H100 SXM ("NVIDIA H100 80GB HBM3"), H200 SXM, H800, GH200: the same SXM tensor cores.
    ("gh200", _p({"bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "tf32": 494.7, "fp32": 66.9})),
    ("h200", _p({"bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "tf32": 494.7, "fp32": 66.9})),
    ("h100", _p({"bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "tf32": 494.7, "fp32": 66.9})),
    ("h800", _p({"bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "tf32": 494.7, "fp32": 66.9})),
    ("a100", _p({"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5})),
    ("a800", _p({"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5})),
    ("l40s", _p({"bf16": 362.1, "fp16": 362.1, "fp8": 733.0, "tf32": 183.0, "fp32": 91.6})),
    ("a10g", _p({"bf16": 70.0, "fp16": 70.0, "tf32": 35.0, "fp32": 31.2})),
    ("a10", _p({"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2})),
    ("l40", _p({"bf16": 181.0, "fp16": 181.0, "fp8": 362.0, "tf32": 90.5, "fp32": 90.5})),
    ("l4", _p({"bf16": 121.0, "fp16": 121.0, "fp8": 242.5, "tf32": 60.0, "fp32": 30.3})),
    ("v100", _p({"fp16": 125.0, "fp32": 15.7})),
    ("mi300x", _p({"bf16": 1307.4, "fp16": 1307.4, "fp8": 2614.9, "tf32": 653.7, "fp32": 163.4})),
    ("mi250x", _p({"bf16": 383.0, "fp16": 383.0, "fp32": 95.7})),
)

DTYPES = ("bf16", "fp16", "fp8", "tf32", "fp32")


def peak_tflops(device_name: str, dtype: str) -> float | None:
    """The dense peak TFLOP/s of one ``device_name`` GPU at ``dtype`` (one of :data:`DTYPES`);
    None when the device or its dtype is not in :data:`PEAK_TFLOPS`."""
    if dtype not in DTYPES:
        raise ValueError(f"peak_tflops: dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    name = device_name.lower()
    for pattern, peaks in PEAK_TFLOPS:
        if pattern in name:
            return peaks.get(dtype)
    return None


def compute_dtype(bf16: bool, fp16: bool) -> str:
    """The matmul dtype of a run: bf16/fp16, else fp32 on tensor cores ("tf32") when torch's
    float32 matmul precision allows them, plain "fp32" otherwise."""
    if bf16:
        return "bf16"
    if fp16:
        return "fp16"
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def device_peak_tflops(
    device: torch.device, dtype: str, override: float | None = None
) -> float | None:
    """The peak for MFU: ``override`` (``--peak-tflops``) when given, else the table's entry for
    the CUDA device's name; None on CPU and on devices the table lacks."""
    if override is not None:
        return override
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return peak_tflops(torch.cuda.get_device_name(device), dtype)


def validate_peak_tflops(value: float | None) -> None:
    """``--peak-tflops`` must be a finite number > 0 (or unset)."""
    if value is not None and not (math.isfinite(value) and value > 0):
        raise ValueError(
            f"--peak-tflops must be a finite number > 0 (TFLOP/s per GPU), got {value}"
        )


@dataclass(frozen=True)
class IntervalThroughput:
    """One log interval's rates; None where an input is unknown (no FLOPs, no peak, no tokens)."""

    tokens_per_second: float | None
    tokens_per_second_per_gpu: float | None
    tflops_per_gpu: float | None
    mfu_percent: float | None


def interval_throughput(
    *,
    flops_per_iteration: float | None,
    tokens_per_iteration: int | None,
    elapsed_ms: float,
    world_size: int,
    peak_tflops_per_gpu: float | None,
) -> IntervalThroughput:
    """Rates of an interval whose iterations took ``elapsed_ms`` each (whole-job FLOPs and
    tokens per iteration). TFLOP/s per GPU is Megatron's ``throughput``: FLOPs / (time x 1e12 x
    world size); MFU is that over the peak, in percent."""
    if not (elapsed_ms > 0 and math.isfinite(elapsed_ms)):
        return IntervalThroughput(None, None, None, None)
    seconds, gpus = elapsed_ms / 1000.0, max(world_size, 1)
    tokens = tokens_per_iteration / seconds if tokens_per_iteration else None
    tflops = flops_per_iteration / (seconds * 1e12 * gpus) if flops_per_iteration else None
    mfu = 100.0 * tflops / peak_tflops_per_gpu if tflops and peak_tflops_per_gpu else None
    return IntervalThroughput(tokens, None if tokens is None else tokens / gpus, tflops, mfu)
