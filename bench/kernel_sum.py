"""The kernel floor of an iteration (issue 19): the sum of its kernel times from torch.profiler.

``wall - kernel sum`` is what the host, launches and replay add above the kernels (the issue's
"3 ms of replay above the kernel sum" at gpt2-124m); the kernel sum itself splits into matmuls,
attention, Inductor's Triton kernels (pointwise and reductions) and the rest (aten pointwise,
foreach, optimizer, copies), the traffic a bf16 residual and fusions attack. ``busy`` is the
union of the kernel intervals (kernels on two streams overlap; ``wall - busy`` is the device
idle time). On CPU there are no kernels: the same figures come from the aten ops' self CPU time
(a smoke test of the code path, not a kernel floor).

Used by ``bench/kernel_floor.py`` (imported as a sibling, like ``bench_utils``).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.autograd import DeviceType

from bench_utils import sync

CATEGORIES = (
    (
        "gemm",
        re.compile(r"gemm|cutlass|nvjet|cublas|xmma|wgmma|matmul|splitk|aten::b?(add)?mm$", re.I),
    ),
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
    ("triton", re.compile(r"^triton_|^triton\b", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy_kernel|CatArrayBatched", re.I)),
)


def category(name: str) -> str:
    """Which part of the floor a kernel belongs to (first matching pattern; else ``other``)."""
    return next((label for label, pattern in CATEGORIES if pattern.search(name)), "other")


def profile_events(run: Callable[[int], None], iters: int, device: torch.device) -> list[Any]:
    """The profiler's events of ``run(iters)`` (device kernels on CUDA, ops on CPU)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    sync(device)
    with profile(activities=activities) as prof:
        run(iters)
        sync(device)
    return list(prof.events())


def _busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``[start, end)`` intervals."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def kernel_summary(events: Iterable[Any], iters: int, device_type: str) -> dict[str, Any]:
    """Per iteration: ``kernel_ms`` (sum), ``busy_ms`` (union), ``num_kernels``, ``by_category``
    (ms per :data:`CATEGORIES` label and ``other``) and ``source``."""
    want = DeviceType.CUDA if device_type == "cuda" else DeviceType.CPU
    total_us, intervals = 0.0, []
    by_category: dict[str, float] = {}
    count = 0
    for event in events:
        # GPU-side user annotations (record_function ranges, torch.compile's own) span kernels.
        if event.device_type != want or getattr(event, "is_user_annotation", False):
            continue
        if want == DeviceType.CUDA:
            start, stop = float(event.time_range.start), float(event.time_range.end)
            duration = stop - start
            intervals.append((start, stop))
        else:  # self time: nested aten ops are not counted twice
            duration = float(event.self_cpu_time_total)
        total_us += duration
        count += 1
        label = category(event.name)
        by_category[label] = by_category.get(label, 0.0) + duration
    if want == DeviceType.CPU:
        busy_us = total_us
    else:
        busy_us = _busy_us(intervals)
    per = 1e3 * max(iters, 1)
    return {
        "kernel_ms": total_us / per,
        "busy_ms": busy_us / per,
        "num_kernels": count / max(iters, 1),
        "by_category": {k: v / per for k, v in sorted(by_category.items())},
        "source": "cuda kernels" if want == DeviceType.CUDA else "cpu ops (self time)",
    }


def kernel_floor(
    run: Callable[[int], None], iters: int, device: torch.device, wall_ms: float | None
) -> dict[str, Any]:
    """:func:`kernel_summary` of ``run(iters)``, with ``wall_ms`` (the unprofiled median per
    iteration: the profiler slows the host) and ``above_kernels_ms = wall_ms - kernel_ms``."""
    start = time.perf_counter()
    summary = kernel_summary(profile_events(run, iters, device), iters, device.type)
    summary["profiled_wall_ms"] = (time.perf_counter() - start) * 1e3 / max(iters, 1)
    if wall_ms is not None:
        summary["wall_ms"] = wall_ms
        summary["above_kernels_ms"] = wall_ms - summary["kernel_ms"]
        summary["kernel_fraction"] = summary["kernel_ms"] / wall_ms if wall_ms > 0 else None
    return summary


def print_floor(result: dict[str, Any]) -> None:
    """The kernel floor table: wall vs the sum of kernel times per iteration."""
    rows = [r for r in result["rows"] if "floor" in r]
    if not rows:
        return
    source = next((r["floor"]["source"] for r in rows if "source" in r["floor"]), "kernels")
    labels = sorted({k for r in rows for k in r["floor"].get("by_category", {})})
    print(f"\nkernel floor, {result['preset']} (ms per iteration; {source})")
    print("| variant | wall | kernel sum | wall - kernels | busy | kernels/iter | "
          + " | ".join(labels) + " |")  # fmt: skip
    print("|---" * (6 + len(labels)) + "|")
    for r in rows:
        f = r["floor"]
        if "kernel_ms" not in f:
            print(f"| {r['variant']} | {f.get('error', 'not run')} |" + " |" * (4 + len(labels)))
            continue
        cats = " | ".join(f"{f['by_category'].get(k, 0.0):.2f}" for k in labels)
        wall = f.get("wall_ms")
        above = f.get("above_kernels_ms")
        print(
            f"| {r['variant']} | {'' if wall is None else f'{wall:.2f}'} | {f['kernel_ms']:.2f} "
            f"| {'' if above is None else f'{above:.2f}'} | {f['busy_ms']:.2f} "
            f"| {f['num_kernels']:.0f} | {cats} |"
        )
