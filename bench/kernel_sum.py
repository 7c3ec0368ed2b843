"""The kernel floor of an iteration (issue 19): the sum of its kernel times from torch.profiler.

``wall - kernel sum`` is what the host, launches and replay add above the kernels (the issue's
"3 ms of replay above the kernel sum" at gpt2-124m); the kernel sum itself splits into matmuls,
attention, Inductor's Triton kernels (pointwise and reductions) and the rest (aten pointwise,
foreach, optimizer, copies), the traffic a bf16 residual and fusions attack. ``busy`` is the
union of the kernel intervals (kernels on two streams overlap; ``wall - busy`` is the device
idle time). :func:`idle_gaps` attributes that idle time: every gap between busy stretches of the
device timeline, split at ``--gap-us`` (small gaps: the per-kernel boundary inside a graph
replay; large ones: the device waited for the host), with the largest gaps named by the kernels
before and after, the host call that launched the kernel after (``cudaGraphLaunch``: a replay
queued late) and the host ops running in the gap (a sync, a ``.item()``, an eager op). On CPU
there are no kernels: the same figures come from the aten ops' self CPU time (a smoke test of
the code path, not a kernel floor; the gaps are those between top-level ops).

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


TOP_KERNELS = 15


def category(name: str) -> str:
    """Which part of the floor a kernel belongs to (first matching pattern; else ``other``)."""
    return next((label for label, pattern in CATEGORIES if pattern.search(name)), "other")


def profile_events(
    run: Callable[[int], None], iters: int, device: torch.device, host_ops: bool = True
) -> list[Any]:
    """The profiler's events of ``run(iters)``: device kernels and the CUDA runtime calls on
    CUDA (with ``host_ops`` also the host's aten ops, which name a gap's host work; they cost
    the host about a microsecond each, so gaps grow a little under the profiler), ops on CPU."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] if not cuda or host_ops else []
    activities += [ProfilerActivity.CUDA] if cuda else []
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
    by_name: dict[str, list[float]] = {}
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
        named = by_name.setdefault(event.name, [0.0, 0.0])
        named[0] += duration
        named[1] += 1
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
        # The kernels that cost most (ms and launches per iteration): where fusion would pay.
        "top_kernels": [
            {"name": name[:100], "ms": us / per, "count": n / max(iters, 1)}
            for name, (us, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:TOP_KERNELS]
        ],
        # The "other" kernels (aten's own: reductions, pointwise, foreach, optimizer) with their
        # template arguments (which reduction, which dtypes): what an eager op or a fallback
        # left outside Inductor's kernels.
        "other_kernels": [
            {"name": name[:400], "ms": us / per, "count": n / max(iters, 1)}
            for name, (us, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])
            if category(name) == "other"
        ][:TOP_KERNELS],
        "source": "cuda kernels" if want == DeviceType.CUDA else "cpu ops (self time)",
    }


def _interval(event: Any) -> tuple[float, float]:
    return float(event.time_range.start), float(event.time_range.end)


def _device_timeline(events: list[Any], device_type: str) -> list[Any]:
    """The timed device work in start order: kernels (CUDA; not annotation ranges), else the
    top-level aten ops (CPU smoke)."""
    if device_type == "cuda":
        work = [
            e
            for e in events
            if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
        ]
    else:
        work = [
            e
            for e in events
            if e.device_type == DeviceType.CPU
            and e.name.startswith("aten::")
            and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
        ]
    return sorted(work, key=lambda e: float(e.time_range.start))


def _host_in(host: list[Any], start: float, stop: float) -> list[str]:
    """Names of host events overlapping ``[start, stop)``, outermost first (ties: longest)."""
    hits = [e for e in host if _interval(e)[0] < stop and _interval(e)[1] > start]
    hits.sort(key=lambda e: (_interval(e)[0], -(_interval(e)[1] - _interval(e)[0])))
    names: list[str] = []
    for e in hits:
        if e.name not in names:
            names.append(e.name)
    return names[:6]


