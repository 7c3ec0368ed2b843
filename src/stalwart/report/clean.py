"""Make a run directory's artefacts safe to render: the report reads files that a crash, a disk
error or a hostile user may have written, so every record is checked against the shape the
renderer expects; what does not fit is dropped and counted in one note per file (never a
traceback). Plain JSON only: nothing read here can run code.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from stalwart.regular_file import open_regular

MAX_FILE_BYTES = 1 << 30


def is_number(value: Any) -> bool:
    """A finite int/float (bools are not numbers here)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def read_jsonl(path: Path, notes: list[str]) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines file; unreadable lines (torn tail, binary, not an object)
    are skipped and counted in one note."""
    rows: list[dict[str, Any]] = []
    bad = 0
    try:
        with open_regular(path) as f:
            data = f.read(MAX_FILE_BYTES)
    except OSError as exc:
        notes.append(f"{path.name}: unreadable ({exc.strerror or exc})")
        return rows
    for raw in data.split(b"\n"):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError):  # a torn last line after a crash is normal
            bad += 1
            continue
        if isinstance(obj, dict):
            rows.append(obj)
        else:
            bad += 1
    if bad:
        notes.append(f"{path.name}: skipped {bad} unreadable line(s)")
    return rows


def read_json(path: Path, notes: list[str]) -> dict[str, Any] | None:
    """A JSON object file, or None with a note (unreadable, binary, not an object)."""
    try:
        with open_regular(path) as f:
            obj = json.loads(f.read(MAX_FILE_BYTES))
    except (OSError, ValueError, RecursionError) as exc:
        notes.append(f"{path.name}: unreadable ({type(exc).__name__}), section skipped")
        return None
    if not isinstance(obj, dict):
        notes.append(f"{path.name}: holds a JSON {type(obj).__name__}, not an object; skipped")
        return None
    return obj


def _note_dropped(notes: list[str], name: str, dropped: int, why: str) -> None:
    if dropped:
        notes.append(f"{name}: skipped {dropped} record(s) {why}")


def clean_metrics(rows: list[dict[str, Any]], name: str, notes: list[str]) -> list[dict[str, Any]]:
    """Rows with a numeric ``iteration``; values other than numbers (and the ``split`` label)
    are dropped from each row, so every chart can treat a present key as a number."""
    out, dropped = [], 0
    for row in rows:
        if not is_number(row.get("iteration")):
            dropped += 1
            continue
        clean = {k: v for k, v in row.items() if is_number(v)}
        if isinstance(row.get("split"), str):
            clean["split"] = row["split"]
        out.append(clean)
    _note_dropped(notes, name, dropped, "without a numeric iteration")
    return out


def clean_events(rows: list[dict[str, Any]], name: str, notes: list[str]) -> list[dict[str, Any]]:
    out, dropped = [], 0
    for row in rows:
        if not (is_number(row.get("iteration")) and isinstance(row.get("kind"), str)):
            dropped += 1
            continue
        event = {
            "iteration": row["iteration"],
            "kind": row["kind"],
            "detail": str(row.get("detail", "")),
        }
        if is_number(row.get("time")):
            event["time"] = row["time"]
        out.append(event)
    _note_dropped(notes, name, dropped, "without a numeric iteration and a kind")
    return out


def _pairs(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(p, list) and len(p) == 2 and isinstance(p[0], int) and is_number(p[1])
        for p in value
    )


def _straggler_ok(row: dict[str, Any]) -> bool:
    times = row.get("compute_ms")
    return (
        is_number(row.get("iteration"))
        and isinstance(times, list)
        and bool(times)
        and all(is_number(t) for t in times)
        and all(
            is_number(row[k]) for k in ("min_ms", "median_ms", "max_ms", "threshold") if k in row
        )
        and isinstance(row.get("stragglers", []), list)
        and all(isinstance(r, int) and not isinstance(r, bool) for r in row.get("stragglers", []))
        and _pairs(row.get("slowest", []))
    )


def clean_straggler(
    rows: list[dict[str, Any]], name: str, notes: list[str]
) -> list[dict[str, Any]]:
    out = [row for row in rows if _straggler_ok(row)]
    _note_dropped(notes, name, len(rows) - len(out), "that are not straggler reports")
    return out


def _numbers(value: Any) -> dict[str, Any]:
    return {k: v for k, v in value.items() if is_number(v)} if isinstance(value, dict) else {}


def clean_memory(
    record: dict[str, Any] | None, name: str, notes: list[str]
) -> dict[str, Any] | None:
    """Only the numeric fields the memory section uses (and ``measured_source`` as text)."""
    if record is None:
        return None
    theoretical = _numbers(record.get("theoretical"))
    breakdown = (
        (record.get("theoretical") or {}) if isinstance(record.get("theoretical"), dict) else {}
    )
    theoretical["breakdown"] = _numbers(breakdown.get("breakdown"))
    clean: dict[str, Any] = {
        "theoretical": theoretical,
        "measured": _numbers(record.get("measured")),
    }
    for key in ("measured_peak_bytes", "theoretical_over_measured", "iteration"):
        if is_number(record.get(key)):
            clean[key] = float(record[key]) if key == "theoretical_over_measured" else record[key]
    clean["measured_source"] = str(record.get("measured_source", "?"))
    if not theoretical.get("total_bytes") and not clean["measured"]:
        notes.append(f"{name}: no numeric memory figures; section skipped")
        return None
    return clean


def clean_chaos(record: dict[str, Any] | None) -> dict[str, Any] | None:
    if record is None:
        return None
    faults = record.get("faults")
    return {
        "passed": record.get("passed") is True,
        "faults": [f for f in faults if isinstance(f, dict)] if isinstance(faults, list) else [],
    }
