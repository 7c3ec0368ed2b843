"""The goodput ledger's file: record format, the summary (seconds per bucket, per session) and
its text forms. The reader that survives torn and hostile files is
:mod:`stalwart.observability.goodput.reader`.

Standard library only (``stalwart goodput`` reads a ledger without importing torch). The writer is
:class:`stalwart.observability.goodput.GoodputLedger`.

File: ``<run dir>/goodput.jsonl``, append-only, one JSON object per line, written by rank 0. Kinds:

* ``session``: a process (or in-process attempt) started: ``t``, ``launcher_start``, ``pid``,
  ``host``, ``restart_count`` (torchrun's), ``attempt`` (in-process), ``flush_s``.
* ``span``: ``[t0, t1]`` wall-clock seconds spent in bucket ``b``; ``it`` = iterations completed
  at ``t1``; ``idle`` = seconds of it that ranks waited on a straggler (productive spans only);
  ``gap`` = written by a later session for the time between the previous session's last record
  and its own start (restart downtime, hang until detected).
* ``fault``: ``t`` when a fault was detected, ``cause`` (``hang``, ``exception``, ...), ``since``.
* ``resume``: the checkpoint iteration a session resumed from.
* ``end``: the session ended cleanly: ``reason`` (``finished``, ``signal``, ``fault``, ...).
* ``action``: what ``stalwart launch`` did after a launch ended (written by the launcher, not a
  session): ``action`` (``restart``, ``exclude``, ...), ``detail`` (its one line),
  ``exit_code``, ``world_size``, ``devices``. Point records: they move no bucket boundary.

Spans of one writer never overlap and leave no holes, so the buckets sum to the wall time the
file covers. Time after a ``finished`` session and before the next one is a new job segment and is
not counted (a relaunch after an end for another reason, a crash or a kill, is restart downtime).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

GOODPUT_FILE = "goodput.jsonl"
MAX_LINE_BYTES = 1 << 16  # a longer line is not a record this writer produced
MAX_SPAN_S = 1e8  # ~3 years: anything longer is a corrupt record
FINISHED = "finished"


class Bucket(str, enum.Enum):  # noqa: UP042 (StrEnum needs Python 3.11 everywhere we run)
    """Where one second of a job went. Exactly one bucket per second."""

    STARTUP = "startup"  # launcher start -> first step (init, build, checkpoint load)
    COMPILE = "compile"  # torch.compile / CUDA-graph capture iterations
    PRODUCTIVE = "productive"  # training iterations that were not recomputed
    EVALUATION = "evaluation"
    CHECKPOINT = "checkpoint"  # the blocking part of saves (async overlap is productive)
    RERUN = "rerun"  # the rerun state machine's replays
    LOST_WORK = "lost_work"  # iterations recomputed after a restart (after the last save)
    RESTART = "restart"  # from a fault to the next first step
    HANG = "hang"  # from the last progress to the watchdog's detection
    STRAGGLER = "straggler"  # ranks idle, waiting on the slowest rank

    @property
    def label(self) -> str:
        return _LABELS.get(self, self.value)


_LABELS = {Bucket.LOST_WORK: "lost work", Bucket.STRAGGLER: "straggler wait"}


class CompileSource(str, enum.Enum):  # noqa: UP042
    """Where a ``compile`` span's time went (its ``src``; older ledgers have none)."""

    COLD = "cold"  # Inductor compiled at least one graph (a cache miss or bypass)
    WARM = "warm"  # Dynamo traced; every graph came from the persistent cache
    CAPTURE = "capture"  # nothing compiled; the iteration captured a CUDA graph
    SAVE = "save"  # writing the compile cache's artifacts file

    @property
    def label(self) -> str:
        return _SOURCE_LABELS[self]


_SOURCE_LABELS = {
    CompileSource.COLD: "cold compile",
    CompileSource.WARM: "warm cache load",
    CompileSource.CAPTURE: "CUDA graph capture",
    CompileSource.SAVE: "cache write",
}
UNATTRIBUTED = "unattributed"  # a compile span without a source (written by an older stalwart)


class RecordKind(str, enum.Enum):  # noqa: UP042
    SESSION = "session"
    SPAN = "span"
    FAULT = "fault"
    RESUME = "resume"
    END = "end"
    ACTION = "action"


