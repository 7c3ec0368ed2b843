"""HTML + inline-SVG rendering of a run report (no network resources, no matplotlib needed).

``render_html(artefacts, png_names)`` returns the whole page; `stalwart.observability.report`
loads the artefacts and writes the file.
"""

from __future__ import annotations

import html
import math
import time
from collections.abc import Sequence
from typing import Any

from stalwart.observability.run_dir import (
    LOSS_KEYS,
    LR_KEYS,
    THROUGHPUT_KEYS,
    EventKind,
    RunArtefacts,
    series,
    timer_label,
    timer_names,
)

PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")
KIND_COLOURS = {
    EventKind.SKIPPED.value: "#ff7f0e",
    EventKind.NAN.value: "#d62728",
    EventKind.RERUN.value: "#9467bd",
    EventKind.RESTART.value: "#1f77b4",
    EventKind.EXIT.value: "#000000",
    EventKind.CHECKPOINT.value: "#2ca02c",
}
W, H, ML, MR, MT, MB = 760, 260, 70, 190, 20, 40
Points = list[tuple[float, float]]


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _fmt(v: float) -> str:
    if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
        return f"{v:.2e}"
    return f"{v:.4g}"


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """Round tick values (1, 2, 2.5, 5 × 10^k steps) inside [lo, hi]."""
    if not hi > lo:
        return [lo]
    raw = (hi - lo) / (n - 1)
    mag = 10.0 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1.0, 2.0, 2.5, 5.0, 10.0) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9)
    last = math.floor(hi / step + 1e-9)
    return [i * step for i in range(first, last + 1)]


def _bounds(values: Sequence[float]) -> tuple[float, float]:
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return 0.0, 1.0
    lo, hi = min(finite), max(finite)
    if hi == lo:
        pad = abs(hi) * 0.1 or 1.0
        return lo - pad, hi + pad
    return lo, hi


def _axes(
    x0: float, x1: float, y0: float, y1: float, xlabel: str, ylabel: str, xticks: bool = True
) -> list[str]:
    pw, ph = W - ML - MR, H - MT - MB
    parts = [f'<rect x="{ML}" y="{MT}" width="{pw}" height="{ph}" fill="#fff" stroke="#999"/>']
    for v in _ticks(y0, y1):
        y = MT + ph - (v - y0) / (y1 - y0) * ph
        parts.append(f'<line x1="{ML}" x2="{ML + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>')
        parts.append(f'<text x="{ML - 5}" y="{y + 4:.1f}" text-anchor="end">{_fmt(v)}</text>')
    for v in _ticks(x0, x1) if xticks else []:
        x = ML + (v - x0) / (x1 - x0) * pw
        parts.append(f'<text x="{x:.1f}" y="{MT + ph + 15}" text-anchor="middle">{_fmt(v)}</text>')
    parts.append(f'<text x="{ML + pw / 2}" y="{H - 5}" text-anchor="middle">{_e(xlabel)}</text>')
    parts.append(
        f'<text transform="translate(14,{MT + ph / 2}) rotate(-90)" text-anchor="middle">'
        f"{_e(ylabel)}</text>"
    )
    return parts


def _svg(parts: list[str], height: int = H) -> str:
    body = "".join(parts)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height}" '
        f'viewBox="0 0 {W} {height}" font-family="sans-serif" font-size="11">{body}</svg>'
    )


def _legend(names: Sequence[str], colours: Sequence[str]) -> list[str]:
    parts = []
    for i, (name, colour) in enumerate(zip(names, colours)):
        y = MT + 10 + 16 * i
        parts.append(
            f'<rect x="{W - MR + 10}" y="{y - 8}" width="10" height="10" fill="{colour}"/>'
        )
        parts.append(f'<text x="{W - MR + 25}" y="{y + 1}">{_e(name[:30])}</text>')
    return parts


