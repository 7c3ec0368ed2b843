"""The run report's ETTR section: the run's measured recovery per fault, projected to 1,024,
16,384 and 131,072 GPUs under the default failure model (what ``stalwart goodput --project
1024,16384,131072 RUN_DIR`` prints, as tables).

Self-contained like the goodput section: ``ettr_section(run_dir)`` reads ``goodput.jsonl``
itself and returns one ``<section>``; a run with no recovery from a fault gets a note.
"""

from __future__ import annotations

import html
import os
from collections.abc import Sequence
from pathlib import Path

from stalwart.observability.goodput.ettr_report import (
    FORMULA,
    NothingToProject,
    Projection,
    project_ledger,
)
from stalwart.observability.goodput.reader import read_ledger
from stalwart.observability.goodput.records import GOODPUT_FILE, format_duration
from stalwart.observability.goodput.recovery import COMPONENTS

REPORT_GPUS = (1024, 16_384, 131_072)
_TITLE = "ETTR at scale: this run's recovery, projected"


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _pct(fraction: float) -> str:
    return f"{100.0 * fraction:.2f}%"


def _body(p: Projection) -> str:
    gpus = [f"{pt.gpus:,} GPUs" for pt in p.points]
    measured = [
        [row.kind, row.count, *(f"{row.mean[c]:.1f}" for c in COMPONENTS), f"{row.total_s:.1f}"]
        for row in p.rows
    ]
    scale = [
        [f"{pt.gpus:,}", format_duration(pt.mttf_s), f"{pt.failures_per_day:.2f}", _pct(pt.ettr)]
        for pt in p.points
    ]
    by_kind = [[kind, *(_pct(e) for e in values)] for kind, values in p.by_kind.items()]
    halved = [
        [s.component, *(f"{100 * (pt.sensitivity[i].halved - pt.ettr):+.3f}" for pt in p.points)]
        for i, s in enumerate(p.points[0].sensitivity)
    ]
    cost = p.cost
    used = ", ".join(f"{name} {secs:.1f} s" for name, secs in cost.seconds().items())
    return (
        f"<p>Failure model: {_e(p.model.describe())}.<br><code>{_e(FORMULA)}</code></p>"
        "<p>Measured per recovery (mean seconds):</p>"
        + _table(["kind", "count", *COMPONENTS, "total"], measured)
        + f"<p>Projected with {_e(used)} (C = {cost.per_failure_s:.1f} s per failure; "
        f"checkpoint interval: {_e(p.interval_source)}).</p>"
        + _table(["GPUs", "MTTF", "failures/day", "ETTR"], scale)
        + "<p>ETTR if every failure cost what this kind cost:</p>"
        + _table(["kind", *gpus], by_kind)
        + "<p>Sensitivity: ETTR gained if the component were halved (percentage points):</p>"
        + _table(["component", *gpus], halved)
        + "".join(f'<p class="note">{_e(n)}</p>' for n in p.notes)
    )


def ettr_section(run_dir: str | os.PathLike[str]) -> str:
    """The ``<section id="ettr">`` of the report (a note when there is nothing to project)."""
    file = read_ledger(Path(run_dir) / GOODPUT_FILE)
    try:
        body = _body(project_ledger(file, list(REPORT_GPUS)))
    except NothingToProject as exc:
        what = f"{GOODPUT_FILE}: not available" if not file.records else f"{GOODPUT_FILE} {exc}"
        body = f'<p class="note">{_e(what)}.</p>'
    return f'<section id="ettr"><h2>{_e(_TITLE)}</h2>{body}</section>'
