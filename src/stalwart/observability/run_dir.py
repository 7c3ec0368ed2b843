"""The run directory convention: where a run's artefacts live, and a manifest that says so.

One directory holds everything ``stalwart report`` reads: by default the checkpoint directory
(``--save``), or ``--run-dir`` when given. Artefacts written elsewhere on purpose (``--metrics-file
/elsewhere/m.jsonl``) are recorded in ``<run dir>/run.json``, so the report of the run directory
is still complete::

    paths = RunPaths.for_run("runs/demo", metrics_file=None)   # metrics -> runs/demo/metrics.jsonl
    paths.write_manifest()                                     # rank 0, once at start-up
    ...
    found = RunPaths.discover("runs/demo")                     # what `stalwart report` does
    found.metrics                                              # the path the run wrote

Layout (file names are fixed; each artefact is optional):

* ``metrics.jsonl`` — training and validation records (`stalwart.observability.train_log`)
* ``metrics.iterations.jsonl`` — one row per iteration beside the metrics file, whatever its
  name (`iterations_path`; `stalwart.observability.iteration_log`)
* ``events.jsonl`` — skipped/NaN iterations, reruns, restarts, checkpoints, exits (`report`)
* ``straggler.jsonl``, ``memory.json``, ``exit_reason.json``, ``chaos.json``
* ``run.json`` — this manifest: ``{"version": 1, "metrics": "<path>", "config": {...}}`` (the
  trainer writes it at start-up, with its settings)
* ``report.html`` and ``report/*.png`` — written by ``stalwart report``

The manifest is read as data only (JSON; unknown keys ignored; a path that is not a string is
ignored), never executed.
"""

from __future__ import annotations

import enum
import json
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stalwart.atomic_file import Sync, write_text_atomic
from stalwart.fixed_paths import FixedPath
from stalwart.observability.sinks import append_line
from stalwart.regular_file import open_regular

MANIFEST_FILE = "run.json"
METRICS_FILE = "metrics.jsonl"
EVENTS_FILE = "events.jsonl"
STRAGGLER_FILE = "straggler.jsonl"
MEMORY_FILE = "memory.json"
EXIT_REASON_FILE = "exit_reason.json"
CHAOS_FILE = "chaos.json"
REPORT_FILE = "report.html"
# Every iteration's row (`stalwart.observability.iteration_log`) beside the metrics file.
ITERATIONS_SUFFIX = ".iterations.jsonl"
PNG_DIR = "report"
_MANIFEST_VERSION = 1


def iterations_path(metrics: str | os.PathLike[str]) -> Path:
    """The per-iteration rows beside a metrics file: ``metrics.jsonl`` ->
    ``metrics.iterations.jsonl`` (``m`` -> ``m.iterations.jsonl``)."""
    path = Path(metrics)
    return path.with_name(path.name.removesuffix(".jsonl") + ITERATIONS_SUFFIX)


def run_dir_for(save: str | None, run_dir: str | None = None) -> str | None:
    """The convention: ``--run-dir`` if given, else ``--save``, else no run directory."""
    return run_dir or save


