"""A comparison of two or more runs: ``stalwart report runA runB ...`` (one HTML file).

What W&B and TensorBoard users do most: the runs' curves overlaid on shared axes (training and
validation loss, learning rate, TFLOP/s per GPU, tokens/s, MFU, ms per iteration, memory), a
table of each run's outcome, and the settings that differ (from each run's ``run.json``)::

    path = write_comparison(["runs/a", "runs/b"], "compare.html")

Each run is read with `stalwart.report.run_report.load_run` (the same checks of hostile or
torn files as one run's report); its notes are listed under its name. Section ids: ``runs``,
``loss``, ``learning-rate``, ``throughput``, ``memory``, ``config-diff``.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from stalwart.atomic_file import Sync, write_text_atomic
from stalwart.observability.run_dir import (
    LOSS_KEYS,
    LR_KEYS,
    MFU_KEYS,
    THROUGHPUT_KEYS,
    TOKENS_KEYS,
    RunArtefacts,
    series,
)
from stalwart.report.config import config_diff_section
from stalwart.report.html import CSS, _section, _skipped, _table, hint
from stalwart.report.plotly_charts import Charts, make_charts, plotly_js
from stalwart.report.svg import Points, _e, _fmt


def run_labels(run_dirs: Sequence[str | os.PathLike[str]]) -> list[str]:
    """Short, distinct names: each directory's name, or its whole path where names repeat."""
    names = [Path(d).name or str(d) for d in run_dirs]
    return [n if names.count(n) == 1 else str(d) for n, d in zip(names, run_dirs)]


def _median(points: Points) -> str:
    return _fmt(statistics.median(y for _, y in points)) if points else "n/a"


def _last(points: Points) -> str:
    return _fmt(points[-1][1]) if points else "n/a"


def _runs_table(labels: Sequence[str], arts: Sequence[RunArtefacts]) -> str:
    rows = []
    for label, art in zip(labels, arts):
        m = art.metrics
        exit_reason = art.exit_reason or {}
        valid = series(art.validation, *(f"{k} validation" for k in LOSS_KEYS))
        rows.append(
            [
                label,
                str(art.run_dir),
                _fmt(art.last_iteration) if art.last_iteration is not None else "n/a",
                _last(series(m, *LOSS_KEYS)),
                _last(valid),
                _median(series(m, *TOKENS_KEYS)),
                _median(series(m, *THROUGHPUT_KEYS)),
                _median(series(m, *MFU_KEYS)),
                f"{exit_reason.get('reason', '?')} (exit code {exit_reason.get('exit_code', '?')})"
                if exit_reason
                else "n/a",
            ]
        )
    header = [
        "run",
        "directory",
        "last iteration",
        "last loss",
        "last validation loss",
        "median tokens/s",
        "median TFLOP/s/GPU",
        "median MFU %",
        "exit",
    ]
    notes = "".join(
        f"<li>{_e(label)}: {_e(n)}</li>" for label, art in zip(labels, arts) for n in art.notes
    )
    return _table(header, rows) + (f'<ul class="note">{notes}</ul>' if notes else "")


def _overlay(
    charts: Charts,
    labels: Sequence[str],
    arts: Sequence[RunArtefacts],
    keys: Sequence[str],
    ylabel: str,
    scale: float = 1.0,
) -> str:
    """One series per run of the first of ``keys`` each row has; '' when no run has any."""
    data = {
        label: [(x, y * scale) for x, y in series(art.metrics, *keys)]
        for label, art in zip(labels, arts)
    }
    if not any(data.values()):
        return ""
    return charts.line(data, "iteration", ylabel, _last_iteration(arts))


def _last_iteration(arts: Sequence[RunArtefacts]) -> float | None:
    its = [a.last_iteration for a in arts if a.last_iteration is not None]
    return max(its) if its else None


