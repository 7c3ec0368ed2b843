"""The goodput ledger's reader: the one place a line of ``goodput.jsonl`` becomes a record.

Every check of a record is here, so every use (the live ledger's constructor, ``stalwart
goodput``, ``stalwart report``, the chaos campaign) meets only records that are in range: a line
that is not JSON, not a record of a known kind, of the wrong type, non-finite, out of range
(before the epoch, after the reader's clock plus :data:`FUTURE_SLACK_S`: ``1e308`` is not a
time) or out of order (a span overlapping another span of its session, a marker before its
session started) is skipped and listed in :attr:`LedgerFile.bad_lines` by line number and reason.
The reader never raises for bad content. Standard library only.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import time
from collections.abc import Iterator
from typing import Any

from stalwart.observability.goodput.records import (
    MAX_LINE_BYTES,
    MAX_SPAN_S,
    Bucket,
    CompileSource,
    LedgerFile,
    Marker,
    Record,
    RecordKind,
    Span,
    json_count,
)
from stalwart.regular_file import open_regular

__all__ = ["FUTURE_SLACK_S", "parse_record", "read_ledger"]

# A record later than the reader's clock by more than this is out of range: the clocks of one
# job's hosts agree to well under a second (NTP); a far-future time would move every later
# session's start past its own records and lose them.
FUTURE_SLACK_S = 60.0
ORDER_SLACK_S = 1e-3  # records are rounded to microseconds
_MARKER_FIELDS = {
    RecordKind.SESSION: ("launcher_start", "pid", "host", "restart_count", "attempt", "flush_s"),
    RecordKind.FAULT: ("cause", "since", "detail", "rank"),
    RecordKind.RESUME: ("it",),
    RecordKind.END: ("reason", "detail", "it"),
    RecordKind.ACTION: ("action", "detail", "exit_code", "world_size", "devices"),
}


class _Invalid(Exception):
    """Why one line is not a record (becomes a ``bad_lines`` entry, never escapes)."""


def _time(obj: dict[str, Any], key: str, ceiling: float) -> float:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _Invalid(f"{key!r} is not a number")
    try:
        number = float(value)
    except OverflowError:  # an integer beyond a float's range
        raise _Invalid(f"{key!r} is out of range") from None
    if not math.isfinite(number):
        raise _Invalid(f"{key!r} is not finite")
    if not 0.0 <= number <= ceiling:
        raise _Invalid(f"{key!r} = {number:.6g} is out of range (0 to the reader's clock)")
    return number


def _clean(value: Any) -> Any:
    """Only short strings, finite numbers and counts survive into a marker's fields."""
    if isinstance(value, str):
        return value[:512]
    if isinstance(value, int) and not isinstance(value, bool):
        return json_count(value)
    if isinstance(value, float) and math.isfinite(value):
        return value
    return None


def _parse(obj: Any, ceiling: float) -> Record:
    if not isinstance(obj, dict):
        raise _Invalid("not a JSON object")
    try:
        kind = RecordKind(obj.get("k"))
    except ValueError:
        raise _Invalid("not a record kind") from None
    raw_session = obj.get("s", "")
    session = raw_session[:128] if isinstance(raw_session, str) else ""
    if kind is RecordKind.SPAN:
        return _parse_span(obj, session, ceiling)
    t = _time(obj, "t", ceiling)
    allowed = _MARKER_FIELDS[kind]
    fields = {k: _clean(obj[k]) for k in allowed if k in obj and _clean(obj[k]) is not None}
    return Marker(kind, t, session, fields)


