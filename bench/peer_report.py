"""The table and the profile summaries of ``bench/peers.py``: one FLOP formula, one timing rule.

Per peer: ms per iteration (median window, min-max), tokens/s, TFLOP/s and MFU from
``stalwart.models.num_floating_point_operations`` over the card's dense bf16 peak, peak memory,
the time to the first iteration and to the steady state; then stalwart's tokens/s over the
fastest other peer's. Each profiled window (a Chrome trace) is summarised by
``bench/trace_gaps.py`` (device span, busy, idle and its largest gaps per iteration) and by kernel
kind (``bench/kernel_sum.py``'s categories: gemm, attention, Triton, copy, other).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from peer_common import Spec, model_config
from stalwart.models import num_floating_point_operations
from stalwart.observability.throughput import peak_tflops
from trace_gaps import summarize as trace_summary

from kernel_sum import category

FORMULA = (
    "FLOPs per token = 6 x matmul parameters (all but the norms; the tied output layer once) "
    "+ 12 x layers x sequence x hidden (attention, full square): stalwart.models."
    "num_floating_point_operations"
)


def _kinds(path: str, iterations: int) -> dict[str, float]:
    """ms per iteration of the device work by kind (kernel names, kernel_sum's categories)."""
    with open(path) as fh:
        events = json.load(fh).get("traceEvents", [])
    kinds: dict[str, float] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            kind = "copy" if e["cat"] != "kernel" else category(str(e.get("name", "")))
            kinds[kind] = kinds.get(kind, 0.0) + float(e.get("dur", 0.0)) / 1e3 / iterations
    return dict(sorted(kinds.items(), key=lambda kv: -kv[1]))


def profile_summary(path: str | None, iterations: int) -> dict[str, Any] | None:
    if not path or not Path(path).exists() or iterations <= 0:
        return None
    try:
        summary = trace_summary(path, iterations, top=6, min_gap_us=20.0)
    except SystemExit as exc:  # a CPU trace has no device events
        return {"error": str(exc)}
    summary["kinds_ms"] = _kinds(path, iterations)
    return summary


def _row(spec: Spec, result: dict[str, Any], flops: float, tokens: int) -> dict[str, Any]:
    row = {k: result.get(k) for k in ("peer", "mode", "error", "note", "device", "torch")}
    for key in ("first_iteration_s", "steady_s", "peak_allocated_gib", "peak_reserved_gib"):
        row[key] = result.get(key)
    for key in ("import_error", "stand_ins", "vs_1B_flavor", "last_logged_loss", "wall_s"):
        if result.get(key) is not None:
            row[key] = result[key]
    windows = result.get("windows_ms") or []
    if windows:
        median = statistics.median(windows)
        peak = peak_tflops(result.get("device") or "", "bf16")
        row |= {
            "windows_ms": windows,
            "ms_median": median,
            "ms_min": min(windows),
            "ms_max": max(windows),
            "tokens_per_s": tokens / (median / 1e3),
            "tokens_per_s_min": tokens / (max(windows) / 1e3),
            "tokens_per_s_max": tokens / (min(windows) / 1e3),
            "tflops": flops / (median / 1e3) / 1e12,
            "mfu": flops / (median / 1e3) / 1e12 / peak if peak else None,
        }
    row["profile"] = profile_summary(result.get("trace"), spec.profile_iters)
    return row


def summarize(spec: Spec, results: list[dict[str, Any]]) -> dict[str, Any]:
    cfg = model_config(spec)
    flops = num_floating_point_operations(cfg, spec.global_batch_size)
    tokens = spec.global_batch_size * cfg.seq_length
    rows = [_row(spec, r, flops, tokens) for r in results]
    timed = [r for r in rows if "tokens_per_s" in r]
    peers = [r for r in timed if not str(r["peer"]).startswith("stalwart")]
    fastest = max(peers, key=lambda r: r["tokens_per_s"]) if peers else None
    for r in timed:
        if fastest is not None and str(r["peer"]).startswith("stalwart"):
            r["vs_fastest_peer"] = r["tokens_per_s"] / fastest["tokens_per_s"]
            r["memory_vs_fastest_peer"] = (
                r["peak_allocated_gib"] / fastest["peak_allocated_gib"]
                if r.get("peak_allocated_gib") and fastest.get("peak_allocated_gib")
                else None
            )
    return {
        "model_flags": spec.model_flags,
        "micro_batch_size": spec.micro_batch_size,
        "global_batch_size": spec.global_batch_size,
        "seq_length": cfg.seq_length,
        "tokens_per_iteration": tokens,
        "flops_per_iteration": flops,
        "flop_formula": FORMULA,
        "timing": f"median of {spec.iters // spec.window} windows of {spec.window} iterations "
        f"after {spec.warmup} warm-up iterations, each from a device sync to a device sync",
        "fastest_peer": fastest["peer"] if fastest else None,
        "rows": rows,
    }


def _num(value: Any, fmt: str) -> str:
    return "" if value is None else format(value, fmt)


def markdown_table(report: dict[str, Any]) -> str:
    head = (
        f"{' '.join(report['model_flags'])}: micro-batch {report['micro_batch_size']}, "
        f"global batch {report['global_batch_size']} x {report['seq_length']} tokens "
        f"({report['tokens_per_iteration']} per iteration); {report['timing']}.\n"
        f"MFU: {report['flop_formula']}, over the card's dense bf16 peak.\n\n"
    )
    lines = [
        "| trainer | ms / iteration (min-max) | tokens/s (min-max) | TFLOP/s | MFU | "
        "peak GiB alloc. (reserved) | first iteration s | steady from s | vs fastest peer |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        if "tokens_per_s" not in r:
            lines.append(f"| {r['peer']} | {r.get('error') or 'no timings'} | | | | | | | |")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else ""
        vs = f"{r['vs_fastest_peer']:.3f}x" if "vs_fastest_peer" in r else ""
        lines.append(
            f"| {r['peer']} | {r['ms_median']:.1f} ({r['ms_min']:.1f}-{r['ms_max']:.1f}) "
            f"| {r['tokens_per_s']:,.0f} ({r['tokens_per_s_min']:,.0f}-{r['tokens_per_s_max']:,.0f}) "
            f"| {r['tflops']:.1f} | {mfu} | {_num(r.get('peak_allocated_gib'), '.1f')} "
            f"({_num(r.get('peak_reserved_gib'), '.1f')}) | {_num(r.get('first_iteration_s'), '.1f')} "
            f"| {_num(r.get('steady_s'), '.1f')} | {vs} |"
        )
    notes = []
    for r in report["rows"]:
        for key in ("mode", "import_error", "stand_ins", "vs_1B_flavor", "note", "error"):
            if r.get(key) and not (key == "error" and "tokens_per_s" not in r):
                notes.append(f"- {r['peer']} {key}: {r[key]}")
    return head + "\n".join(lines) + ("\n\n" + "\n".join(notes) if notes else "") + "\n"


def print_profiles(report: dict[str, Any]) -> None:
    """Compact: per peer the step's device span, busy and idle time, the time by kernel kind
    (ms and % of the span), the top kernels and the largest idle gaps with the host's work."""
    for r in report["rows"]:
        p = r.get("profile")
        if not p:
            continue
        if "error" in p:
            print(f"\nprofile {r['peer']}: {p['error']}")
            continue
        span = p["span_ms"] or 1.0
        kinds = ", ".join(f"{k} {v:.1f} ({100 * v / span:.0f}%)" for k, v in p["kinds_ms"].items())
        print(
            f"\nprofile {r['peer']}, ms per iteration: span {p['span_ms']:.1f}, busy "
            f"{p['busy_ms']:.1f}, idle {p['idle_ms']:.1f} ({100 * p['idle_ms'] / span:.1f}%; "
            f"gaps >= 20 us: {p['gaps_over_min_ms']:.2f} ms in {p['num_gaps_over_min']:.0f}); "
            f"by kind: {kinds}"
        )
        for name, ms in p["top_kernels_ms"]:
            print(f"  {ms:8.2f} ms {100 * ms / span:4.1f}%  {name[:80]}")
        for g in p["top_gaps"][:3]:
            host = ", ".join(g["host"][:3]) or "none"
            print(f"  gap {g['us']:.0f} us after {g['before'][:40]!r}; host: {host[:100]}")