def _memory_table(labels: Sequence[str], arts: Sequence[RunArtefacts]) -> str:
    """Each run's memory.json: the formula's total and the measured peak with what it is."""
    rows = []
    for label, art in zip(labels, arts):
        mem = art.memory or {}
        theo = (mem.get("theoretical") or {}).get("total_bytes")
        peak = mem.get("measured_peak_bytes")
        source = {"cpu-rss": "process RSS (CPU)", "cuda-allocator": "CUDA allocator"}.get(
            str(mem.get("measured_source")), str(mem.get("measured_source", "n/a"))
        )
        mib = [
            f"{float(v) / 2**20:,.1f} MiB" if isinstance(v, (int, float)) else "n/a"
            for v in (theo, peak)
        ]
        rows.append([label, *mib, source])
    if not any(a.memory for a in arts):
        return ""
    return _table(["run", "formula total", "measured peak", "measured as"], rows)


def _loss_chart(charts: Charts, labels: Sequence[str], arts: Sequence[RunArtefacts]) -> str:
    data: dict[str, Points] = {}
    dashed = set()
    for label, art in zip(labels, arts):
        data[label] = series(art.metrics, *LOSS_KEYS)
        valid = series(art.validation, *(f"{k} validation" for k in LOSS_KEYS))
        if valid:
            data[f"{label} (validation)"] = valid
            dashed.add(f"{label} (validation)")
    if not any(data.values()):
        return _skipped("Loss", hint(arts[0], "loss") if arts else "")
    return charts.line(data, "iteration", "loss", _last_iteration(arts), frozenset(dashed))


def render_comparison(
    labels: Sequence[str], arts: Sequence[RunArtefacts], interactive: bool | None = None
) -> str:
    """The complete, self-contained comparison page (see the module docstring)."""
    charts = make_charts(interactive)
    lr = _overlay(charts, labels, arts, LR_KEYS, "learning rate")
    rates = "".join(
        _overlay(charts, labels, arts, keys, unit)
        for keys, unit in (
            (THROUGHPUT_KEYS, "TFLOP/s per GPU"),
            (TOKENS_KEYS, "tokens per second"),
            (MFU_KEYS, "MFU (% of the peak)"),
            (("elapsed_ms",), "ms per iteration"),
        )
    )
    memory = _memory_table(labels, arts) + _overlay(
        charts, labels, arts, ("mem-max-allocated-bytes",), "MiB", 2.0**-20
    )
    sections = [
        _section("runs", "Runs", _runs_table(labels, arts)),
        _section("loss", "Loss", _loss_chart(charts, labels, arts)),
        _section("learning-rate", "Learning rate", lr or _skipped("Learning rate")),
        _section("throughput", "Throughput", rates or _skipped("Throughput")),
        _section("memory", "Memory", memory or _skipped("Memory (memory.json)")),
        config_diff_section(labels, [a.config for a in arts]),
    ]
    header = (
        f"<h1>stalwart comparison of {len(arts)} runs</h1><p>"
        + ", ".join(f"<code>{_e(label)}</code>" for label in labels)
        + f"<br>Generated {_e(time.strftime('%Y-%m-%d %H:%M:%S'))}; charts: "
        + ("interactive (plotly)" if charts.interactive else "static (inline SVG)")
        + ".</p>"
    )
    script = f"<script>{plotly_js()}</script>" if charts.interactive else ""
    return (
        '<!DOCTYPE html><html><head><meta charset="utf-8"><title>stalwart comparison</title>'
        f"<style>{CSS}</style>{script}</head><body>{header}{''.join(sections)}</body></html>"
    )


def write_comparison(
    run_dirs: Sequence[str | os.PathLike[str]],
    out: str | os.PathLike[str],
    interactive: bool | None = None,
) -> Path:
    """Load every run, write the comparison page to ``out`` (atomic replace) and return it.

    Raises:
        FileNotFoundError: a run directory does not exist.
        ValueError: fewer than two run directories.
    """
    from stalwart.report.run_report import load_run

    if len(run_dirs) < 2:
        raise ValueError("a comparison needs two or more run directories")
    arts = [load_run(d) for d in run_dirs]
    target = Path(out)
    target.parent.mkdir(parents=True, exist_ok=True)
    page = render_comparison(run_labels(run_dirs), arts, interactive)
    write_text_atomic(target, page, sync=Sync.NONE)
    return target