def _parse_span(obj: dict[str, Any], session: str, ceiling: float) -> Span:
    try:
        bucket = Bucket(obj.get("b"))
    except ValueError:
        raise _Invalid("not a bucket") from None
    t0, t1 = _time(obj, "t0", ceiling), _time(obj, "t1", ceiling)
    if not 0.0 <= t1 - t0 <= MAX_SPAN_S:
        raise _Invalid("'t1' before 't0', or a span longer than 3 years")
    iteration = obj.get("it")
    if iteration is not None and json_count(iteration) is None:
        raise _Invalid("'it' is not an iteration count")
    idle = obj.get("idle", 0.0)
    if isinstance(idle, bool) or not isinstance(idle, (int, float)) or not idle >= 0.0:
        raise _Invalid("'idle' is not a duration")
    if not idle <= t1 - t0 + 1e-6:  # NaN fails here too
        raise _Invalid("'idle' is longer than its span")
    gap = obj.get("gap") is True
    return Span(bucket, t0, t1, session, iteration, float(idle), gap, _source(obj.get("src")))


def _source(value: Any) -> CompileSource | None:
    """A span's ``src`` (an unknown value reads as none: the seconds still count)."""
    try:
        return CompileSource(value) if isinstance(value, str) else None
    except ValueError:
        return None


def parse_record(obj: Any, now: float | None = None) -> Record | None:
    """One decoded JSON value -> a record, or None when it is not a valid one (never raises).

    ``now``: the reader's clock (default ``time.time()``); times after it by more than
    :data:`FUTURE_SLACK_S` are out of range."""
    ceiling = (time.time() if now is None else now) + FUTURE_SLACK_S
    try:
        return _parse(obj, ceiling)
    except _Invalid:
        return None


class _Order:
    """Per session: its start, and its spans so far, sorted (one writer's spans never overlap;
    they need not be written in time order: a step's held intervals come after a flush)."""

    def __init__(self) -> None:
        self.started: dict[str, float] = {}
        self.spans: dict[str, tuple[list[float], list[float]]] = {}

    def check(self, record: Record) -> None:
        sid = record.session
        if isinstance(record, Span):
            starts, ends = self.spans.setdefault(sid, ([], []))
            i = bisect.bisect_right(starts, record.t0)
            if (i > 0 and ends[i - 1] > record.t0 + ORDER_SLACK_S) or (
                i < len(starts) and starts[i] < record.t1 - ORDER_SLACK_S
            ):
                raise _Invalid("out of order: the span overlaps another span of its session")
            starts.insert(i, record.t0)
            ends.insert(i, record.t1)
            return
        if record.kind is RecordKind.SESSION:
            if sid in self.started:
                raise _Invalid("out of order: a second start of the same session")
            self.started[sid] = record.t
        elif record.t < self.started.get(sid, -math.inf) - ORDER_SLACK_S:
            raise _Invalid("out of order: before its session started")


def read_ledger(path: str | os.PathLike[str], now: float | None = None) -> LedgerFile:
    """Read a ledger file (missing file: empty result). Never raises for bad content.

    ``now``: the reader's clock, the upper bound of a record's times (default ``time.time()``;
    the live ledger passes its own clock)."""
    out = LedgerFile(path=str(path))
    try:
        f = open_regular(path)  # closed below; a directory, a FIFO or a device raises here
    except OSError:
        return out
    out.exists = True
    ceiling = (time.time() if now is None else now) + FUTURE_SLACK_S
    order = _Order()
    with f:
        for number, raw in enumerate(_lines(f), start=1):
            if not raw.endswith(b"\n"):
                out.torn_tail = raw.strip() != b""
                continue
            if not raw.strip():
                continue
            try:
                record = _decode(raw, ceiling)
                order.check(record)
            except _Invalid as exc:
                out.bad_lines.append((number, str(exc)))
                continue
            out.records.append(record)
    return out


def _lines(f: Any) -> Iterator[bytes]:
    """Lines of a binary file; an over-long line is yielded as one undecodable marker."""
    while True:
        line = f.readline(MAX_LINE_BYTES + 1)
        if not line:
            return
        if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
            while line and not line.endswith(b"\n"):
                line = f.readline(MAX_LINE_BYTES + 1)
            yield b"\x00\n"  # counted as one unreadable line
            continue
        yield line


def _decode(raw: bytes, ceiling: float) -> Record:
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise _Invalid("not JSON (or longer than 64 KiB)") from None
    return _parse(obj, ceiling)
