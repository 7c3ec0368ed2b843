"""What each recovery from a fault cost, read from the goodput ledger: detection, teardown,
restart, recompile and lost work, per fault.

A *recovery* joins two consecutive sessions of one job segment: the session that stopped without
finishing (a fault, a kill, a signal) and the session that came back. Its seconds come from the
ledger's own buckets (docs/goodput.md), split by where they were written:

* ``detection``: ``hang`` seconds, from the last progress to the watchdog's detection (the hung
  step's, or the gap's before the next session);
* ``teardown``: ``restart`` seconds from the fault to the next process's start: what the faulted
  session wrote after its failure (the escalation, its exit) and the gap until the next session
  started (the launcher's restart, torchrun's rendezvous);
* ``restart``: the new session's own ``restart`` seconds, from its process start to its first
  step (imports, distributed init, building the model, loading the checkpoint);
* ``recompile``: the new session's ``compile`` seconds before its first productive step (a
  warm or cold compile, a CUDA-graph capture);
* ``lost work``: ``lost_work`` seconds: the failed step (a ``lost_work`` span of the faulted
  session that completed no iteration) and the iterations the new session computed again.

Its *kind* is the cause of a ``fault`` record between the two sessions' starts (``hang``, from the
watchdog or the trainer), else the faulted session's end reason (``fault`` reads ``exception``;
``signal``, ``rerun``, ...), else ``killed`` (no end record: SIGKILL, a lost node). A relaunch
after a ``finished`` session is a new job segment, not a recovery.

Standard library only, like the rest of the ledger. Example (a fake clock: a job killed after
three steps, relaunched five seconds later)::

    >>> import tempfile
    >>> from stalwart.observability.goodput import GoodputLedger
    >>> from stalwart.observability.goodput.reader import read_ledger
    >>> now = [1_000_000.0]
    >>> def ledger(run_dir):
    ...     return GoodputLedger(run_dir, clock=lambda: now[0], launcher_start=now[0],
    ...                          print_fn=lambda line: None, flush_interval_s=0.5)
    >>> run_dir = tempfile.mkdtemp()
    >>> first = ledger(run_dir)
    >>> for it in (1, 2, 3):
    ...     with first.step(it):
    ...         now[0] += 1.0
    >>> del first                           # SIGKILL: no end record
    >>> now[0] += 5.0
    >>> second = ledger(run_dir)
    >>> now[0] += 2.0                       # start-up: imports, load
    >>> second.resumed(2)
    >>> with second.step(3):                # iteration 3 again: lost work
    ...     now[0] += 1.0
    >>> _ = second.close()
    >>> [(r.kind, r.teardown_s, r.restart_s, r.lost_work_s) for r in recoveries(read_ledger(
    ...     f"{run_dir}/goodput.jsonl"))]
    [('killed', 5.0, 2.0, 1.0)]
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from stalwart.observability.goodput.records import (
    FINISHED,
    Bucket,
    LedgerFile,
    Marker,
    Record,
    RecordKind,
    Span,
)
from stalwart.observability.goodput.session import ITERATION_BUCKETS

__all__ = ["COMPONENTS", "PLANNED_STOPS", "Recovery", "recoveries"]

# The parts of one recovery, in the order they happen.
COMPONENTS = ("detection", "teardown", "restart", "recompile", "lost work")
# End reasons that are the operator's or the scheduler's stop, not a failure: their relaunch
# costs the same kinds of seconds, but a failure model's MTTF does not count them.
PLANNED_STOPS = frozenset({"signal", "interrupt", "duration", "interval", "phase"})


@dataclass(frozen=True)
class Recovery:
    """One recovery: the fault's kind, when the faulted session started, the session that came
    back, and its seconds by component."""

    kind: str
    faulted_session: str
    session: str
    detection_s: float = 0.0
    teardown_s: float = 0.0
    restart_s: float = 0.0
    recompile_s: float = 0.0
    lost_work_s: float = 0.0

    @property
    def planned(self) -> bool:
        """A planned stop (SIGTERM, ``--exit-duration-in-mins``, ...), not a failure."""
        return self.kind in PLANNED_STOPS

    def seconds(self) -> dict[str, float]:
        """Seconds by component (the keys of :data:`COMPONENTS`)."""
        return {
            "detection": self.detection_s,
            "teardown": self.teardown_s,
            "restart": self.restart_s,
            "recompile": self.recompile_s,
            "lost work": self.lost_work_s,
        }

    @property
    def total_s(self) -> float:
        return sum(self.seconds().values())


@dataclass
class _Session:
    """One session's records, and its seconds split into the recovery that led into it
    (``into``) and the one its own failure starts (``out_of``)."""

    sid: str
    started: float
    end_reason: str | None = None
    spans: list[Span] = field(default_factory=list)
    resumed_at: int | None = None
    into: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COMPONENTS, 0.0))
    out_of: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COMPONENTS, 0.0))

    def split(self) -> None:
        """Book each span to the recovery it belongs to (see the module docstring)."""
        spans = sorted(self.spans, key=lambda s: s.t0)
        first_step = min((s.t0 for s in spans if s.bucket in ITERATION_BUCKETS), default=None)
        first_productive = min(
            (s.t0 for s in spans if s.bucket is Bucket.PRODUCTIVE), default=float("inf")
        )
        done = self.resumed_at
        for span in spans:
            self._book(span, first_step, first_productive, done)
            if span.bucket in ITERATION_BUCKETS and span.iteration is not None:
                done = span.iteration if done is None else max(done, span.iteration)

    def _book(
        self, span: Span, first_step: float | None, first_productive: float, done: int | None
    ) -> None:
        seconds, bucket = span.seconds, span.bucket
        if span.gap:  # the downtime before this session, written by it
            key = "detection" if bucket is Bucket.HANG else "teardown"
            self.into[key] += seconds
        elif bucket is Bucket.HANG:  # the hung step, until the watchdog detected it
            self.out_of["detection"] += seconds
        elif bucket is Bucket.RESTART:
            before_first_step = first_step is None or span.t0 < first_step
            if before_first_step:
                self.into["restart"] += seconds
            else:
                self.out_of["teardown"] += seconds
        elif bucket is Bucket.COMPILE and span.t0 < first_productive:
            self.into["recompile"] += seconds
        elif bucket is Bucket.LOST_WORK:
            advanced = span.iteration is not None and (done is None or span.iteration > done)
            (self.into if advanced else self.out_of)["lost work"] += seconds


def _sessions(records: list[Record]) -> list[_Session]:
    sessions: dict[str, _Session] = {}
    for record in records:
        if isinstance(record, Marker) and record.kind is RecordKind.SESSION:
            sessions.setdefault(record.session, _Session(record.session, record.t))
            continue
        session = sessions.get(record.session)
        if session is None:
            continue  # a watchdog's or the launcher's record, or one before its session record
        if isinstance(record, Span):
            session.spans.append(record)
        elif record.kind is RecordKind.END:
            session.end_reason = str(record.get("reason") or "unknown")
        elif record.kind is RecordKind.RESUME and isinstance(record.get("it"), int):
            session.resumed_at = record.get("it")
    ordered = sorted(sessions.values(), key=lambda s: s.started)
    for session in ordered:
        session.split()
    return ordered


def _kind(faulted: _Session, returned: _Session, faults: list[Marker]) -> str:
    causes = [
        str(m.get("cause") or "fault") for m in faults if faulted.started <= m.t <= returned.started
    ]
    if causes:
        return causes[0]
    if faulted.end_reason is None:
        return "killed"
    return "exception" if faulted.end_reason == "fault" else faulted.end_reason


def recoveries(file: LedgerFile) -> list[Recovery]:
    """Every recovery in a ledger, in order (empty: no session came back after a fault)."""
    sessions = _sessions(file.records)
    faults = sorted(
        (r for r in file.records if isinstance(r, Marker) and r.kind is RecordKind.FAULT),
        key=lambda m: m.t,
    )
    out = []
    for faulted, returned in itertools.pairwise(sessions):
        if faulted.end_reason == FINISHED:
            continue  # a relaunch after a finished job: a new segment
        part = {k: faulted.out_of[k] + returned.into[k] for k in COMPONENTS}
        out.append(
            Recovery(
                kind=_kind(faulted, returned, faults),
                faulted_session=faulted.sid,
                session=returned.sid,
                detection_s=part["detection"],
                teardown_s=part["teardown"],
                restart_s=part["restart"],
                recompile_s=part["recompile"],
                lost_work_s=part["lost work"],
            )
        )
    return out