@dataclass(frozen=True)
class Span:
    bucket: Bucket
    t0: float
    t1: float
    session: str
    iteration: int | None = None
    idle: float = 0.0
    gap: bool = False
    source: CompileSource | None = None  # compile spans: where the time went

    @property
    def seconds(self) -> float:
        return self.t1 - self.t0

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"k": "span", "b": self.bucket.value, "t0": round(self.t0, 6)}
        out.update(t1=round(self.t1, 6), s=self.session)
        if self.iteration is not None:
            out["it"] = self.iteration
        if self.idle > 0:
            out["idle"] = round(self.idle, 6)
        if self.gap:
            out["gap"] = True
        if self.source is not None:
            out["src"] = self.source.value
        return out


@dataclass(frozen=True)
class Marker:
    """A point record: ``session``, ``fault``, ``resume`` or ``end``."""

    kind: RecordKind
    t: float
    session: str = ""
    fields: Mapping[str, Any] = field(default_factory=dict)

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def to_json(self) -> dict[str, Any]:
        return {"k": self.kind.value, "t": round(self.t, 6), "s": self.session, **self.fields}


Record = Span | Marker


def json_count(value: Any) -> int | None:
    """``value`` when it is a count JSON holds exactly (an int, not a bool, in [0, 2**53)); else
    None."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**53:
        return None
    return value


@dataclass
class LedgerFile:
    """What a read found (:func:`stalwart.observability.goodput.reader.read_ledger`): valid
    records in file order, and what it had to skip."""

    records: list[Record] = field(default_factory=list)
    bad_lines: list[tuple[int, str]] = field(default_factory=list)  # (line number, why)
    torn_tail: bool = False  # the last line had no newline: the writer died mid-write
    exists: bool = False
    path: str = ""

    @property
    def skipped(self) -> int:
        """Complete lines that are not valid records."""
        return len(self.bad_lines)

    def skipped_note(self) -> str | None:
        """One line naming the file and the skipped lines (None when none was skipped)."""
        if not self.bad_lines:
            return None
        shown = "; ".join(f"line {n}: {why}" for n, why in self.bad_lines[:3])
        more = f"; and {len(self.bad_lines) - 3} more" if len(self.bad_lines) > 3 else ""
        where = self.path or GOODPUT_FILE
        return f"{where}: {len(self.bad_lines)} unreadable record(s) skipped ({shown}{more})"


@dataclass(frozen=True)
class SessionSummary:
    """One process (or in-process attempt) of the job."""

    session: str
    started: float
    ended: float
    end_reason: str | None  # None: no end record (killed, or still running)
    restart_count: int
    attempt: int
    resumed_at: int | None
    last_iteration: int | None
    startup_s: float  # its own start -> first step (counted as startup or restart)
    downtime_before_s: float  # the gap before it (restart/hang), written by this session

    def to_json(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        for key in ("started", "ended", "startup_s", "downtime_before_s"):
            out[key] = round(out[key], 3)
        return out


@dataclass(frozen=True)
class GoodputSummary:
    """Seconds per bucket over the counted wall time; ``goodput`` = productive / wall."""

    seconds: Mapping[Bucket, float]
    sessions: list[SessionSummary]
    faults: list[Marker]
    notes: list[str]
    first: float | None = None
    last: float | None = None
    excluded_s: float = 0.0  # between a finished job and its relaunch, not counted
    # The compile bucket by source ("cold", "warm", "capture", "save", "unattributed"): seconds.
    compile_sources: Mapping[str, float] = field(default_factory=dict)
    actions: list[Marker] = field(default_factory=list)  # ``stalwart launch``'s, in order

    @property
    def wall_s(self) -> float:
        return sum(self.seconds.values())

    @property
    def goodput(self) -> float:
        wall = self.wall_s
        return self.seconds[Bucket.PRODUCTIVE] / wall if wall > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        wall = self.wall_s
        return {
            "goodput": round(self.goodput, 6),
            "wall_s": round(wall, 3),
            "seconds": {b.value: round(s, 3) for b, s in self.seconds.items()},
            "percent": {
                b.value: round(100.0 * s / wall, 3) if wall > 0 else 0.0
                for b, s in self.seconds.items()
            },
            "excluded_s": round(self.excluded_s, 3),
            "compile_sources": {k: round(v, 3) for k, v in self.compile_sources.items()},
            "first": self.first,
            "last": self.last,
            "sessions": [s.to_json() for s in self.sessions],
            "faults": [f.to_json() for f in self.faults],
            "actions": [a.to_json() for a in self.actions],
            "notes": list(self.notes),
        }


def empty_seconds() -> dict[Bucket, float]:
    return dict.fromkeys(Bucket, 0.0)


def add_span(seconds: dict[Bucket, float], span: Span) -> None:
    """The one place a span becomes bucket seconds (the live ledger and the reader share it)."""
    idle = span.idle if span.bucket is Bucket.PRODUCTIVE else 0.0
    seconds[span.bucket] += span.seconds - idle
    seconds[Bucket.STRAGGLER] += idle


def summarize(ledger: LedgerFile | Iterable[Record]) -> GoodputSummary:
    """Sum a ledger's spans per bucket and per session; notes say what could not be accounted."""
    file = ledger if isinstance(ledger, LedgerFile) else LedgerFile(list(ledger), exists=True)
    spans = [r for r in file.records if isinstance(r, Span)]
    markers = [r for r in file.records if isinstance(r, Marker)]
    seconds = empty_seconds()
    for span in spans:
        add_span(seconds, span)
    notes = _read_notes(file)
    sessions = _sessions(file.records)
    if sessions and sessions[-1].end_reason is None:
        last = sessions[-1]
        notes.append(
            f"the last session ({last.session}) has no end record: it was killed or is still "
            f"running; time after its last record ({_clock(last.ended)}) is not accounted "
            "(at most one flush interval of work)"
        )
    first = min((s.t0 for s in spans), default=None)
    last_t = max((s.t1 for s in spans), default=None)
    union = _union_seconds(spans)
    covered = (last_t - first) if first is not None and last_t is not None else 0.0
    total = sum(seconds.values())
    if total > union * 1.01 + 1e-3:
        notes.append(
            f"spans overlap by {total - union:.1f} s (two writers, or the clock stepped back)"
        )
    faults = [m for m in markers if m.kind is RecordKind.FAULT]
    actions = [m for m in markers if m.kind is RecordKind.ACTION]
    return GoodputSummary(
        seconds,
        sessions,
        faults,
        notes,
        first,
        last_t,
        max(covered - union, 0.0),
        compile_sources(spans),
        actions=actions,
    )


