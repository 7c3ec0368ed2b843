"""Every iteration in the report: a short training writes one row per iteration, the report's
loss and gradient-norm figures have one point each, and its controls (x axis, EMA, log y)
restyle the charts in a browser."""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from test_report import _chromium, _chromium_cmd

from stalwart.cli.main import main
from stalwart.report.run_report import load_run, write_report

from train_utils import TINY_FLAGS

ITERS = 30

needs_chromium = pytest.mark.skipif(
    _chromium() is None and not os.environ.get("STALWART_REQUIRE_CHROMIUM"),
    reason="chromium not installed (CI installs it and sets STALWART_REQUIRE_CHROMIUM)",
)


def figures(page: str) -> dict[str, list[dict[str, Any]]]:
    """Each section's plotly figures' data (the JSON of its ``Plotly.newPlot`` calls)."""
    decoder = json.JSONDecoder()
    out: dict[str, list[dict[str, Any]]] = {}
    for section in re.finditer(r'<section id="([^"]+)">(.*?)</section>', page, re.S):
        for call in re.finditer(r'Plotly\.newPlot\(\s*"[^"]+",\s*', section.group(2)):
            data, _ = decoder.raw_decode(section.group(2), call.end())
            out.setdefault(section.group(1), []).extend(data)
    return out


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_a_training_has_one_row_and_one_chart_point_per_iteration(tmp_path: Path) -> None:
    pytest.importorskip("plotly")
    save = tmp_path / "run"
    args = ["train", *TINY_FLAGS, "--train-iters", str(ITERS), "--log-interval", "10"]
    assert main([*args, "--save", str(save)]) == 0
    rows = _jsonl(save / "metrics.iterations.jsonl")
    assert [r["iteration"] for r in rows] == list(range(1, ITERS + 1))
    assert all(r["loss"] > 0 and r["grad_norm"] > 0 and r["lr"] >= 0 for r in rows)
    assert rows[0]["lr"] == 5e-4 and rows[-1]["lr"] == 0.0  # warm-up, then decay to 0
    assert [r["tokens"] for r in rows] == [r["consumed_samples"] * 32 for r in rows]
    train = [r for r in _jsonl(save / "metrics.jsonl") if r["split"] == "train"]
    assert [r["iteration"] for r in train] == [1, 10, 20, 30]  # the log steps, as before
    # The interval's mean loss is the mean of its iterations' rows.
    assert train[-1]["loss"] == pytest.approx(sum(r["loss"] for r in rows[20:]) / 10)
    page = write_report(save, pngs=False, interactive=True).read_text()
    figs = figures(page)
    for section in ("loss", "grad-norm", "learning-rate"):
        (trace,) = figs[section]
        assert trace["x"] == list(range(1, ITERS + 1)), section
        assert len(trace["y"]) == ITERS, section
        meta = trace["meta"]["stalwart"]
        assert meta["x"]["tokens"] == [r["tokens"] for r in rows]
        assert len(meta["x"]["wall time (s)"]) == ITERS and meta["x"]["wall time (s)"][0] == 0
    assert [t["y"] for t in figs["grad-norm"]] == [[r["grad_norm"] for r in rows]]
    assert 'id="chart-controls"' in page

    # Off: no rows, and the report draws the log-interval records (runs before the rows alike).
    off = tmp_path / "off"
    assert main([*args, "--save", str(off), "--no-log-every-iteration"]) == 0
    assert not (off / "metrics.iterations.jsonl").exists()
    assert load_run(off).iterations == []
    (trace,) = figures(write_report(off, pngs=False, interactive=True).read_text())["loss"]
    assert trace["x"] == [1, 10, 20, 30]


