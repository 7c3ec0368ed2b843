"""The run report's goodput section: the headline, a stacked timeline of every second of the job
(one lane per session, coloured by bucket), the share per bucket and the sessions.

Self-contained (inline SVG, no network), and independent of the rest of the report's rendering:
``goodput_section(run_dir)`` reads ``goodput.jsonl`` itself and returns one ``<section>``.
"""

from __future__ import annotations

import html
import os
from collections.abc import Sequence
from pathlib import Path

from stalwart.observability.goodput.reader import read_ledger
from stalwart.observability.goodput.records import (
    GOODPUT_FILE,
    Bucket,
    GoodputSummary,
    Span,
    format_duration,
    goodput_line,
    summarize,
)

BUCKET_COLOURS = {
    Bucket.PRODUCTIVE: "#2ca02c",
    Bucket.STARTUP: "#1f77b4",
    Bucket.COMPILE: "#17becf",
    Bucket.EVALUATION: "#bcbd22",
    Bucket.CHECKPOINT: "#9467bd",
    Bucket.RERUN: "#e377c2",
    Bucket.LOST_WORK: "#ff7f0e",
    Bucket.RESTART: "#d62728",
    Bucket.HANG: "#8c564b",
    Bucket.STRAGGLER: "#7f7f7f",
}
_W, _LEFT, _RIGHT, _LANE, _TOP = 760, 90, 20, 22, 10
_MIN_PX = 0.3  # narrower runs are not drawn (their seconds are in the table)


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _merged(spans: list[Span]) -> list[tuple[Bucket, float, float]]:
    """Adjacent spans of one bucket as one run (a long job has one span per flush interval)."""
    out: list[tuple[Bucket, float, float]] = []
    for s in sorted(spans, key=lambda x: x.t0):
        if out and out[-1][0] is s.bucket and s.t0 - out[-1][2] < 1e-3:
            out[-1] = (s.bucket, out[-1][1], max(out[-1][2], s.t1))
        else:
            out.append((s.bucket, s.t0, s.t1))
    return out


def timeline_svg(spans: list[Span], sessions: list[str]) -> str:
    """One lane per session, x = seconds since the job's first record."""
    if not spans:
        return ""
    t_first = min(s.t0 for s in spans)
    t_last = max(s.t1 for s in spans)
    width = _W - _LEFT - _RIGHT
    scale = width / max(t_last - t_first, 1e-9)
    lanes = {sid: i for i, sid in enumerate(sessions)}
    height = _TOP + _LANE * max(len(lanes), 1) + 30
    parts = []
    for i in lanes.values():
        y = _TOP + i * _LANE
        parts.append(f'<text x="{_LEFT - 6}" y="{y + 15}" text-anchor="end">session {i}</text>')
    for sid in lanes:
        lane_spans = [s for s in spans if s.session == sid]
        y = _TOP + lanes[sid] * _LANE
        for bucket, t0, t1 in _merged(lane_spans):
            w = (t1 - t0) * scale
            if w < _MIN_PX:
                continue
            x = _LEFT + (t0 - t_first) * scale
            tip = f"{bucket.label}: {format_duration(t1 - t0)} at +{format_duration(t0 - t_first)}"
            parts.append(
                f'<rect x="{x:.2f}" y="{y + 2}" width="{max(w, 0.5):.2f}" height="{_LANE - 4}" '
                f'fill="{BUCKET_COLOURS[bucket]}"><title>{_e(tip)}</title></rect>'
            )
    axis_y = _TOP + _LANE * max(len(lanes), 1) + 14
    parts.append(f'<text x="{_LEFT}" y="{axis_y}">0</text>')
    parts.append(
        f'<text x="{_W - _RIGHT}" y="{axis_y}" text-anchor="end">'
        f"{_e(format_duration(t_last - t_first))}</text>"
    )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{height}" '
        f'viewBox="0 0 {_W} {height}" font-family="sans-serif" '
        f'font-size="11">{"".join(parts)}</svg>'
    )


def share_bar_svg(summary: GoodputSummary) -> str:
    """One 100 % bar split by bucket share, with a legend."""
    wall = summary.wall_s
    if wall <= 0:
        return ""
    width, x, parts = _W - _LEFT - _RIGHT, float(_LEFT), []
    for bucket, secs in summary.seconds.items():
        w = secs / wall * width
        if w <= 0:
            continue
        tip = f"{bucket.label}: {format_duration(secs)} ({100 * secs / wall:.1f}%)"
        parts.append(
            f'<rect x="{x:.2f}" y="4" width="{w:.2f}" height="18" '
            f'fill="{BUCKET_COLOURS[bucket]}"><title>{_e(tip)}</title></rect>'
        )
        x += w
    for i, bucket in enumerate(Bucket):
        lx, ly = _LEFT + (i % 5) * 130, 40 + (i // 5) * 16
        parts.append(
            f'<rect x="{lx}" y="{ly - 9}" width="10" height="10" fill="{BUCKET_COLOURS[bucket]}"/>'
            f'<text x="{lx + 14}" y="{ly}">{_e(bucket.label)}</text>'
        )
    parts.append(f'<text x="{_LEFT - 6}" y="17" text-anchor="end">share</text>')
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="76" viewBox="0 0 {_W} 76" '
        f'font-family="sans-serif" font-size="11">{"".join(parts)}</svg>'
    )


def _table(header: list[str], rows: Sequence[Sequence[object]]) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _sessions_table(rows: list[list[object]]) -> str:
    if not rows:
        return ""
    header = [
        "session",
        "torchrun restart",
        "attempt",
        "resumed",
        "last iteration",
        "downtime before",
        "startup",
        "end",
    ]
    return _table(header, rows)


def _lanes(summary: GoodputSummary, spans: list[Span]) -> list[str]:
    """One lane per session, in order; spans of a session without its record get one too."""
    lanes = [s.session for s in summary.sessions]
    return lanes + [sid for sid in dict.fromkeys(sp.session for sp in spans) if sid not in lanes]


def goodput_section(run_dir: str | os.PathLike[str]) -> str:
    """The ``<section id="goodput">`` of the report (a note when the run has no ledger)."""
    file = read_ledger(Path(run_dir) / GOODPUT_FILE)
    if not file.records:
        note = f"{GOODPUT_FILE}: not available in this run directory."
        return f'<section id="goodput"><h2>Goodput</h2><p class="note">{_e(note)}</p></section>'
    summary = summarize(file)
    spans = [r for r in file.records if isinstance(r, Span)]
    wall = summary.wall_s
    rows: list[list[object]] = [
        [b.label, f"{s:.1f}", f"{100 * s / wall:.1f}%" if wall else "-"]
        for b, s in summary.seconds.items()
    ]
    sessions: list[list[object]] = [
        [
            i,
            s.restart_count,
            s.attempt,
            s.resumed_at if s.resumed_at is not None else "-",
            s.last_iteration if s.last_iteration is not None else "-",
            format_duration(s.downtime_before_s),
            format_duration(s.startup_s),
            s.end_reason or "no end record",
        ]
        for i, s in enumerate(summary.sessions)
    ]
    body = (
        f"<p><b>{_e(goodput_line(summary))}</b></p>"
        + share_bar_svg(summary)
        + timeline_svg(spans, _lanes(summary, spans))
        + _table(["bucket", "seconds", "share"], rows)
        + _sessions_table(sessions)
        + "".join(f'<p class="note">{_e(n)}</p>' for n in summary.notes)
    )
    return f'<section id="goodput"><h2>Goodput: where the wall-clock time went</h2>{body}</section>'