def compile_sources(spans: Iterable[Span]) -> dict[str, float]:
    """The ``compile`` bucket's seconds by where they went (cold compile, warm cache load, ...)."""
    out: dict[str, float] = {}
    for span in spans:
        if span.bucket is Bucket.COMPILE:
            key = span.source.value if span.source is not None else UNATTRIBUTED
            out[key] = out.get(key, 0.0) + span.seconds
    return out


def compile_line(summary: GoodputSummary) -> str | None:
    """``compile: cold compile 38.0s, cache write 0.1s`` (None without compile time)."""
    parts = []
    for key, secs in sorted(summary.compile_sources.items(), key=lambda item: -item[1]):
        label = CompileSource(key).label if key != UNATTRIBUTED else UNATTRIBUTED
        parts.append(f"{label} {format_duration(secs)}")
    return "compile: " + ", ".join(parts) if parts else None


def _read_notes(file: LedgerFile) -> list[str]:
    notes = []
    skipped = file.skipped_note()
    if skipped:
        notes.append(skipped)
    if file.torn_tail:
        notes.append("the last record was torn (the writer was killed mid-write) and is skipped")
    return notes


def _union_seconds(spans: list[Span]) -> float:
    total, end = 0.0, -math.inf
    for span in sorted(spans, key=lambda s: s.t0):
        start = max(span.t0, end)
        if span.t1 > start:
            total += span.t1 - start
            end = span.t1
    return total


def _sessions(records: list[Record]) -> list[SessionSummary]:
    """Per-session facts; records without a session record before them are ignored here."""
    order: list[str] = []
    facts: dict[str, dict[str, Any]] = {}
    for record in records:
        sid = record.session
        if isinstance(record, Marker) and record.kind is RecordKind.SESSION:
            order.append(sid)
            facts[sid] = _new_session(record)
            continue
        info = facts.get(sid)
        if info is not None:
            _fold(info, record)
    return [SessionSummary(session=sid, **facts[sid]) for sid in order]


