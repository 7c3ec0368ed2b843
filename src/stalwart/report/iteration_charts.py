"""The report's charts over training: loss, gradient norm, learning rate and the system's
metrics over time, with the page's controls (x axis, smoothing, log y).

Data: one point per iteration from ``<metrics stem>.iterations.jsonl`` when the run wrote it
(`stalwart.observability.iteration_log`), else one per log interval from ``metrics.jsonl``
(older runs, ``--no-log-every-iteration``). The system charts (memory, and with NVML power,
temperature, SM clock, utilisation) use what the log-interval records hold: ``mem-*`` (memory
probe), ``power/gpu`` (``--log-energy``), ``straggler/*`` GPU min/max (``--log-straggler`` on a
GPU with NVML); a chart without values is left out.

Controls (interactive charts only): a plotly trace carries its alternatives in ``meta.stalwart``
(``x``: the trace's x by ``iteration``, ``tokens`` or ``samples``, ``wall time (s)``; ``y``;
``smooth``: whether the EMA applies), and the page's script restyles every such trace when the
x axis, the EMA weight or the log-y toggle changes. Nothing changes until the reader asks: the
page opens on iterations, unsmoothed, linear.
"""

from __future__ import annotations

import html
import re
from collections.abc import Mapping
from typing import Any

from stalwart.observability.run_dir import LOSS_KEYS, LR_KEYS, RunArtefacts, series

__all__ = [
    "CONTROLS_ID",
    "XMaps",
    "controls_html",
    "iteration_panels",
    "system_panels",
    "trace_meta",
    "x_maps",
]

CONTROLS_ID = "chart-controls"
# x axis label -> {iteration: x}; "iteration" itself is the identity (absent from the maps).
XMaps = dict[str, dict[float, float]]
Panel = tuple[str, str, dict[str, list[tuple[float, float]]], str]
_GRAD_KEYS = ("grad_norm", "grad-norm")
# NVML metrics of the log-interval records: (title, unit, key pattern, scale); memory has its
# own section (`stalwart.report.html`), whose chart over iterations takes the same controls.
_SYSTEM = (
    ("Power", "W", r"^(power/gpu|straggler/power-w.*)$", 1.0),
    ("Temperature", "°C", r"^straggler/temperature-c.*$", 1.0),
    ("SM clock", "MHz", r"^straggler/clock-mhz.*$", 1.0),
    ("GPU utilisation", "%", r"^straggler/utilization-pct.*$", 1.0),
)


def x_maps(art: RunArtefacts) -> XMaps:
    """Other x axes of the per-iteration rows: tokens (or samples without a sequence length)
    and wall time in seconds since the first row. Empty for a run without such rows."""
    rows = art.iterations
    maps: XMaps = {}
    tokens = {float(r["iteration"]): float(r["tokens"]) for r in rows if "tokens" in r}
    samples = {
        float(r["iteration"]): float(r["consumed_samples"]) for r in rows if "consumed_samples" in r
    }
    if tokens:
        maps["tokens"] = tokens
    elif samples:
        maps["samples"] = samples
    times = [(float(r["iteration"]), float(r["wall_time"])) for r in rows if "wall_time" in r]
    if times:
        start = times[0][1]
        maps["wall time (s)"] = {it: t - start for it, t in times}
    return maps


def iteration_panels(
    art: RunArtefacts, validation: dict[str, list[tuple[float, float]]]
) -> list[Panel]:
    """(section id, title, series, y label) of the loss (with ``validation``), gradient-norm
    and learning-rate charts: per iteration when the run has its rows, else per log step; and
    the device time per iteration when the rows have it (a CUDA run)."""
    per_it = bool(art.iterations)
    rows = art.iterations if per_it else art.metrics
    what = "per iteration" if per_it else "per log interval"
    loss_keys = ("loss", *LOSS_KEYS) if per_it else LOSS_KEYS
    panels: list[Panel] = [
        ("loss", "Loss", {f"loss ({what})": series(rows, *loss_keys), **validation}, "loss"),
        ("grad-norm", "Gradient norm", {f"grad norm ({what})": series(rows, *_GRAD_KEYS)}, "norm"),
        ("learning-rate", "Learning rate", {"lr": series(rows, *LR_KEYS)}, "lr"),
    ]
    device_ms = series(art.iterations, "iteration_ms")  # a CUDA run's rows only
    if device_ms:
        data = {"device ms per iteration": device_ms}
        panels.append(("iteration-time", "Iteration time (device, per iteration)", data, "ms"))
    return panels


