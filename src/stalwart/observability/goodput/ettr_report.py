"""``stalwart goodput --project N,...``: a ledger's measured recoveries and checkpoint cadence,
projected to N GPUs with `stalwart.observability.goodput.ettr`, as text and JSON.

What is measured (from ``goodput.jsonl``):

* per recovery (`stalwart.observability.goodput.recovery`): detection, teardown, restart,
  recompile and lost work seconds, grouped by fault kind; the projection uses the mean over the
  failures (planned stops such as a SIGTERM are listed, and used only when there is nothing else);
* the checkpoint cadence: ``w``, the mean blocking seconds of a save (the ``checkpoint`` bucket
  per save), and ``dt``, the checkpoint interval in seconds of training: the median step between
  the iterations of successive saves times the mean productive seconds per iteration (or
  ``--checkpoint-interval``). The expected lost work per failure is then ``dt / 2``: where in its
  interval this run's faults happened to land says nothing about the next ones. Without a known
  interval the measured mean lost work is used, and a note says so.

Standard library only.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from stalwart.observability.goodput.ettr import (
    META_RESEARCH_CLUSTERS,
    PROJECTED_COMPONENTS,
    FailureModel,
    RecoveryCost,
    ScalePoint,
    expected_ettr,
    project,
)
from stalwart.observability.goodput.records import (
    Bucket,
    LedgerFile,
    RecordKind,
    Span,
    format_duration,
)
from stalwart.observability.goodput.recovery import COMPONENTS, Recovery, recoveries

__all__ = ["Cadence", "NothingToProject", "Projection", "format_projection", "project_ledger"]

FORMULA = (
    "ETTR(N) = (1 - C / MTTF(N)) / (1 + w / dt); "
    "C = detection + teardown + restart + recompile + lost work (dt / 2)"
)
ALL_FAILURES = "all failures"


class NothingToProject(ValueError):
    """The ledger holds no recovery from a fault: there is no measured cost to project."""


@dataclass(frozen=True)
class Cadence:
    """The run's checkpoints: ``saves`` (distinct save iterations of a session), ``write_s`` (mean
    blocking seconds per save), the median ``interval_iterations`` between successive saves and
    the mean productive ``seconds_per_iteration`` (None where the ledger cannot tell)."""

    saves: int
    write_s: float
    interval_iterations: float | None
    seconds_per_iteration: float | None

    @property
    def interval_s(self) -> float | None:
        if self.interval_iterations is None or self.seconds_per_iteration is None:
            return None
        return self.interval_iterations * self.seconds_per_iteration


def _by_session(file: LedgerFile) -> dict[str, tuple[int | None, list[Span]]]:
    """Each session's resumed iteration and its spans in time order."""
    out: dict[str, tuple[int | None, list[Span]]] = {}
    for record in file.records:
        spans = out.setdefault(record.session, (None, []))[1]
        if isinstance(record, Span):
            spans.append(record)
        elif record.kind is RecordKind.RESUME and isinstance(record.get("it"), int):
            out[record.session] = (record.get("it"), spans)
    return {sid: (it, sorted(spans, key=lambda s: s.t0)) for sid, (it, spans) in out.items()}


def measure_cadence(file: LedgerFile) -> Cadence:
    """The run's :class:`Cadence` (see the module docstring)."""
    save_seconds: dict[tuple[str, int], float] = {}
    productive_s, productive_its = 0.0, 0
    for sid, (done, spans) in _by_session(file).items():
        for span in spans:
            if span.bucket is Bucket.CHECKPOINT and span.iteration is not None:
                key = (sid, span.iteration)
                save_seconds[key] = save_seconds.get(key, 0.0) + span.seconds
            if span.iteration is None or span.bucket is Bucket.CHECKPOINT:
                continue
            if span.bucket is Bucket.PRODUCTIVE and done is not None and span.iteration > done:
                productive_s += span.seconds
                productive_its += span.iteration - done
            done = span.iteration if done is None else max(done, span.iteration)
    saves = len(save_seconds)
    write_s = sum(save_seconds.values()) / saves if saves else 0.0
    iterations = sorted({it for _, it in save_seconds})
    steps = [b - a for a, b in itertools.pairwise(iterations) if b > a]
    interval = float(statistics.median(steps)) if steps else None
    per_it = productive_s / productive_its if productive_its else None
    return Cadence(saves, write_s, interval, per_it)


@dataclass(frozen=True)
class KindRow:
    """The mean measured seconds per recovery of one fault kind (or of all failures)."""

    kind: str
    count: int
    mean: dict[str, float]  # COMPONENTS -> seconds

    @property
    def total_s(self) -> float:
        return sum(self.mean.values())


