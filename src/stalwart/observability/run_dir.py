"""A run directory's vocabulary: artefact file names, event kinds, metric keys.

Shared by the writers (the trainer appends events) and the readers (``report`` loads, and
``report_html`` renders), so neither reader imports the other.
"""

from __future__ import annotations

import enum
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stalwart.observability.sinks import append_line

EVENTS_FILE = "events.jsonl"
REPORT_FILE = "report.html"
PNG_DIR = "report"
LOSS_KEYS = ("lm loss", "loss")
LR_KEYS = ("lr", "learning-rate")
THROUGHPUT_KEYS = ("throughput_tflops_per_gpu", "throughput", "tokens_per_s")


class EventKind(str, enum.Enum):  # noqa: UP042 (StrEnum needs Python 3.11)
    """Kinds of run events shown on the report's timeline."""

    SKIPPED = "skipped"
    NAN = "nan"
    RERUN = "rerun"
    RESTART = "restart"
    EXIT = "exit"
    CHECKPOINT = "checkpoint"


def append_event(
    run_dir: str | os.PathLike[str],
    iteration: int,
    kind: EventKind | str,
    detail: str = "",
    when: float | None = None,
) -> dict[str, Any]:
    """Append one event line to ``<run_dir>/events.jsonl`` and return it.

    ``kind`` must be an `EventKind` value; ``detail`` is free text. Call from one rank only
    (usually rank 0): lines are appended with a single ``write`` each.
    """
    try:
        kind_value = EventKind(kind).value
    except ValueError:
        allowed = ", ".join(k.value for k in EventKind)
        raise ValueError(f"event kind must be one of {allowed}, got {kind!r}") from None
    record = {
        "time": time.time() if when is None else when,
        "iteration": int(iteration),
        "kind": kind_value,
        "detail": detail,
    }
    path = Path(run_dir)
    path.mkdir(parents=True, exist_ok=True)
    append_line(path / EVENTS_FILE, json.dumps(record))
    return record


@dataclass
class RunArtefacts:
    """Everything the report shows; fields are empty/None when the artefact was missing."""

    run_dir: Path
    metrics: list[dict[str, Any]] = field(default_factory=list)
    straggler: list[dict[str, Any]] = field(default_factory=list)
    memory: dict[str, Any] | None = None
    exit_reason: dict[str, Any] | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    chaos: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)


def series(rows: list[dict[str, Any]], *keys: str) -> list[tuple[float, float]]:
    """``(iteration, value)`` for the first of ``keys`` present and numeric in each row."""
    out: list[tuple[float, float]] = []
    for row in rows:
        for key in keys:
            value = row.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                out.append((float(row["iteration"]), float(value)))
                break
    return out


NOT_TIMERS = frozenset({"iteration-time-ms", "interval-time-time-ms"})


def timer_label(key: str) -> str:
    """``timer/forward`` or ``forward-time-ms`` → ``forward``."""
    return key[len("timer/") :] if key.startswith("timer/") else key[: -len("-time-ms")]


def timer_names(rows: list[dict[str, Any]]) -> list[str]:
    """Per-region timer keys (``timer/<name>`` or TrainingLog's ``<name>-time-ms``), first seen first.

    The whole-iteration timers are left out: they are the sum, not a part of the breakdown.
    """
    seen: dict[str, None] = {}
    for row in rows:
        for key in row:
            is_timer = key.startswith("timer/") or key.endswith("-time-ms")
            if is_timer and key not in NOT_TIMERS:
                seen.setdefault(key, None)
    return list(seen)