def line_chart(data: dict[str, Points], xlabel: str, ylabel: str) -> str:
    """Inline SVG line chart of several ``(x, y)`` series (non-finite y values are gaps)."""
    data = {k: v for k, v in data.items() if v}
    xs = [p[0] for pts in data.values() for p in pts]
    x0, x1 = _bounds(xs)
    y0, y1 = _bounds([p[1] for pts in data.values() for p in pts])
    pw, ph = W - ML - MR, H - MT - MB
    parts = _axes(x0, x1, y0, y1, xlabel, ylabel)
    for (_name, pts), colour in zip(data.items(), PALETTE * 4):
        segs: list[list[str]] = []
        cur: list[str] = []
        for x, y in pts:
            if not math.isfinite(y):
                segs.append(cur)
                cur = []
                continue
            px = ML + (x - x0) / (x1 - x0) * pw
            py = MT + ph - (y - y0) / (y1 - y0) * ph
            cur.append(f"{px:.1f},{py:.1f}")
        segs.append(cur)
        for seg in segs:
            if len(seg) == 1:
                cx, cy = seg[0].split(",")
                parts.append(f'<circle cx="{cx}" cy="{cy}" r="2" fill="{colour}"/>')
            elif seg:
                pl = " ".join(seg)
                parts.append(
                    f'<polyline points="{pl}" fill="none" stroke="{colour}" stroke-width="1.5"/>'
                )
    parts += _legend(list(data), PALETTE * 4)
    return _svg(parts)


def stacked_bars(
    labels: list[str], stacks: dict[str, list[float]], ylabel: str, xlabel: str = ""
) -> str:
    """Inline SVG stacked bar chart: one bar per label, one segment per stack name."""
    n = max(len(labels), 1)
    totals = [sum(vals[i] for vals in stacks.values()) for i in range(len(labels))]
    y1 = max([*totals, 0.0]) * 1.1 or 1.0
    pw, ph = W - ML - MR, H - MT - MB
    parts = _axes(0, n, 0, y1, xlabel, ylabel, xticks=False)
    bw = pw / n
    label_every = max(1, math.ceil(n / 8))
    for i, label in enumerate(labels):
        base = 0.0
        for (name, vals), colour in zip(stacks.items(), PALETTE * 4):
            v = vals[i]
            if v <= 0:
                continue
            y_top = MT + ph - (base + v) / y1 * ph
            hgt = v / y1 * ph
            parts.append(
                f'<rect x="{ML + i * bw + bw * 0.1:.1f}" y="{y_top:.1f}" width="{bw * 0.8:.1f}" '
                f'height="{hgt:.1f}" fill="{colour}"><title>{_e(label)} {_e(name)}: {_fmt(v)}'
                "</title></rect>"
            )
            base += v
        if i % label_every == 0:
            parts.append(
                f'<text x="{ML + (i + 0.5) * bw:.1f}" y="{MT + ph + 15}" text-anchor="middle">'
                f"{_e(label)}</text>"
            )
    parts += _legend(list(stacks), PALETTE * 4)
    return _svg(parts)


def _heat_colour(ratio: float, threshold: float) -> str:
    # White at the median, red at/above the threshold, blue for faster-than-median ranks.
    if not math.isfinite(ratio):
        return "#000"
    if ratio >= 1.0:
        f = min((ratio - 1.0) / max(threshold - 1.0, 1e-6), 1.0)
        return f"rgb(255,{int(255 * (1 - f))},{int(255 * (1 - f))})"
    f = min((1.0 - ratio) / 0.2, 1.0)
    return f"rgb({int(255 * (1 - f * 0.6))},{int(255 * (1 - f * 0.3))},255)"


