"""Inline-SVG charts of the run report: the static fallback when plotly is not installed.

Pure string builders (no network resources, no matplotlib): a line chart, stacked bars, the
straggler heat map and the event timeline. Hover titles (``<title>``) give exact values.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from typing import Any

from stalwart.observability.run_dir import EventKind

PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")
KIND_COLOURS = {
    EventKind.SKIPPED.value: "#ff7f0e",
    EventKind.NAN.value: "#d62728",
    EventKind.RERUN.value: "#9467bd",
    EventKind.RESTART.value: "#1f77b4",
    EventKind.EXIT.value: "#000000",
    EventKind.CHECKPOINT.value: "#2ca02c",
    EventKind.LAUNCH.value: "#8c564b",
}
W, H, ML, MR, MT, MB = 760, 260, 70, 190, 20, 40
Points = list[tuple[float, float]]


def series_colours(names: Sequence[str], dashed: frozenset[str] = frozenset()) -> list[str]:
    """A palette colour per series; a dashed ``"<name> (validation)"`` takes ``<name>``'s colour,
    so a run's training and validation curves read as one run."""
    solid = [n for n in names if n not in dashed]
    own = {n: PALETTE[i % len(PALETTE)] for i, n in enumerate(solid)}
    extra = iter(PALETTE[(len(solid) + i) % len(PALETTE)] for i in range(len(names)))
    return [own.get(n) or own.get(n.removesuffix(" (validation)")) or next(extra) for n in names]


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


def line_chart(
    data: dict[str, Points],
    xlabel: str,
    ylabel: str,
    x_max: float | None = None,
    dashed: frozenset[str] = frozenset(),
) -> str:
    """Inline SVG line chart of several ``(x, y)`` series (non-finite y values are gaps); the x
    axis reaches at least ``x_max``; series named in ``dashed`` are drawn dashed."""
    data = {k: v for k, v in data.items() if v}
    xs = [p[0] for pts in data.values() for p in pts]
    x0, x1 = _bounds([*xs, x_max] if x_max is not None and xs else xs)
    y0, y1 = _bounds([p[1] for pts in data.values() for p in pts])
    pw, ph = W - ML - MR, H - MT - MB
    parts = _axes(x0, x1, y0, y1, xlabel, ylabel)
    colours = series_colours(list(data), dashed)
    for (name, pts), colour in zip(data.items(), colours):
        dash = ' stroke-dasharray="5,3"' if name in dashed else ""
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
                    f'<polyline points="{pl}" fill="none" stroke="{colour}" '
                    f'stroke-width="1.5"{dash}/>'
                )
    parts += _legend(list(data), colours)
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


HEAT_FAST, HEAT_MEDIAN, HEAT_SLOW = (49, 130, 189), (189, 189, 189), (214, 39, 40)


def _mix(a: tuple[int, int, int], b: tuple[int, int, int], f: float) -> str:
    r, g, bl = (round(x + (y - x) * f) for x, y in zip(a, b))
    return f"rgb({r},{g},{bl})"


def heat_colour(ratio: float, threshold: float) -> str:
    """Grey at the median (visible on the white page), red at/above ``threshold`` × median, blue
    for ranks 20 % or more faster than the median; black for a non-finite ratio."""
    if not math.isfinite(ratio):
        return "#000"
    if ratio >= 1.0:
        return _mix(HEAT_MEDIAN, HEAT_SLOW, min((ratio - 1.0) / max(threshold - 1.0, 1e-6), 1.0))
    return _mix(HEAT_MEDIAN, HEAT_FAST, min((1.0 - ratio) / 0.2, 1.0))


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
                f'height="{cell_h + 0.5:.1f}" fill="{heat_colour(ratio, thr)}" stroke="#fff" '
                'stroke-width="0.5"><title>iteration '
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
        f'<text x="{W - MR + 10}" y="{MT + 28}">grey: median</text>'
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
        f'<rect x="{ML}" y="{MT}" width="{pw}" height="{lane_h * len(kinds)}" fill="#fff" '
        'stroke="#999"/>'
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
            f"iteration {_e(ev.get('iteration'))} {kind}: "
            f"{_e(ev.get('detail', ''))}</title></circle>"
        )
    for v in _ticks(x0, x1):
        x = ML + (v - x0) / (x1 - x0) * pw
        parts.append(
            f'<text x="{x:.1f}" y="{height - MB + 15}" text-anchor="middle">{_fmt(v)}</text>'
        )
    parts.append(f'<text x="{ML + pw / 2}" y="{height - 5}" text-anchor="middle">iteration</text>')
    return _svg(parts, height)