def idle_gaps(
    events: Iterable[Any], iters: int, device_type: str, *, gap_us: float = 5.0, top: int = 5
) -> dict[str, Any]:
    """The device's idle time per iteration, from the profiler's timeline.

    Walks the device work in start order (two streams overlapping count once) and collects
    every gap between busy stretches. Per iteration: ``idle_ms`` (all gaps), ``small_ms`` /
    ``num_small`` (gaps under ``gap_us``: a replay's per-kernel boundaries), ``large_ms`` /
    ``num_large`` (the device waited for the host), ``large_ms_by_launcher`` (the large gaps
    by the host call that ended them); ``largest``: the ``top`` largest gaps,
    each with ``us``, ``before`` / ``after`` (the device work around it), ``launched_by`` (the
    host call whose correlation id is the next kernel's: ``cudaGraphLaunch`` means a replay
    was queued late, ``cudaLaunchKernel`` an eager op) and ``host`` (host events running in
    the gap, outermost first: a ``cudaStreamSynchronize`` or ``aten::_local_scalar_dense`` is
    a host read, an ``aten::`` op eager work; empty: Python between ops).
    """
    all_events = list(events)
    work = _device_timeline(all_events, device_type)
    work_ids = {id(e) for e in work}
    host = [e for e in all_events if e.device_type == DeviceType.CPU and id(e) not in work_ids]
    runtime = {e.id: e for e in host if e.name.startswith("cu")}
    gaps: list[tuple[float, Any, Any]] = []
    if work:
        last, end = work[0], _interval(work[0])[1]
        for event in work[1:]:
            start, stop = _interval(event)
            if start > end:
                gaps.append((start - end, last, event))
            if stop > end:
                last, end = event, stop
    small = [g for g, _, _ in gaps if g < gap_us]
    large = [g for g, _, _ in gaps if g >= gap_us]
    n = max(iters, 1)
    origin = _interval(work[0])[0] if work else 0.0
    span_us = max((_interval(e)[1] for e in work), default=origin) - origin
    # The first iteration starts on a drained device (the sync before the profile): its gaps
    # are the window's start, not the steady state. ``steady``: the large gaps after it.
    first_us = span_us / n
    steady = [
        g for g, before, _ in gaps if g >= gap_us and _interval(before)[1] - origin > first_us
    ]
    by_launcher: dict[str, float] = {}
    for us, _, after in gaps:
        if us >= gap_us:
            launcher = runtime.get(getattr(after, "id", None)) if device_type == "cuda" else None
            key = launcher.name if launcher is not None else "unknown"
            by_launcher[key] = by_launcher.get(key, 0.0) + us / 1e3 / n
    largest = []
    for us, before, after in sorted(gaps, key=lambda g: -g[0])[:top]:
        start = _interval(before)[1]
        launcher = runtime.get(getattr(after, "id", None)) if device_type == "cuda" else None
        largest.append({
            "us": round(us, 1),
            "at_ms": round((start - origin) / 1e3, 2),
            "before": before.name[:80],
            "after": after.name[:80],
            "launched_by": launcher.name if launcher is not None else None,
            "host": [name[:60] for name in _host_in(host, start, start + us)],
        })  # fmt: skip
    return {
        "gap_us": gap_us,
        "idle_ms": sum(g for g, _, _ in gaps) / 1e3 / n,
        "small_ms": sum(small) / 1e3 / n,
        "num_small": len(small) / n,
        "large_ms": sum(large) / 1e3 / n,
        "num_large": len(large) / n,
        "large_ms_by_launcher": dict(sorted(by_launcher.items(), key=lambda kv: -kv[1])),
        "span_ms": span_us / 1e3 / n,
        "steady_large_ms": sum(steady) / 1e3 / max(n - 1, 1) if n > 1 else None,
        "largest": largest,
    }


def kernel_floor(
    run: Callable[[int], None],
    iters: int,
    device: torch.device,
    wall_ms: float | None,
    gap_us: float = 5.0,
    top: int = 5,
) -> dict[str, Any]:
    """:func:`kernel_summary` of ``run(iters)``, with ``wall_ms`` (the unprofiled median per
    iteration: the profiler slows the host), ``above_kernels_ms = wall_ms - kernel_ms`` and
    ``gaps`` (:func:`idle_gaps`: where the device was idle)."""
    start = time.perf_counter()
    events = profile_events(run, iters, device)
    summary = kernel_summary(events, iters, device.type)
    summary["profiled_wall_ms"] = (time.perf_counter() - start) * 1e3 / max(iters, 1)
    summary["gaps"] = idle_gaps(events, iters, device.type, gap_us=gap_us, top=top)
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
    for r in rows:
        top = r["floor"].get("top_kernels", [])[:8]
        if top:
            listed = "; ".join(f"{k['name'][:60]} {k['ms']:.2f} ms x{k['count']:.0f}" for k in top)
            print(f"- {r['variant']} top kernels: {listed}")
    for r in rows:
        for k in r["floor"].get("other_kernels", [])[:5]:
            print(f"- {r['variant']} other: {k['ms']:.2f} ms x{k['count']:.0f} {k['name']}")


def print_gaps(result: dict[str, Any]) -> None:
    """Where the device was idle: the gaps table and each variant's largest gaps."""
    rows = [r for r in result["rows"] if "gaps" in r.get("floor", {})]
    if not rows:
        return
    gap_us = rows[0]["floor"]["gaps"]["gap_us"]
    print(f"\ndevice idle, {result['preset']} (ms per iteration; large: gaps >= {gap_us:g} us)")
    print(
        "| variant | launched ahead / iter | device span | idle | small gaps | n small "
        "| large gaps | n large | large after the first iteration |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        g = r["floor"]["gaps"]
        ahead = r.get("launched_per_iter")
        steady = g.get("steady_large_ms")
        print(
            f"| {r['variant']} | {'' if ahead is None else f'{ahead:.2f}'} "
            f"| {g.get('span_ms', 0.0):.2f} | {g['idle_ms']:.2f} "
            f"| {g['small_ms']:.2f} | {g['num_small']:.0f} | {g['large_ms']:.2f} "
            f"| {g['num_large']:.1f} | {'' if steady is None else f'{steady:.2f}'} |"
        )
    for r in rows:
        ended = r["floor"]["gaps"].get("large_ms_by_launcher", {})
        if ended:
            listed = ", ".join(f"{name} {ms:.2f} ms" for name, ms in ended.items())
            print(f"- {r['variant']}: large gaps ended by {listed}")
        for gap in r["floor"]["gaps"]["largest"]:
            host = ", ".join(gap["host"]) or "python (no op)"
            print(f"- {r['variant']}: {gap['us']:.0f} us at {gap.get('at_ms', 0.0):.1f} ms, "
                  f"after {gap['before']!r}, before "
                  f"{gap['after']!r} (launched by {gap['launched_by']}); host: {host}")  # fmt: skip
