"""Where a profiled window's device time went: kernel time by name, and the device's idle gaps
with the host ops running in them, read from a Chrome trace that ``torch.profiler`` wrote (the
trainer's ``--profile --use-pytorch-profiler`` window: ``<dir>/trace_rank0_iters*.json``).

The device's busy time is the union of its kernel, copy and set intervals; a gap is the time
between two of them. ``--iterations``: how many iterations the window held, for per-iteration
figures. torch.profiler's own tables sum kernel times but give no idle gaps; Perfetto's trace
processor could answer with SQL, a large dependency for these few lines.

    python3 bench/trace_gaps.py runs/prof/trace_rank0_iters61-63.json --iterations 3
"""

from __future__ import annotations

import argparse
import bisect
import collections
import itertools
import json
import sys
from pathlib import Path
from typing import Any

DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
HOST_CATEGORIES = {"cpu_op", "cuda_runtime", "cuda_driver", "python_function", "user_annotation"}


def _events(path: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    with open(path) as fh:
        trace = json.load(fh)
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    device = sorted((e for e in events if e.get("cat") in DEVICE_CATEGORIES), key=lambda e: e["ts"])
    host = sorted((e for e in events if e.get("cat") in HOST_CATEGORIES), key=lambda e: e["ts"])
    return device, host


def busy_intervals(device: list[dict[str, Any]]) -> list[tuple[float, float, str, str]]:
    """The union of the device intervals: ``(start, end, first name, last name)`` in µs."""
    merged: list[tuple[float, float, str, str]] = []
    for e in device:
        start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        if merged and start <= merged[-1][1]:
            s, old_end, first, last = merged[-1]
            merged[-1] = (s, max(old_end, end), first, e["name"] if end >= old_end else last)
        else:
            merged.append((start, end, e["name"], e["name"]))
    return merged


def summarize(path: str, iterations: int, top: int, min_gap_us: float) -> dict[str, Any]:
    device, host = _events(path)
    if not device:
        raise SystemExit(f"{path}: no kernel, copy or set events (a CPU-only trace?)")
    busy = busy_intervals(device)
    span = busy[-1][1] - busy[0][0]
    busy_us = sum(end - start for start, end, _, _ in busy)
    by_name: collections.Counter[str] = collections.Counter()
    for e in device:
        by_name[e["name"][:90]] += float(e["dur"])
    starts = [float(h["ts"]) for h in host]
    gaps = []
    for (_, end, _, before), (start, _, after, _) in itertools.pairwise(busy):
        if start - end < min_gap_us:
            continue
        # Host ops that overlap the gap (those that started up to 50 ms before it, then filtered).
        lo = bisect.bisect_left(starts, end - 50_000.0)
        hi = bisect.bisect_right(starts, start)
        names = collections.Counter(
            h["name"][:60] for h in host[lo:hi] if float(h["ts"]) + float(h["dur"]) > end
        )
        gaps.append({"us": start - end, "at_ms": (end - busy[0][0]) / 1e3, "before": before[:60],
                     "after": after[:60], "host": [n for n, _ in names.most_common(6)]})  # fmt: skip
    gaps.sort(key=lambda g: -g["us"])
    per = float(max(iterations, 1)) * 1e3
    return {
        "span_ms": span / per,
        "busy_ms": busy_us / per,
        "idle_ms": (span - busy_us) / per,
        "gaps_over_min_ms": sum(g["us"] for g in gaps) / per,
        "num_gaps_over_min": len(gaps) / max(iterations, 1),
        "top_kernels_ms": [(n, t / per) for n, t in by_name.most_common(top)],
        "top_gaps": gaps[:top],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--iterations", type=int, default=1, help="iterations in the window")
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--min-gap-us", type=float, default=20.0, help="gaps listed from this size")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    result = summarize(args.trace, args.iterations, args.top, args.min_gap_us)
    print(f"per iteration: span {result['span_ms']:.2f} ms, busy {result['busy_ms']:.2f}, idle "
          f"{result['idle_ms']:.2f} (gaps >= {args.min_gap_us:.0f} us: {result['gaps_over_min_ms']:.2f} "
          f"ms in {result['num_gaps_over_min']:.1f})")  # fmt: skip
    for name, ms in result["top_kernels_ms"]:
        print(f"  {ms:8.3f} ms  {name}")
    for g in result["top_gaps"]:
        print(f"- gap {g['us']:.0f} us at {g['at_ms']:.1f} ms after '{g['before']}' before "
              f"'{g['after']}'; host: {', '.join(g['host']) or 'none'}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