def _row(kind: str, items: Sequence[Recovery]) -> KindRow:
    mean = {c: sum(r.seconds()[c] for r in items) / len(items) for c in COMPONENTS}
    return KindRow(kind, len(items), mean)


@dataclass(frozen=True)
class Projection:
    """Everything ``stalwart goodput --project`` prints (``format_projection``, ``to_json``)."""

    recoveries: list[Recovery]
    rows: list[KindRow]  # per kind, then the basis when it is not a single kind's row
    basis: KindRow
    cadence: Cadence
    interval_s: float | None
    interval_source: str  # "measured", "--checkpoint-interval" or "unknown"
    cost: RecoveryCost
    model: FailureModel
    points: list[ScalePoint]
    by_kind: dict[str, list[float]]  # kind -> ETTR at each point's GPU count
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return _to_json(self)


def _cost(row: KindRow, cadence: Cadence, interval_s: float | None) -> RecoveryCost:
    lost = interval_s / 2 if interval_s is not None else row.mean["lost work"]
    return RecoveryCost(
        detection_s=row.mean["detection"],
        teardown_s=row.mean["teardown"],
        restart_s=row.mean["restart"],
        recompile_s=row.mean["recompile"],
        lost_work_s=lost,
        checkpoint_write_s=cadence.write_s if interval_s is not None else 0.0,
        checkpoint_interval_s=interval_s,
    )


def project_ledger(
    file: LedgerFile,
    gpus: Sequence[int],
    model: FailureModel = META_RESEARCH_CLUSTERS,
    checkpoint_interval_s: float | None = None,
) -> Projection:
    """Measure ``file`` and project it to each of ``gpus``. Raises :class:`NothingToProject`
    when no session came back after a fault."""
    found = recoveries(file)
    if not found:
        raise NothingToProject(
            "records no recovery from a fault (no session came back after one that did not "
            "finish): there is no measured recovery to project"
        )
    kinds = sorted({r.kind for r in found})
    rows = [_row(k, [r for r in found if r.kind == k]) for k in kinds]
    failures = [r for r in found if not r.planned]
    notes: list[str] = []
    if failures:
        basis = _row(ALL_FAILURES, failures)
    else:
        basis = _row(ALL_FAILURES, found)
        notes.append(
            "the ledger has planned stops only (" + ", ".join(kinds) + "): projected with their "
            "recovery, as if each were a failure"
        )
    if len(kinds) > 1 or basis.count != len(found):
        rows.append(basis)
    cadence = measure_cadence(file)
    interval, source = checkpoint_interval_s, "--checkpoint-interval"
    if interval is None:
        interval, source = cadence.interval_s, "measured"
    if interval is None:
        source = "unknown"
        notes.append(
            "no checkpoint interval: fewer than two saves in the ledger; lost work is the "
            "measured mean per failure and saves cost nothing (pass --checkpoint-interval SECONDS)"
        )
    cost = _cost(basis, cadence, interval)
    points = project(cost, model, list(gpus))
    by_kind = {
        row.kind: [expected_ettr(_cost(row, cadence, interval), p.mttf_s) for p in points]
        for row in rows
    }
    return Projection(
        found, rows, basis, cadence, interval, source, cost, model, points, by_kind, notes
    )


# ------------------------------------------------------------------------------ text


def _pct(fraction: float) -> str:
    return f"{100.0 * fraction:.2f}%"


def _measured(p: Projection) -> list[str]:
    header = f"{'kind':<16}{'count':>6}" + "".join(f"{n:>11}" for n in [*COMPONENTS, "total"])
    lines = ["measured per recovery (mean seconds)", header]
    for row in p.rows:
        values = [*(row.mean[c] for c in COMPONENTS), row.total_s]
        lines.append(f"{row.kind:<16}{row.count:>6}" + "".join(f"{v:>11.1f}" for v in values))
    return lines


def _cadence_line(p: Projection) -> str:
    c = p.cadence
    saves = f"{c.write_s:.2f} s blocking per save (w; saves: {c.saves})"
    if p.interval_s is None:
        return f"checkpoints: interval unknown; {saves}"
    if p.interval_source == "measured":
        assert c.interval_iterations is not None and c.seconds_per_iteration is not None
        how = (
            f"every {c.interval_iterations:g} iterations x {c.seconds_per_iteration:.3f} s = "
            f"{p.interval_s:.1f} s of training (dt, measured)"
        )
    else:
        how = f"every {p.interval_s:.1f} s of training (dt, --checkpoint-interval)"
    return f"checkpoints: {how}; {saves}"


