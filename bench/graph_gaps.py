"""Where a replayed graph's time goes between its nodes: device idle gaps, attributed.

``gap_analysis`` profiles a few iterations of a step function (CUDA activity only), reads the
Chrome trace, and for every stream sorts the device events (kernels, memcpy, memset) by start
time. The gap before an event is its start minus the previous event's end on that stream. Gaps
below ``host_gap_us`` are charged to graph execution, attributed to the kind of the *next* node and
to its kernel family; larger ones are host-side waits (between graph launches, after a sync).

Used by ``bench/graphs.py --gap-analysis VARIANTS``. The profiler itself adds some per-node cost,
so absolute gaps read higher than unprofiled; the attribution (which node kinds cost most) is
what this is for.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

DEVICE_CATEGORIES = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}


def _family(name: str) -> str:
    """A short kernel family: template arguments and launch suffixes dropped."""
    name = re.sub(r"<.*", "", name)
    name = re.sub(r"\(.*", "", name)
    name = name.split("::")[-1]
    return name[:60] or "?"


def _device_events(trace_path: str) -> list[dict[str, Any]]:
    with open(trace_path) as fh:
        trace = json.load(fh)
    events = []
    for event in trace.get("traceEvents", []):
        kind = DEVICE_CATEGORIES.get(str(event.get("cat", "")).lower())
        if kind is None or "dur" not in event:
            continue
        events.append(
            {
                "stream": event.get("tid"),
                "ts": float(event["ts"]),
                "dur": float(event["dur"]),
                "kind": kind,
                "name": str(event.get("name", "")),
            }
        )
    return events


def summarize_gaps(
    events: list[dict[str, Any]], iters: int, host_gap_us: float = 20.0
) -> dict[str, Any]:
    """Per-iteration totals: busy time, small (graph) gaps by next-node kind and family, host gaps."""
    by_stream: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for event in events:
        by_stream[event["stream"]].append(event)
    by_kind: dict[str, list[float]] = defaultdict(list)
    by_family: dict[str, list[float]] = defaultdict(list)
    host_gaps: list[float] = []
    busy = 0.0
    for stream_events in by_stream.values():
        stream_events.sort(key=lambda e: e["ts"])
        previous_end = None
        for event in stream_events:
            busy += event["dur"]
            if previous_end is not None:
                gap = max(0.0, event["ts"] - previous_end)
                if gap >= host_gap_us:
                    host_gaps.append(gap)
                else:
                    by_kind[event["kind"]].append(gap)
                    by_family[f"{event['kind']}:{_family(event['name'])}"].append(gap)
            previous_end = max(previous_end or 0.0, event["ts"] + event["dur"])

    def table(groups: dict[str, list[float]], top: int) -> list[dict[str, Any]]:
        rows = [
            {
                "name": name,
                "nodes_per_iter": len(gaps) / iters,
                "gap_us_per_iter": sum(gaps) / iters,
                "mean_gap_us": sum(gaps) / len(gaps),
            }
            for name, gaps in groups.items()
        ]
        rows.sort(key=lambda r: -float(r["gap_us_per_iter"]))
        return rows[:top]

    return {
        "iters": iters,
        "streams": len(by_stream),
        "events_per_iter": len(events) / iters,
        "busy_us_per_iter": busy / iters,
        "graph_gap_us_per_iter": sum(sum(g) for g in by_kind.values()) / iters,
        "host_gap_us_per_iter": sum(host_gaps) / iters,
        "host_gaps_per_iter": len(host_gaps) / iters,
        "by_kind": table(by_kind, 10),
        "by_family": table(by_family, 15),
    }


def dump_sequence(events: list[dict[str, Any]], path: str) -> None:
    """Every device event in start order: gap before it (us), duration (us), kind, name."""
    ordered = sorted(events, key=lambda e: (e["stream"], e["ts"]))
    with open(path, "w") as fh:
        previous: dict[str, Any] | None = None
        for event in ordered:
            gap = 0.0
            if previous is not None and previous["stream"] == event["stream"]:
                gap = event["ts"] - (previous["ts"] + previous["dur"])
            fh.write(
                f"{event['stream']}\t{gap:9.2f}\t{event['dur']:9.2f}\t{event['kind']}\t"
                f"{event['name'][:140]}\n"
            )
            previous = event


def gap_analysis(
    step: Callable[[list[dict]], None],
    data: list[list[dict]],
    iters: int,
    dump_path: str | None = None,
) -> dict[str, Any]:
    """Profile ``iters`` iterations of ``step`` and summarize the device gaps (optionally
    writing the whole event sequence to ``dump_path``)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(iters):
            step(data[i % len(data)])
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        events = _device_events(path)
        if dump_path:
            dump_sequence(events, dump_path)
        return summarize_gaps(events, iters)
    finally:
        os.unlink(path)


def format_gaps(preset: str, variant: str, result: dict[str, Any]) -> str:
    lines = [
        f"gaps {preset} {variant}: {result['events_per_iter']:.0f} device events/iter on "
        f"{result['streams']} streams, busy {result['busy_us_per_iter']:.1f} us, graph gaps "
        f"{result['graph_gap_us_per_iter']:.1f} us, host gaps {result['host_gap_us_per_iter']:.1f}"
        f" us ({result['host_gaps_per_iter']:.1f}/iter)"
    ]
    for key in ("by_kind", "by_family"):
        for row in result[key]:
            lines.append(
                f"  {key[3:]:6s} {row['name']:70s} {row['nodes_per_iter']:7.1f} nodes "
                f"{row['gap_us_per_iter']:8.1f} us/iter  mean {row['mean_gap_us']:.2f} us"
            )
    return "\n".join(lines)