def synthetic_run(run: Path, iters: int = 150) -> None:
    """A GPU-like run directory: per-iteration rows, log-interval records with memory and
    NVML's power and temperature every 10 iterations."""
    run.mkdir(parents=True)
    with open(run / "metrics.iterations.jsonl", "w") as f:
        for it in range(1, iters + 1):
            noise = 0.4 * ((it * 7919) % 13 - 6) / 6
            row = {"iteration": it, "consumed_samples": 8 * it, "tokens": 1024 * it,
                   "wall_time": 1000.0 + 0.5 * it, "loss": 8.0 * 0.98**it + 2.0 + noise,
                   "grad_norm": 5.0 * 0.97**it + 0.5 + abs(noise), "lr": 1e-3,
                   "skipped": False, "nan": False}  # fmt: skip
            if it > 1:
                row["iteration_ms"] = 500.0 + noise  # a CUDA run's device time
            f.write(json.dumps(row) + "\n")
    with open(run / "metrics.jsonl", "w") as f:
        for it in [1, *range(10, iters + 1, 10)]:
            row = {"split": "train", "iteration": it, "loss": 8.0 * 0.98**it + 2.0,
                   "mem-max-allocated-bytes": 3e9 + it * 1e6, "power/gpu": 500.0 + it,
                   "straggler/temperature-c-max": 60.0 + it / 10}  # fmt: skip
            f.write(json.dumps(row) + "\n")


# Applies the controls as a reader would (wall time, EMA 0.9, log y), then reports the charts.
CONTROLS_PROBE = """<script>
window.addEventListener("load", () => setTimeout(() => {
  const set = (id, prop, value, kind) => {
    const el = document.getElementById(id); el[prop] = value;
    el.dispatchEvent(new Event(kind));
  };
  set("sw-x", "value", "wall time (s)", "change");
  set("sw-ema", "value", "0.9", "input");
  set("sw-logy", "checked", true, "change");
  const out = {};
  for (const gd of document.querySelectorAll(".js-plotly-plot")) {
    const sid = gd.closest("section").id;
    if (!gd.data[0].meta || out[sid]) continue;  // the first chart of a section
    out[sid] = {x: gd.data[0].x, y: gd.data[0].y, raw: gd.data[0].meta.stalwart.y,
                ytype: gd._fullLayout.yaxis.type, xtitle: gd._fullLayout.xaxis.title.text};
  }
  const pre = document.createElement("pre");
  pre.id = "probe"; pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
}, 300));
</script>"""


@pytest.mark.slow
@needs_chromium
def test_controls_restyle_every_chart_in_headless_chromium(tmp_path: Path) -> None:
    pytest.importorskip("plotly")
    pil = pytest.importorskip("PIL.Image")
    run = tmp_path / "run"
    synthetic_run(run)
    page = write_report(run, pngs=False, interactive=True)
    figs = figures(page.read_text())
    assert len(figs["loss"][0]["x"]) == 150 and len(figs["grad-norm"][0]["x"]) == 150
    probe = tmp_path / "probe.html"
    probe.write_text(page.read_text().replace("</body>", CONTROLS_PROBE + "</body>"))
    cmd = _chromium_cmd(tmp_path, "--dump-dom", probe.resolve().as_uri())
    dom = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=180).stdout
    match = re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S)
    assert match, dom[-2000:]
    charts = json.loads(html.unescape(match.group(1)))
    sections = {"loss", "grad-norm", "learning-rate", "iteration-time", "memory", "system"}
    assert sections <= set(charts)
    assert len(charts["iteration-time"]["x"]) == 149
    for sid in ("loss", "grad-norm"):
        chart = charts[sid]
        assert chart["x"][:3] == [0.0, 0.5, 1.0] and len(chart["x"]) == 150, sid  # wall time
        assert chart["ytype"] == "log" and chart["xtitle"] == "wall time (s)", sid
        ema = chart["raw"][0]
        for raw in chart["raw"][1:4]:
            ema = 0.9 * ema + 0.1 * raw
        assert chart["y"][3] == pytest.approx(ema), sid  # smoothed
        assert chart["y"][3] != pytest.approx(chart["raw"][3]), sid
    assert charts["learning-rate"]["y"] == charts["learning-rate"]["raw"]  # never smoothed
    assert charts["system"]["x"][:2] == [0.0, 4.5]  # iterations 1 and 10 on the wall clock
    shot = tmp_path / "shot.png"
    cmd = _chromium_cmd(tmp_path, f"--screenshot={shot}", "--window-size=1280,3600")
    subprocess.run([*cmd, probe.resolve().as_uri()], check=True, capture_output=True, timeout=180)
    if os.environ.get("STALWART_KEEP_SCREENSHOT"):  # a person looks at it
        shutil.copy(shot, os.environ["STALWART_KEEP_SCREENSHOT"])
    with pil.open(shot) as img:
        assert len(set(img.convert("RGB").getdata())) > 50  # drawn, not blank
