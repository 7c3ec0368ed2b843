"""The run report page: one self-contained HTML file (no network resources).

``render_html(artefacts, png_names)`` returns the whole page; `stalwart.report.run_report`
loads the artefacts and writes the file. Charts come from `stalwart.report.plotly_charts`:
interactive plotly charts (plotly.js inlined from the installed package) when plotly is
installed, else the inline-SVG charts of `stalwart.report.svg`.

Sections (element ids, stable for tests and links): the controls (``chart-controls``: x axis,
EMA smoothing, log y; `stalwart.report.iteration_charts`), ``loss`` (training loss per
iteration, or per log interval for runs without per-iteration rows, and validation loss),
``grad-norm``, ``learning-rate``, ``iteration-time`` (a CUDA run's device time per iteration),
``throughput``, ``timers`` (each timer's own time per iteration: a parent timer such as
``forward-backward`` shows only the time not covered by the children logged with it, so bars
add up to the iteration), ``memory``, ``system`` (power, temperature, clock over iterations;
only where NVML recorded them), ``stragglers``, ``timeline``, for chaos runs ``chaos``, and
``config`` (the run's settings from ``run.json``).
Every chart over iterations reaches the run's last iteration (`RunArtefacts.last_iteration`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

from stalwart.observability.run_dir import (
    LOSS_KEYS,
    MFU_KEYS,
    THROUGHPUT_KEYS,
    TOKENS_KEYS,
    RunArtefacts,
    series,
    timer_label,
    timer_names,
)
from stalwart.observability.timer_names import TIMER_PARENTS
from stalwart.report.config import config_section
from stalwart.report.iteration_charts import controls_html, iteration_panels, system_panels, x_maps
from stalwart.report.plotly_charts import Charts, make_charts, plotly_js
from stalwart.report.svg import _e, _fmt


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _section(sid: str, title: str, body: str) -> str:
    return f'<section id="{sid}"><h2>{_e(title)}</h2>{body}</section>'


# How to get a missing section next time, as the run's path spells it: a run directory with
# run.json's settings was written by `stalwart train` (its flags); any other by a loop or an
# adapter on stalwart.loop.Shell (its config fields and calls).
_NO_METRICS = {
    "cli": "the metrics file: --save or --metrics-file",
    "shell": "the metrics file: ShellConfig.save_dir, run_dir or SinkConfig(metrics_file=...)",
}
_NOT_LOGGED = {
    "loss": {"cli": "", "shell": "the loop logged no loss: Shell.record(result or losses=...)"},
    "grad-norm": {
        "cli": "",
        "shell": "the loop logged no gradient norm: Shell.record(result or grad_norm=...)",
    },
    "learning-rate": {
        "cli": "",
        "shell": "the loop logged no learning rate: Shell.record(learning_rate=...)",
    },
    "throughput": {
        "cli": "train with --log-throughput",
        "shell": "LogConfig(log_throughput=True) and Shell.set_flops(...)",
    },
    "timers": {
        "cli": "train with --timing-log-level 1 or 2",
        "shell": "TimerConfig(timing_log_level=1 or 2)",
    },
    "stragglers": {
        "cli": "train with --log-straggler",
        "shell": "StragglerConfig(log_straggler=True)",
    },
}


def hint(art: RunArtefacts, section: str) -> str:
    """How to get the missing ``section`` next time, named as the run's path spells it: no
    metrics file at all, or one that holds no values of the section."""
    path = "cli" if art.config else "shell"
    if (
        section in ("loss", "grad-norm", "learning-rate", "throughput", "timers")
        and not art.metrics
    ):
        return _NO_METRICS[path]
    return _NOT_LOGGED[section][path]


def _skipped(what: str, hint: str = "") -> str:
    tail = f" ({hint})" if hint else ""
    return f'<p class="note">{_e(what)}: not available in this run directory{_e(tail)}.</p>'


def _mib(v: object) -> str:
    return f"{float(v) / 2**20:,.1f} MiB" if isinstance(v, (int, float)) else "n/a"


def _validation_series(art: RunArtefacts) -> dict[str, list[tuple[float, float]]]:
    """``<loss key> validation[-<set>]`` columns of the validation records, one series each."""
    keys: dict[str, None] = {}
    for row in art.validation:
        for key in row:
            base = key.split(" validation", 1)[0]
            if " validation" in key and base in LOSS_KEYS and not key.endswith(" ppl"):
                keys.setdefault(key, None)
    return {key: series(art.validation, key) for key in keys}


def timer_stacks(rows: list[dict[str, Any]], keys: list[str]) -> dict[str, list[float]]:
    """Per-iteration ms of each timer key, parents reduced to their own time.

    A parent (``forward-backward``) that is logged together with children (``forward-compute``,
    ...) keeps only ``parent - sum(children)`` (clamped at 0), labelled ``"<parent> (other)"``.
    """
    labels = {k: timer_label(k) for k in keys}
    by_label = {label: k for k, label in labels.items()}
    children: dict[str, list[str]] = {}
    for label in by_label:
        parent = TIMER_PARENTS.get(label)
        if parent in by_label:
            children.setdefault(parent, []).append(label)
    stacks: dict[str, list[float]] = {}
    for key, label in labels.items():
        values = [float(r.get(key, 0.0) or 0.0) for r in rows]
        kids = children.get(label)
        if kids:
            for i, row in enumerate(rows):
                covered = sum(float(row.get(by_label[c], 0.0) or 0.0) for c in kids)
                values[i] = max(values[i] - covered, 0.0)
            label = f"{label} (other)"
        stacks[label] = values
    return stacks


def _metric_sections(art: RunArtefacts, charts: Charts) -> list[str]:
    m, last = art.metrics, art.last_iteration
    maps = x_maps(art)
    out = [controls_html(maps)] if charts.interactive else []
    validation = _validation_series(art)
    panels = iteration_panels(art, validation)
    panels.append(
        (
            "throughput",
            "Throughput",
            {"TFLOP/s/GPU": series(m, *THROUGHPUT_KEYS)},
            "TFLOP/s per GPU",
        )
    )
    for sid, title, data, ylabel in panels:
        has = any(data.values())
        smooth = frozenset(k for k in data if k not in validation and sid != "learning-rate")
        body = (
            charts.line(data, "iteration", ylabel, last, frozenset(validation), maps, smooth)
            if has
            else _skipped(title, hint(art, sid))
        )
        if sid == "throughput":
            body += _rate_charts(art, charts)
        out.append(_section(sid, title, body))
    names = timer_names(m)
    if names:
        rows = [r for r in m if any(k in r for k in names)]
        stride = max(1, math.ceil(len(rows) / 60))
        rows = rows[::stride] + ([rows[-1]] if (len(rows) - 1) % stride else [])  # + the last
        stacks = timer_stacks(rows, names)
        body = charts.stacked_bars(
            [str(r["iteration"]) for r in rows], stacks, "ms per iteration", "iteration"
        )
    else:
        body = _skipped("Timers (<name>-time-ms or timer/<name> keys)", hint(art, "timers"))
    out.append(_section("timers", "Timer breakdown per iteration", body))
    return out


def _rate_charts(art: RunArtefacts, charts: Charts) -> str:
    """Tokens/s, MFU (when the run knew its device's peak) and ms per iteration."""
    m, last = art.metrics, art.last_iteration
    out = ""
    for label, keys, unit in (
        ("tokens/s", TOKENS_KEYS, "tokens per second"),
        ("MFU %", MFU_KEYS, "MFU (% of the peak)"),
        ("elapsed ms/iter", ("elapsed_ms",), "ms"),
    ):
        points = series(m, *keys)
        if points:
            out += charts.line({label: points}, "iteration", unit, last, xmaps=x_maps(art))
    if m and not series(m, *MFU_KEYS):
        out += (
            '<p class="note">MFU: not logged (no known peak for this device: CPU, or a GPU '
            "missing from the table; --peak-tflops gives one).</p>"
        )
    return out


def _memory_section(art: RunArtefacts, charts: Charts) -> str:
    mem = art.memory
    parts = []
    if mem and mem.get("measured_source") == "cpu-rss":
        parts.append(_cpu_memory(mem, charts))
    elif mem:
        theo = mem.get("theoretical") or {}
        measured = mem.get("measured") or {}
        peak = float(mem.get("measured_peak_bytes") or 0.0)
        w = float(theo.get("weights_optimizer_bytes") or 0.0)
        a = float(theo.get("activation_bytes") or 0.0)
        reserved = float(measured.get("mem-max-reserved-bytes", 0.0) or 0.0)
        mib = 2.0**20
        parts.append(
            charts.stacked_bars(
                ["theoretical", "measured peak", "max reserved"],
                {
                    "weights+optimizer": [w / mib, 0.0, 0.0],
                    "activations": [a / mib, 0.0, 0.0],
                    "measured": [0.0, peak / mib, reserved / mib],
                },
                "MiB",
            )
        )
        ratio = mem.get("theoretical_over_measured")
        src = mem.get("measured_source", "?")
        rows: list[list[object]] = [
            ["theoretical total", _mib(theo.get("total_bytes"))],
            [f"measured peak ({src})", _mib(peak)],
            ["theoretical / measured", f"{ratio:.3f}" if isinstance(ratio, float) else "n/a"],
            ["parameters", f"{int(theo.get('num_parameters') or 0):,}"],
            ["bytes per parameter", theo.get("bytes_per_parameter", "n/a")],
        ]
        rows += [[k, _mib(v)] for k, v in (theo.get("breakdown") or {}).items()]
        parts.append(_table(["quantity", "value"], rows))
    else:
        parts.append(_skipped("memory.json (theoretical vs measured)"))
    mem_series = {
        k: [(x, y / 2**20) for x, y in series(art.metrics, k)]
        for k in ("mem-max-allocated-bytes", "mem-allocated-bytes", "mem-reserved-bytes")
    }
    if any(mem_series.values()):
        parts.append(
            charts.line(mem_series, "iteration", "MiB", art.last_iteration, xmaps=x_maps(art))
        )
    cpu = bool(mem) and (mem or {}).get("measured_source") == "cpu-rss"
    title = "Memory: the formula, and the process RSS" if cpu else "Memory: theoretical vs measured"
    return _section("memory", title, "".join(parts))


def _system_section(art: RunArtefacts, charts: Charts) -> str:
    """Power, temperature, SM clock and utilisation over iterations, where NVML recorded them
    (a GPU run with --log-energy or --log-straggler); no section otherwise (a CPU run)."""
    maps, last = x_maps(art), art.last_iteration
    parts = [
        f"<h3>{_e(title)}</h3>" + charts.line(data, "iteration", unit, last, xmaps=maps)
        for _, title, data, unit in system_panels(art)
    ]
    return _section("system", "System over time", "".join(parts)) if parts else ""


def _cpu_memory(mem: dict[str, Any], charts: Charts) -> str:
    """A CPU run: the formula (what the model, optimizer and activations would take on an
    accelerator) and the process's resident memory side by side, not as a ratio: RSS also holds
    the interpreter, torch and the data, which the formula does not model."""
    theo = mem.get("theoretical") or {}
    measured = mem.get("measured") or {}
    mib = 2.0**20
    w = float(theo.get("weights_optimizer_bytes") or 0.0)
    a = float(theo.get("activation_bytes") or 0.0)
    rss = float(measured.get("mem-max-rss-bytes") or mem.get("measured_peak_bytes") or 0.0)
    chart = charts.stacked_bars(  # the formula alone: RSS is not the same quantity
        ["formula (accelerator memory)"],
        {"weights+optimizer": [w / mib], "activations": [a / mib]},
        "MiB",
    )
    note = (
        '<p class="note">CPU run: the formula is the memory the model, its optimizer state and '
        "activations would take on an accelerator; the measured value is the process's "
        "resident memory (RSS), which also holds the Python interpreter, torch and the data. "
        "They measure different things, so they are not compared (no ratio, no shared chart).</p>"
    )
    rows: list[list[object]] = [
        ["formula total", _mib(theo.get("total_bytes"))],
        ["max process RSS (measured; not comparable)", _mib(rss)],
        ["parameters", f"{int(theo.get('num_parameters') or 0):,}"],
        ["bytes per parameter", theo.get("bytes_per_parameter", "n/a")],
    ]
    rows += [[k, _mib(v)] for k, v in (theo.get("breakdown") or {}).items()]
    return chart + note + _table(["quantity", "value"], rows)


def _straggler_section(art: RunArtefacts, charts: Charts) -> str:
    recs = [r for r in art.straggler if isinstance(r.get("compute_ms"), list) and r["compute_ms"]]
    if not recs:
        return _section(
            "stragglers", "Stragglers", _skipped("straggler.jsonl", hint(art, "stragglers"))
        )
    flagged: dict[int, int] = {}
    for r in recs:
        for rank in r.get("stragglers") or []:
            flagged[int(rank)] = flagged.get(int(rank), 0) + 1
    summary = (
        "<p>Flagged ranks (times flagged): "
        + (", ".join(f"rank {k} ({v})" for k, v in sorted(flagged.items())) or "none")
        + "</p>"
    )
    last = recs[-1]
    table = _table(
        ["last report", "min ms", "median ms", "max ms", "slowest"],
        [
            [
                last.get("iteration"),
                _fmt(float(last.get("min_ms", 0))),
                _fmt(float(last.get("median_ms", 0))),
                _fmt(float(last.get("max_ms", 0))),
                (last.get("slowest") or [["?"]])[0][0],
            ]
        ],
    )
    table += _gpu_table(last)
    ranks = max(len(r["compute_ms"]) for r in recs)
    if ranks == 1:
        summary += '<p class="note">One rank: there is nobody to compare with (ratios are 1).</p>'
    return _section("stragglers", "Stragglers", charts.heatmap(recs) + summary + table)


def _gpu_table(record: dict[str, Any]) -> str:
    """The last report's GPU fields per rank (NVML; absent on CPU)."""
    gpu = record.get("gpu")
    if not isinstance(gpu, list) or not any(isinstance(g, dict) for g in gpu):
        return ""
    keys = ("temperature_c", "power_w", "utilization_pct", "clock_mhz")

    def cell(g: Any, key: str) -> str:
        v = g.get(key) if isinstance(g, dict) else None
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            return _fmt(float(v))
        return "n/a"

    rows = [[rank, *(cell(g, k) for k in keys)] for rank, g in enumerate(gpu[:1024])]
    return "<h3>GPUs at the last report (NVML)</h3>" + _table(
        ["rank", "temperature °C", "power W", "utilisation %", "SM clock MHz"], rows
    )


def _metric_counter_events(art: RunArtefacts) -> list[dict[str, Any]]:
    """Skipped/NaN markers from the metrics counters, for kinds events.jsonl does not record."""
    logged = {str(e.get("kind")) for e in art.events}
    out: list[dict[str, Any]] = []
    for key, kind in (("skipped_iterations", "skipped"), ("nan_iterations", "nan")):
        if kind in logged:
            continue
        for row in art.metrics:
            n = row.get(key)
            if isinstance(n, (int, float)) and n > 0:
                detail = f"{int(n)} in the log interval ending here (metrics counter)"
                out.append({"iteration": row["iteration"], "kind": kind, "detail": detail})
    return out


def _timeline_section(art: RunArtefacts, charts: Charts) -> str:
    events = sorted(
        art.events + _metric_counter_events(art), key=lambda e: float(e.get("iteration", 0))
    )
    if not events and not art.exit_reason:
        return _section("timeline", "Timeline", _skipped("events.jsonl"))
    body = charts.timeline(events, art.last_iteration) if events else ""
    counts: dict[str, int] = {}
    for ev in events:
        counts[str(ev.get("kind"))] = counts.get(str(ev.get("kind")), 0) + 1
    body += _table(["kind", "count"], sorted(counts.items()))
    rows = [[e.get("iteration"), e.get("kind"), e.get("detail", "")] for e in events[-50:]]
    body += _table(["iteration", "kind", "detail"], rows)
    if art.exit_reason:
        body += "<h3>Exit reason</h3>" + _table(
            ["key", "value"], [[k, v] for k, v in art.exit_reason.items()]
        )
    return _section("timeline", "Timeline: skipped/NaN iterations, reruns, restarts, exits", body)


def _chaos_section(art: RunArtefacts) -> str:
    chaos = art.chaos or {}
    passed = bool(chaos.get("passed"))
    verdict = (
        f'<p class="{"ok" if passed else "bad"}">chaos run: {"PASSED" if passed else "FAILED"}</p>'
    )
    faults = [f for f in chaos.get("faults") or [] if isinstance(f, dict)]
    keys: list[str] = []
    for f in faults:
        keys += [k for k in f if k not in keys]
    table = _table(keys, [[f.get(k, "") for k in keys] for f in faults]) if faults else ""
    return _section("chaos", "Chaos", verdict + table)


CSS = """
body{font-family:sans-serif;margin:24px;max-width:1000px;color:#222}
h1{font-size:22px} h2{font-size:18px;border-bottom:1px solid #ccc;padding-bottom:4px}
table{border-collapse:collapse;margin:8px 0;font-size:13px}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:left} th{background:#f3f3f3}
.note{color:#777;font-style:italic}
.ok{color:#2a2;font-weight:bold} .bad{color:#c22;font-weight:bold}
"""


def render_html(
    art: RunArtefacts, png_names: Sequence[str] = (), interactive: bool | None = None
) -> str:
    """The complete, self-contained report page.

    ``interactive``: plotly charts (None: when plotly is installed; True without plotly raises
    ``ImportError``), else inline SVG.
    """
    from stalwart.report.ettr import ettr_section
    from stalwart.report.goodput import goodput_section

    charts = make_charts(interactive)
    sections = [goodput_section(art.run_dir), ettr_section(art.run_dir)]
    sections += _metric_sections(art, charts)
    sections += [
        _memory_section(art, charts),
        _system_section(art, charts),
        _straggler_section(art, charts),
        _timeline_section(art, charts),
    ]
    if art.chaos is not None:
        sections.append(_chaos_section(art))
    sections.append(config_section(art.config))
    notes = "".join(f"<li>{_e(n)}</li>" for n in art.notes)
    pngs = ", ".join(f"report/{_e(n)}" for n in png_names)
    header = (
        f"<h1>stalwart run report</h1><p>Run directory: <code>{_e(art.run_dir)}</code><br>"
        f"Generated {_e(time.strftime('%Y-%m-%d %H:%M:%S'))}; {len(art.metrics)} metric rows"
        + (f", {len(art.iterations)} iteration rows" if art.iterations else "")
        + "; "
        f"charts: {'interactive (plotly)' if charts.interactive else 'static (inline SVG)'}."
        + (f"<br>PNG charts: {pngs}" if pngs else "")
        + "</p>"
        + (f'<ul class="note">{notes}</ul>' if notes else "")
    )
    script = f"<script>{plotly_js()}</script>" if charts.interactive else ""
    return (
        '<!DOCTYPE html><html><head><meta charset="utf-8"><title>stalwart run report</title>'
        f"<style>{CSS}</style>{script}</head><body>{header}{''.join(sections)}</body></html>"
    )
