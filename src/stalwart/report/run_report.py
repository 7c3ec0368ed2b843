"""Run report: read a run directory's artefacts, write ``report.html`` (+ PNGs when matplotlib
exists).

Usage::

    append_event(run_dir, iteration=120, kind=EventKind.SKIPPED, detail="non-finite grad norm")
    ...
    path = write_report(run_dir)          # <run_dir>/report.html, <run_dir>/report/*.png
    # or: stalwart report <run-dir>

Artefacts read (each optional; a missing one becomes a note in the report):

* ``metrics.jsonl`` (the path recorded in ``run.json`` when the run wrote it elsewhere, see
  `stalwart.observability.run_dir`; or any ``*metrics*.jsonl``): one object per log step with
  ``iteration`` and e.g. ``loss``/``lm loss``, ``lr``/``learning-rate``, ``throughput``,
  ``elapsed_ms``, ``timer/<name>``, ``mem-*``; validation records (``"split": "validation..."``)
  go on the loss chart. Beside it, ``<stem>.iterations.jsonl``: one row per iteration
  (`stalwart.observability.iteration_log`); the loss, gradient-norm and learning-rate charts
  use it when present (one point per iteration), else the log-interval records (older runs).
* ``straggler.jsonl`` (`stalwart.observability.straggler`), ``memory.json``
  (`stalwart.observability.memory`), ``exit_reason.json``, ``events.jsonl`` (`append_event`),
  ``chaos.json`` (``{"passed": bool, "faults": [...]}``).

The HTML is one self-contained file that opens offline: with ``plotly`` installed (``pip install
'stalwart[report]'``) the charts are interactive (hover values, zoom) and plotly.js is inlined
from the installed package; without it the charts are inline SVG. Nothing is fetched from the
network either way.
"""

from __future__ import annotations

import os
from pathlib import Path

from stalwart.atomic_file import Sync, write_text_atomic
from stalwart.observability.goodput.records import GOODPUT_FILE
from stalwart.observability.run_dir import (
    CHAOS_FILE,
    EVENTS_FILE,
    EXIT_REASON_FILE,
    ITERATIONS_SUFFIX,
    LOSS_KEYS,
    LR_KEYS,
    MANIFEST_FILE,
    MEMORY_FILE,
    METRICS_FILE,
    PNG_DIR,
    REPORT_FILE,
    STRAGGLER_FILE,
    THROUGHPUT_KEYS,
    RunArtefacts,
    RunPaths,
    iterations_path,
    read_manifest,
    series,
    timer_label,
    timer_names,
)
from stalwart.report import clean

__all__ = ["NoRunArtefacts", "load_run", "write_pngs", "write_report"]


# What a run directory holds besides its metrics; a report needs one of them at least.
SIDE_ARTEFACTS = (
    EVENTS_FILE,
    GOODPUT_FILE,
    STRAGGLER_FILE,
    MEMORY_FILE,
    EXIT_REASON_FILE,
    CHAOS_FILE,
    MANIFEST_FILE,
)


class NoRunArtefacts(FileNotFoundError):
    """The directory holds nothing a run writes: a report of it would be empty."""


def _check_run_artefacts(root: Path, metrics: Path | None) -> None:
    if (metrics is not None and metrics.exists()) or any(
        (root / n).exists() for n in SIDE_ARTEFACTS
    ):
        return
    tensorboard = any(root.glob("events.out.tfevents.*")) or any(
        root.glob("*/events.out.tfevents.*")
    )
    raise NoRunArtefacts(
        f"{root} holds no run artefacts: looked for {METRICS_FILE} (or the metrics path in "
        f"{MANIFEST_FILE}, or *metrics*.jsonl), {', '.join(SIDE_ARTEFACTS)}; pass the run "
        "directory (--save or --run-dir of the run)"
        + ("; TensorBoard's event files here are TensorBoard's to show" if tensorboard else "")
    )


def _find_metrics(run_dir: Path) -> Path | None:
    direct = RunPaths.discover(run_dir).metrics  # run.json's path, else <run dir>/metrics.jsonl
    if direct.exists():
        return direct
    candidates = sorted(run_dir.glob("*metrics*.jsonl")) + sorted(run_dir.glob("*/*metrics*.jsonl"))
    candidates = [c for c in candidates if not c.name.endswith(ITERATIONS_SUFFIX)]
    return candidates[0] if candidates else None


def _load_iterations(metrics: Path, notes: list[str]) -> list[dict]:
    """The per-iteration rows beside the metrics file (none for runs before them, or with
    ``--no-log-every-iteration``: the charts then use the log-interval records)."""
    path = iterations_path(metrics)
    if not path.exists():
        return []
    rows = clean.clean_metrics(clean.read_jsonl(path, notes), path.name, notes)
    by_iteration = {float(r["iteration"]): r for r in rows}  # a resumed run's repeat: the last
    return [by_iteration[k] for k in sorted(by_iteration)]