def _new_session(record: Marker) -> dict[str, Any]:
    return {
        "started": record.t,
        "ended": record.t,
        "end_reason": None,
        "restart_count": json_count(record.get("restart_count")) or 0,
        "attempt": json_count(record.get("attempt")) or 0,
        "resumed_at": None,
        "last_iteration": None,
        "startup_s": 0.0,
        "downtime_before_s": 0.0,
    }


def _fold(info: dict[str, Any], record: Record) -> None:
    if isinstance(record, Span):
        info["ended"] = max(info["ended"], record.t1)
        if record.gap:
            info["downtime_before_s"] += record.seconds
            return
        info["started"] = min(info["started"], record.t0)
        if record.bucket in (Bucket.STARTUP, Bucket.RESTART) and info["last_iteration"] is None:
            info["startup_s"] += record.seconds
        if record.iteration is not None:
            info["last_iteration"] = record.iteration
    elif record.kind is RecordKind.RESUME:
        info["resumed_at"] = json_count(record.get("it"))
    elif record.kind is RecordKind.END:
        info["end_reason"] = str(record.get("reason") or "unknown")
        info["ended"] = max(info["ended"], record.t)


# ------------------------------------------------------------------------------ text forms


def format_duration(seconds: float) -> str:
    """``0.4s``, ``42s``, ``2m10s``, ``1h02m`` (the exit line's units)."""
    s = max(seconds, 0.0)
    if s < 10:
        return f"{s:.1f}s"
    if s < 60:
        return f"{s:.0f}s"
    if s < 3600:
        m, r = divmod(round(s), 60)
        return f"{m}m{r:02d}s"
    h, r = divmod(round(s / 60), 60)
    return f"{h}h{r:02d}m"


def goodput_line(summary: GoodputSummary) -> str:
    """``goodput: 93.1% (productive 1h02m of 1h07m; lost: restart 2m10s, lost work 1m05s)``."""
    seconds, wall = summary.seconds, summary.wall_s
    text = (
        f"goodput: {100.0 * summary.goodput:.1f}% (productive "
        f"{format_duration(seconds[Bucket.PRODUCTIVE])} of {format_duration(wall)}"
    )
    lost = sorted(
        ((b, s) for b, s in seconds.items() if b is not Bucket.PRODUCTIVE and s >= 0.05),
        key=lambda item: -item[1],
    )
    if lost:
        text += "; lost: " + ", ".join(f"{b.label} {format_duration(s)}" for b, s in lost)
    return text + ")"


def format_table(summary: GoodputSummary) -> str:
    """The ``stalwart goodput`` table: buckets, then sessions, then notes."""
    wall = summary.wall_s
    lines = [goodput_line(summary), "", f"{'bucket':<16}{'seconds':>12}{'share':>9}"]
    for bucket, secs in summary.seconds.items():
        share = 100.0 * secs / wall if wall > 0 else 0.0
        lines.append(f"{bucket.label:<16}{secs:>12.1f}{share:>8.1f}%")
    lines.append(f"{'total':<16}{wall:>12.1f}{100.0 if wall else 0.0:>8.1f}%")
    compiles = compile_line(summary)
    if compiles is not None:
        lines.append(compiles)
    if summary.excluded_s > 0.05:
        lines.append(
            f"(not counted: {summary.excluded_s:.1f} s between a finished job and a relaunch)"
        )
    if summary.sessions:
        lines += [
            "",
            "session  start                torchrun restart  attempt  resumed  "
            "last it  downtime before  startup  end",
        ]
        for i, s in enumerate(summary.sessions):
            lines.append(
                f"{i:<9}{_clock(s.started):<21}{s.restart_count:<18}{s.attempt:<9}"
                f"{_dash(s.resumed_at):<9}{_dash(s.last_iteration):<9}"
                f"{format_duration(s.downtime_before_s):<17}{format_duration(s.startup_s):<9}"
                f"{s.end_reason or 'no end record'}"
            )
    if summary.actions:
        lines += ["", "stalwart launch actions"]
        lines += [
            f"{_clock(a.t):<21}{a.get('action', '?'):<11}{a.get('detail', '')}"
            for a in summary.actions
        ]
    lines += [f"note: {n}" for n in summary.notes]
    return "\n".join(lines)


def _dash(value: int | None) -> str:
    return "-" if value is None else str(value)


def _clock(t: float) -> str:
    import time

    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