def system_panels(art: RunArtefacts) -> list[Panel]:
    """The NVML metrics over iterations, from the log-interval records; only the charts that
    have values."""
    keys: dict[str, None] = {}
    for row in art.metrics:
        keys.update(dict.fromkeys(row))
    panels: list[Panel] = []
    for title, unit, pattern, scale in _SYSTEM:
        matched = [k for k in keys if re.match(pattern, k)]
        data = {k: [(x, y * scale) for x, y in series(art.metrics, k)] for k in matched}
        data = {k: v for k, v in data.items() if v}
        if data:
            sid = "system-" + title.lower().replace(" ", "-")
            panels.append((sid, title, data, unit))
    return panels


def trace_meta(
    points: list[tuple[float, float]], maps: Mapping[str, Mapping[float, float]], smooth: bool
) -> dict[str, Any]:
    """A trace's ``meta.stalwart``: its x on every axis (None where a row lacks it), its y."""
    xs = [x for x, _ in points]
    alternatives: dict[str, list[float | None]] = {"iteration": list(xs)}
    for label, m in maps.items():
        alternatives[label] = [m.get(x) for x in xs]
    ys = [y if y == y and abs(y) != float("inf") else None for _, y in points]
    return {"stalwart": {"x": alternatives, "y": ys, "smooth": smooth}}


def controls_html(maps: XMaps) -> str:
    """The controls above the charts and the script that applies them (interactive only)."""
    options = "".join(
        f'<option value="{html.escape(a)}">{html.escape(a)}</option>' for a in ("iteration", *maps)
    )
    return (
        f'<div id="{CONTROLS_ID}" class="controls">x axis <select id="sw-x">{options}</select>'
        ' &nbsp; smoothing (EMA) <input id="sw-ema" type="range" min="0" max="0.99" step="0.01"'
        ' value="0"> <span id="sw-ema-value">0.00</span> &nbsp; <label><input id="sw-logy"'
        ' type="checkbox"> log y</label></div>'
        f"<script>{_SCRIPT}</script>"
    )


# Restyles every trace with meta.stalwart; the EMA skips gaps (null) and starts at the first value.
_SCRIPT = """
(function(){
function ema(ys,a){var s=null;return ys.map(function(v){if(v===null)return null;
 s=(s===null)?v:a*s+(1-a)*v;return s;});}
function apply(){
 var axis=document.getElementById('sw-x').value;
 var a=parseFloat(document.getElementById('sw-ema').value);
 var logy=document.getElementById('sw-logy').checked;
 document.getElementById('sw-ema-value').textContent=a.toFixed(2);
 document.querySelectorAll('.js-plotly-plot').forEach(function(gd){
  var idx=[],xs=[],ys=[];
  (gd.data||[]).forEach(function(t,i){var m=t.meta&&t.meta.stalwart;if(!m)return;
   idx.push(i);xs.push(m.x[axis]||m.x.iteration);ys.push(m.smooth&&a>0?ema(m.y,a):m.y);});
  if(!idx.length)return;
  Plotly.restyle(gd,{x:xs,y:ys},idx);
  Plotly.relayout(gd,{'yaxis.type':logy?'log':'linear','xaxis.title.text':axis,
   'xaxis.autorange':true,'yaxis.autorange':true});
 });
}
['sw-x','sw-ema','sw-logy'].forEach(function(id){
 document.getElementById(id).addEventListener(id==='sw-ema'?'input':'change',apply);});
})();
"""