def _scale_table(p: Projection) -> list[str]:
    lines = [f"{'GPUs':>9}{'MTTF':>9}{'failures/day':>14}{'ETTR':>9}{'Young dt*':>11}"]
    for pt in p.points:
        young = format_duration(pt.young_interval_s) if pt.young_interval_s is not None else "-"
        lines.append(
            f"{pt.gpus:>9,}{format_duration(pt.mttf_s):>9}{pt.failures_per_day:>14.2f}"
            f"{_pct(pt.ettr):>9}{young:>11}"
        )
    return lines


def _grid(title: str, header: Sequence[str], rows: Sequence[tuple[str, list[str]]]) -> list[str]:
    width = max(12, *(len(h) + 2 for h in header))
    lines = [title, f"{'':<16}" + "".join(f"{h:>{width}}" for h in header)]
    lines += [f"{name:<16}" + "".join(f"{v:>{width}}" for v in cells) for name, cells in rows]
    return lines


def format_projection(p: Projection) -> str:
    """The ``stalwart goodput --project`` text: failure model, measured recoveries, the projected
    ETTR per GPU count, per fault kind, and the sensitivity to each component."""
    cost = p.cost
    used = " + ".join(
        f"{name} {seconds:.1f}" for name, seconds in cost.seconds().items() if name in COMPONENTS
    )
    lost = "dt / 2" if p.interval_s is not None else "measured mean"
    gpus = [f"{pt.gpus:,}" for pt in p.points]
    by_kind = [(k, [_pct(e) for e in v]) for k, v in p.by_kind.items()]
    halved = _sensitivity_rows(p, lambda s, pt: f"{100 * (s.halved - pt.ettr):+.3f}")
    slope = _sensitivity_rows(p, lambda s, pt: f"{6000 * s.per_second:+.3f}")
    lines = [
        "ETTR at scale: this run's measured recovery, projected to N GPUs",
        f"failure model: {p.model.describe()}",
        FORMULA,
        "",
        *_measured(p),
        _cadence_line(p),
        f"projected with C = {used} = {cost.per_failure_s:.1f} s per failure "
        f"(lost work: {lost}; {p.basis.kind}, {p.basis.count} recoveries)",
        "",
        *_scale_table(p),
        "",
        *_grid("ETTR if every failure cost what this kind cost", gpus, by_kind),
        "",
        *_grid("sensitivity: ETTR gained if the component were halved (points)", gpus, halved),
        "",
        *_grid("sensitivity: d ETTR / d component (points per minute)", gpus, slope),
    ]
    lines += [f"note: {n}" for n in p.notes]
    return "\n".join(lines)


def _sensitivity_rows(p: Projection, cell: Any) -> list[tuple[str, list[str]]]:
    return [
        (name, [cell(pt.sensitivity[i], pt) for pt in p.points])
        for i, name in enumerate(PROJECTED_COMPONENTS)
    ]


# ------------------------------------------------------------------------------ JSON


def _to_json(p: Projection) -> dict[str, Any]:
    return {
        "failure_model": {
            "gpu_hours_per_failure": p.model.gpu_hours_per_failure,
            "source": p.model.source,
        },
        "formula": FORMULA,
        "recoveries": [
            {"kind": r.kind, "session": r.session, **r.seconds(), "total": r.total_s}
            for r in p.recoveries
        ],
        "kinds": [{"kind": r.kind, "count": r.count, **r.mean} for r in p.rows],
        "basis": p.basis.kind,
        "checkpoint": {
            "saves": p.cadence.saves,
            "write_s": p.cadence.write_s,
            "interval_s": p.interval_s,
            "interval_source": p.interval_source,
            "interval_iterations": p.cadence.interval_iterations,
            "seconds_per_iteration": p.cadence.seconds_per_iteration,
        },
        "cost_s": {**p.cost.seconds(), "per_failure": p.cost.per_failure_s},
        "points": [_point_json(pt) for pt in p.points],
        "by_kind": p.by_kind,
        "notes": list(p.notes),
    }


def _point_json(pt: ScalePoint) -> dict[str, Any]:
    return {
        "gpus": pt.gpus,
        "mttf_s": pt.mttf_s,
        "failures_per_day": pt.failures_per_day,
        "ettr": pt.ettr,
        "young_interval_s": pt.young_interval_s,
        "sensitivity": {
            s.component: {"seconds": s.seconds, "ettr_halved": s.halved, "per_second": s.per_second}
            for s in pt.sensitivity
        },
    }