def load_run(
    run_dir: str | os.PathLike[str], metrics_file: str | os.PathLike[str] | None = None
) -> RunArtefacts:
    """Read every known artefact; missing or unreadable ones (and records of the wrong shape,
    see `stalwart.report.clean`) are recorded in ``notes``, never raised.

    ``metrics_file`` overrides the search for ``metrics.jsonl`` / ``*metrics*.jsonl`` in the run
    dir.

    Raises:
        FileNotFoundError: ``run_dir`` does not exist or is not a directory.
        NoRunArtefacts: ``run_dir`` holds none of a run's artefacts (an empty directory, a
            TensorBoard directory): one line naming what was looked for.
    """
    root = Path(run_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"run directory not found: {root}")
    art = RunArtefacts(run_dir=root)
    notes = art.notes
    metrics = Path(metrics_file) if metrics_file is not None else _find_metrics(root)
    _check_run_artefacts(root, metrics)
    if metrics is None or not metrics.exists():
        notes.append(
            "metrics JSONL not found: loss, learning-rate, throughput and timer charts skipped"
        )
    else:
        # Training rows; validation rows ("split": "validation...") share the file.
        rows = clean.clean_metrics(clean.read_jsonl(metrics, notes), metrics.name, notes)
        split = [str(r.get("split", "train")) for r in rows]
        train = [r for r, s in zip(rows, split) if s == "train"]
        valid = [r for r, s in zip(rows, split) if s.startswith("validation")]
        art.metrics = sorted(train, key=lambda r: float(r["iteration"]))
        art.validation = sorted(valid, key=lambda r: float(r["iteration"]))
        art.iterations = _load_iterations(metrics, notes)
    for name, cleaner, attr in (
        ("straggler.jsonl", clean.clean_straggler, "straggler"),
        (EVENTS_FILE, clean.clean_events, "events"),
    ):
        path = root / name
        if path.exists():
            setattr(art, attr, cleaner(clean.read_jsonl(path, notes), name, notes))
        else:
            notes.append(f"{name} not found: section skipped")
    for name, attr in (
        ("memory.json", "memory"),
        ("exit_reason.json", "exit_reason"),
        ("chaos.json", "chaos"),
    ):
        path = root / name
        if path.exists():
            setattr(art, attr, clean.read_json(path, notes))
        elif name != "chaos.json":  # chaos runs are the exception, not worth a note
            notes.append(f"{name} not found: section skipped")
    config = read_manifest(root).get("config")
    art.config = config if isinstance(config, dict) else None
    art.memory = clean.clean_memory(art.memory, "memory.json", notes)
    art.chaos = clean.clean_chaos(art.chaos)
    return art


def write_pngs(art: RunArtefacts, out_dir: Path) -> list[Path]:
    """Loss/grad-norm/LR/throughput/timer PNGs with matplotlib (Agg); empty list when it is not
    installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        art.notes.append("matplotlib not installed: PNGs skipped (the HTML uses inline SVG)")
        return []
    rows = art.iterations or art.metrics  # one point per iteration where the run has its rows
    charts: list[tuple[str, str, dict[str, list[tuple[float, float]]]]] = [
        ("loss", "loss", {"loss": series(rows, *LOSS_KEYS)}),
        ("grad_norm", "gradient norm", {"grad norm": series(rows, "grad_norm", "grad-norm")}),
        ("learning_rate", "learning rate", {"lr": series(rows, *LR_KEYS)}),
        (
            "throughput",
            "throughput",
            {"throughput": series(art.metrics, *THROUGHPUT_KEYS)},
        ),
        (
            "timers",
            "ms",
            {timer_label(k): series(art.metrics, k) for k in timer_names(art.metrics)},
        ),
    ]
    written: list[Path] = []
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, ylabel, data in charts:
        data = {k: v for k, v in data.items() if v}
        if not data:
            continue
        fig, ax = plt.subplots(figsize=(8, 3.5))
        for label, pts in data.items():
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label)
        ax.set_xlabel("iteration")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if len(data) > 1:
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def write_report(
    run_dir: str | os.PathLike[str],
    out: str | os.PathLike[str] | None = None,
    pngs: bool = True,
    metrics_file: str | os.PathLike[str] | None = None,
    interactive: bool | None = None,
) -> Path:
    """Load ``run_dir``, render the HTML report (default ``<run_dir>/report.html``), write PNGs.

    ``interactive``: plotly charts (None: when plotly is installed), else inline SVG.

    Raises:
        FileNotFoundError: ``run_dir`` does not exist, or holds no run artefact
            (`NoRunArtefacts`; nothing is written then).
    """
    from stalwart.report.html import render_html

    art = load_run(run_dir, metrics_file)
    png_paths = write_pngs(art, art.run_dir / PNG_DIR) if pngs else []
    target = Path(out) if out is not None else art.run_dir / REPORT_FILE
    target.parent.mkdir(parents=True, exist_ok=True)
    page = render_html(art, [p.name for p in png_paths], interactive)
    write_text_atomic(target, page, sync=Sync.NONE)
    return target