@dataclass(frozen=True)
class RunPaths:
    """Artefact paths of one run directory (see the module docstring for the layout)."""

    root: Path
    metrics: Path

    # The artefacts of fixed names (not fields: derived from ``root``).
    events = FixedPath("root", EVENTS_FILE)
    straggler = FixedPath("root", STRAGGLER_FILE)
    memory = FixedPath("root", MEMORY_FILE)
    exit_reason = FixedPath("root", EXIT_REASON_FILE)
    chaos = FixedPath("root", CHAOS_FILE)
    report = FixedPath("root", REPORT_FILE)
    manifest = FixedPath("root", MANIFEST_FILE)

    @classmethod
    def for_run(
        cls, root: str | os.PathLike[str], metrics_file: str | os.PathLike[str] | None = None
    ) -> RunPaths:
        """Paths for a run writing into ``root``; ``metrics_file`` overrides the metrics path."""
        base = Path(root)
        return cls(base, Path(metrics_file) if metrics_file else base / METRICS_FILE)

    @classmethod
    def discover(cls, root: str | os.PathLike[str]) -> RunPaths:
        """Paths of an existing run directory: the manifest's metrics path when it names a file
        that exists, else ``<root>/metrics.jsonl``."""
        base = Path(root)
        default = cls.for_run(base)
        recorded = read_manifest(base).get("metrics")
        if isinstance(recorded, str) and recorded:
            path = Path(recorded)
            path = path if path.is_absolute() else base / path
            if path.is_file():
                return cls(base, path)
        return default

    def write_manifest(self, config: Mapping[str, Any] | None = None) -> Path:
        """Record where this run's artefacts are, and the run's settings (``config``: a JSON-safe
        nested mapping, e.g. ``RunConfig.to_dict()``; the report shows it). Atomic replace;
        call on rank 0 only (a resumed session records its own settings)."""
        self.root.mkdir(parents=True, exist_ok=True)
        metrics = self.metrics.resolve()
        try:  # inside the run directory: relative, so a copied or moved run stays whole
            recorded = str(metrics.relative_to(self.root.resolve()))
        except ValueError:
            recorded = str(metrics)
        payload: dict[str, Any] = {"version": _MANIFEST_VERSION, "metrics": recorded}
        if config is not None:
            payload["config"] = dict(config)
        write_text_atomic(self.manifest, json.dumps(payload, indent=1) + "\n", sync=Sync.NONE)
        return self.manifest


def read_manifest(root: str | os.PathLike[str]) -> dict[str, object]:
    """``<root>/run.json`` as a dict; empty when missing, unreadable, huge or not an object."""
    path = Path(root) / MANIFEST_FILE
    try:
        with open_regular(path) as f:  # a FIFO would block; a device is refused
            raw = f.read((1 << 20) + 1)
        if len(raw) > 1 << 20:
            return {}
        data = json.loads(raw.decode("utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


# ------------------------------------------------------------------ vocabulary: events, metrics
# Shared by the writers (the trainer appends events) and the readers (``stalwart.report``: its
# ``run_report`` loads, its ``html`` renders), so neither reader imports the other.
LOSS_KEYS = ("lm loss", "loss")
LR_KEYS = ("lr", "learning-rate")
THROUGHPUT_KEYS = ("throughput_tflops_per_gpu", "throughput")
TOKENS_KEYS = ("tokens_per_second", "tokens_per_s")
MFU_KEYS = ("mfu_percent",)


class EventKind(str, enum.Enum):  # noqa: UP042 (StrEnum needs Python 3.11)
    """Kinds of run events shown on the report's timeline."""

    SKIPPED = "skipped"
    NAN = "nan"
    RERUN = "rerun"
    RESTART = "restart"
    EXIT = "exit"
    CHECKPOINT = "checkpoint"
    LAUNCH = "launch"  # what ``stalwart launch`` did after a launch ended


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
    # one row per iteration (<metrics stem>.iterations.jsonl); empty for older runs
    iterations: list[dict[str, Any]] = field(default_factory=list)
    validation: list[dict[str, Any]] = field(default_factory=list)
    straggler: list[dict[str, Any]] = field(default_factory=list)
    memory: dict[str, Any] | None = None
    exit_reason: dict[str, Any] | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    chaos: dict[str, Any] | None = None
    config: dict[str, Any] | None = None  # run.json's "config": the run's settings
    notes: list[str] = field(default_factory=list)

    @property
    def last_iteration(self) -> float | None:
        """The run's last iteration known to any artefact (metrics, validation, events, exit
        reason): every chart's x axis reaches it."""
        rows = self.metrics + self.iterations + self.validation + self.events
        its = [float(r["iteration"]) for r in rows]
        exit_it = (self.exit_reason or {}).get("iteration")
        if isinstance(exit_it, (int, float)) and not isinstance(exit_it, bool):
            its.append(float(exit_it))
        finite = [i for i in its if math.isfinite(i)]
        return max(finite) if finite else None


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
    """Per-region timer keys (``timer/<name>`` or TrainingLog's ``<name>-time-ms``), first seen
    first.

    The whole-iteration timers are left out: they are the sum, not a part of the breakdown.
    """
    seen: dict[str, None] = {}
    for row in rows:
        for key in row:
            is_timer = key.startswith("timer/") or key.endswith("-time-ms")
            if is_timer and key not in NOT_TIMERS:
                seen.setdefault(key, None)
    return list(seen)