def straggler_heatmap(records: list[dict[str, Any]]) -> str:
    """Ranks (rows) × reports (columns), coloured by compute time relative to the median."""
    rows = [r for r in records if isinstance(r.get("compute_ms"), list) and r["compute_ms"]]
    ranks = max(len(r["compute_ms"]) for r in rows)
    cols = len(rows)
    cell_h = max(6.0, min(24.0, 400.0 / ranks))
    height = int(MT + ranks * cell_h + MB)
    pw = W - ML - MR
    cw = pw / cols
    parts: list[str] = []
    for c, rec in enumerate(rows):
        med = float(rec.get("median_ms") or 0.0) or 1.0
        thr = float(rec.get("threshold") or 1.2)
        for r, ms in enumerate(rec["compute_ms"]):
            ratio = float(ms) / med
            parts.append(
                f'<rect x="{ML + c * cw:.1f}" y="{MT + r * cell_h:.1f}" width="{cw + 0.5:.1f}" '
                f'height="{cell_h + 0.5:.1f}" fill="{_heat_colour(ratio, thr)}"><title>iteration '
                f"{_e(rec.get('iteration'))} rank {r}: {float(ms):.2f} ms ({ratio:.2f}x median)"
                "</title></rect>"
            )
    step = max(1, ranks // 16)
    for r in range(0, ranks, step):
        y = MT + (r + 0.5) * cell_h + 4
        parts.append(f'<text x="{ML - 5}" y="{y:.1f}" text-anchor="end">rank {r}</text>')
    for c in (0, cols - 1):
        parts.append(
            f'<text x="{ML + (c + 0.5) * cw:.1f}" y="{height - MB + 15}" text-anchor="middle">'
            f"it {_e(rows[c].get('iteration'))}</text>"
        )
    parts.append(
        f'<text x="{W - MR + 10}" y="{MT + 12}">red: ≥ threshold × median</text>'
        f'<text x="{W - MR + 10}" y="{MT + 28}">white: median</text>'
        f'<text x="{W - MR + 10}" y="{MT + 44}">blue: faster</text>'
    )
    return _svg(parts, height)


def timeline(events: list[dict[str, Any]], x_max: float | None) -> str:
    """One lane per event kind, a marker per event at its iteration."""
    kinds = [k.value for k in EventKind]
    its = [float(e.get("iteration", 0)) for e in events]
    x0, x1 = _bounds([*its, 0.0, x_max or 0.0])
    lane_h = 24
    height = MT + lane_h * len(kinds) + MB
    pw = W - ML - MR
    parts = [
        f'<rect x="{ML}" y="{MT}" width="{pw}" height="{lane_h * len(kinds)}" fill="#fff" stroke="#999"/>'
    ]
    for i, kind in enumerate(kinds):
        y = MT + lane_h * (i + 0.5)
        parts.append(f'<text x="{ML - 5}" y="{y + 4}" text-anchor="end">{kind}</text>')
        parts.append(f'<line x1="{ML}" x2="{ML + pw}" y1="{y}" y2="{y}" stroke="#eee"/>')
    for ev in events:
        kind = str(ev.get("kind"))
        if kind not in kinds:
            continue
        x = ML + (float(ev.get("iteration", 0)) - x0) / (x1 - x0) * pw
        y = MT + lane_h * (kinds.index(kind) + 0.5)
        parts.append(
            f'<circle cx="{x:.1f}" cy="{y}" r="5" fill="{KIND_COLOURS[kind]}"><title>'
            f"iteration {_e(ev.get('iteration'))} {kind}: {_e(ev.get('detail', ''))}</title></circle>"
        )
    for v in _ticks(x0, x1):
        x = ML + (v - x0) / (x1 - x0) * pw
        parts.append(
            f'<text x="{x:.1f}" y="{height - MB + 15}" text-anchor="middle">{_fmt(v)}</text>'
        )
    parts.append(f'<text x="{ML + pw / 2}" y="{height - 5}" text-anchor="middle">iteration</text>')
    return _svg(parts, height)


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _section(sid: str, title: str, body: str) -> str:
    return f'<section id="{sid}"><h2>{_e(title)}</h2>{body}</section>'


def _skipped(what: str) -> str:
    return f'<p class="note">{_e(what)}: not available in this run directory.</p>'


def _mib(v: object) -> str:
    return f"{float(v) / 2**20:,.1f} MiB" if isinstance(v, (int, float)) else "n/a"


def _metric_sections(art: RunArtefacts) -> list[str]:
    m = art.metrics
    out = []
    charts = (
        ("loss", "Loss", {"loss": series(m, *LOSS_KEYS)}, "loss"),
        ("learning-rate", "Learning rate", {"lr": series(m, *LR_KEYS)}, "lr"),
        (
            "throughput",
            "Throughput",
            {"TFLOP/s/GPU": series(m, *THROUGHPUT_KEYS)},
            "throughput",
        ),
    )
    for sid, title, data, ylabel in charts:
        has = any(data.values())
        body = line_chart(data, "iteration", ylabel) if has else _skipped(title)
        if sid == "throughput" and series(m, "elapsed_ms"):
            body += line_chart({"elapsed ms/iter": series(m, "elapsed_ms")}, "iteration", "ms")
        out.append(_section(sid, title, body))
    names = timer_names(m)
    if names:
        rows = [r for r in m if any(k in r for k in names)]
        stride = max(1, math.ceil(len(rows) / 60))
        rows = rows[::stride]
        stacks = {timer_label(k): [float(r.get(k, 0.0) or 0.0) for r in rows] for k in names}
        body = stacked_bars(
            [str(r["iteration"]) for r in rows], stacks, "ms per iteration", "iteration"
        )
    else:
        body = _skipped("Timers (<name>-time-ms or timer/<name> keys)")
    out.append(_section("timers", "Timer breakdown per iteration", body))
    return out


def _memory_section(art: RunArtefacts) -> str:
    mem = art.memory
    parts = []
    if mem:
        theo = mem.get("theoretical") or {}
        measured = mem.get("measured") or {}
        peak = float(mem.get("measured_peak_bytes") or 0.0)
        w = float(theo.get("weights_optimizer_bytes") or 0.0)
        a = float(theo.get("activation_bytes") or 0.0)
        reserved = float(measured.get("mem-max-reserved-bytes", 0.0) or 0.0)
        mib = 2.0**20
        parts.append(
            stacked_bars(
                ["theoretical", "measured peak", "max reserved"],
                {
                    "weights+optimizer": [w / mib, 0.0, 0.0],
                    "activations": [a / mib, 0.0, 0.0],
                    "measured": [0.0, peak / mib, reserved / mib],
                },
                "MiB",
            )
        )
        ratio = mem.get("theoretical_over_measured")
        src = mem.get("measured_source", "?")
        rows: list[list[object]] = [
            ["theoretical total", _mib(theo.get("total_bytes"))],
            [f"measured peak ({src})", _mib(peak)],
            ["theoretical / measured", f"{ratio:.3f}" if isinstance(ratio, float) else "n/a"],
            ["parameters", f"{int(theo.get('num_parameters') or 0):,}"],
            ["bytes per parameter", theo.get("bytes_per_parameter", "n/a")],
        ]
        rows += [[k, _mib(v)] for k, v in (theo.get("breakdown") or {}).items()]
        parts.append(_table(["quantity", "value"], rows))
    else:
        parts.append(_skipped("memory.json (theoretical vs measured)"))
    mem_series = {
        k: [(x, y / 2**20) for x, y in series(art.metrics, k)]
        for k in ("mem-max-allocated-bytes", "mem-allocated-bytes", "mem-reserved-bytes")
    }
    if any(mem_series.values()):
        parts.append(line_chart(mem_series, "iteration", "MiB"))
    return _section("memory", "Memory: theoretical vs measured", "".join(parts))


def _straggler_section(art: RunArtefacts) -> str:
    recs = [r for r in art.straggler if isinstance(r.get("compute_ms"), list) and r["compute_ms"]]
    if not recs:
        return _section("stragglers", "Stragglers", _skipped("straggler.jsonl"))
    flagged: dict[int, int] = {}
    for r in recs:
        for rank in r.get("stragglers") or []:
            flagged[int(rank)] = flagged.get(int(rank), 0) + 1
    summary = (
        "<p>Flagged ranks (times flagged): "
        + (", ".join(f"rank {k} ({v})" for k, v in sorted(flagged.items())) or "none")
        + "</p>"
    )
    last = recs[-1]
    table = _table(
        ["last report", "min ms", "median ms", "max ms", "slowest"],
        [
            [
                last.get("iteration"),
                _fmt(float(last.get("min_ms", 0))),
                _fmt(float(last.get("median_ms", 0))),
                _fmt(float(last.get("max_ms", 0))),
                (last.get("slowest") or [["?"]])[0][0],
            ]
        ],
    )
    return _section("stragglers", "Stragglers", straggler_heatmap(recs) + summary + table)


def _metric_counter_events(art: RunArtefacts) -> list[dict[str, Any]]:
    """Skipped/NaN markers from the metrics counters, for kinds events.jsonl does not record."""
    logged = {str(e.get("kind")) for e in art.events}
    out: list[dict[str, Any]] = []
    for key, kind in (("skipped_iterations", "skipped"), ("nan_iterations", "nan")):
        if kind in logged:
            continue
        for row in art.metrics:
            n = row.get(key)
            if isinstance(n, (int, float)) and n > 0:
                detail = f"{int(n)} in the log interval ending here (metrics counter)"
                out.append({"iteration": row["iteration"], "kind": kind, "detail": detail})
    return out


def _timeline_section(art: RunArtefacts) -> str:
    events = sorted(
        art.events + _metric_counter_events(art), key=lambda e: float(e.get("iteration", 0))
    )
    if not events and not art.exit_reason:
        return _section("timeline", "Timeline", _skipped("events.jsonl"))
    its = [float(r["iteration"]) for r in art.metrics]
    body = timeline(events, max(its) if its else None) if events else ""
    counts: dict[str, int] = {}
    for ev in events:
        counts[str(ev.get("kind"))] = counts.get(str(ev.get("kind")), 0) + 1
    body += _table(["kind", "count"], sorted(counts.items()))
    rows = [[e.get("iteration"), e.get("kind"), e.get("detail", "")] for e in events[-50:]]
    body += _table(["iteration", "kind", "detail"], rows)
    if art.exit_reason:
        body += "<h3>Exit reason</h3>" + _table(
            ["key", "value"], [[k, v] for k, v in art.exit_reason.items()]
        )
    return _section("timeline", "Timeline: skipped/NaN iterations, reruns, restarts, exits", body)


def _chaos_section(art: RunArtefacts) -> str:
    chaos = art.chaos or {}
    passed = bool(chaos.get("passed"))
    verdict = (
        f'<p class="{"ok" if passed else "bad"}">chaos run: {"PASSED" if passed else "FAILED"}</p>'
    )
    faults = [f for f in chaos.get("faults") or [] if isinstance(f, dict)]
    keys: list[str] = []
    for f in faults:
        keys += [k for k in f if k not in keys]
    table = _table(keys, [[f.get(k, "") for k in keys] for f in faults]) if faults else ""
    return _section("chaos", "Chaos", verdict + table)


CSS = """
body{font-family:sans-serif;margin:24px;max-width:1000px;color:#222}
h1{font-size:22px} h2{font-size:18px;border-bottom:1px solid #ccc;padding-bottom:4px}
table{border-collapse:collapse;margin:8px 0;font-size:13px}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:left} th{background:#f3f3f3}
.note{color:#777;font-style:italic} .ok{color:#2a2;font-weight:bold} .bad{color:#c22;font-weight:bold}
"""


def render_html(art: RunArtefacts, png_names: Sequence[str] = ()) -> str:
    """The complete, self-contained report page."""
    sections = _metric_sections(art)
    sections += [_memory_section(art), _straggler_section(art), _timeline_section(art)]
    if art.chaos is not None:
        sections.append(_chaos_section(art))
    notes = "".join(f"<li>{_e(n)}</li>" for n in art.notes)
    pngs = ", ".join(f"report/{_e(n)}" for n in png_names)
    header = (
        f"<h1>stalwart run report</h1><p>Run directory: <code>{_e(art.run_dir)}</code><br>"
        f"Generated {_e(time.strftime('%Y-%m-%d %H:%M:%S'))}; {len(art.metrics)} metric rows."
        + (f"<br>PNG charts: {pngs}" if pngs else "")
        + "</p>"
        + (f'<ul class="note">{notes}</ul>' if notes else "")
    )
    return (
        '<!DOCTYPE html><html><head><meta charset="utf-8"><title>stalwart run report</title>'
        f"<style>{CSS}</style></head><body>{header}{''.join(sections)}</body></html>"
    )
