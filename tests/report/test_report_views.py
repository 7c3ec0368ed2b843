"""The report shows the whole run: the last iteration on every chart, the timeline's events, the
CPU memory panel without a false comparison, the run's config, and a comparison of runs."""

from __future__ import annotations

import doctest
import html
import json
import math
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from test_report import _chromium, _chromium_cmd

from stalwart.cli.main import main
from stalwart.cli.report import main_report
from stalwart.observability.run_dir import EventKind, append_event
from stalwart.observability.sinks import NullSink
from stalwart.observability.timer_names import INTERVAL_TIME
from stalwart.observability.timers import Timers, TimingLogOption
from stalwart.observability.train_log import LogConfig, TrainingLog
from stalwart.report import config as report_config
from stalwart.report.compare import write_comparison
from stalwart.report.run_report import write_report

from train_utils import TINY_FLAGS

LAST = 150  # the demo: --train-iters 150, --log-interval 20


def demo_like_run(run_dir: Path, lr: float = 2e-3, last_logged: int = 140) -> None:
    """The demo's shape: log lines at 1, 20, ..., ``last_logged``, the checkpoint and exit
    events at 150, a CPU memory.json, and run.json with the settings."""
    run_dir.mkdir(parents=True)
    its = [1, *range(20, last_logged + 1, 20)]
    with open(run_dir / "metrics.jsonl", "w") as f:
        for it in its:
            row = {"split": "train", "iteration": it, "loss": 9.0 - it / 30, "lr": lr,
                   "elapsed_ms": 400.0, "throughput_tflops_per_gpu": 0.01,
                   "tokens_per_second": 500.0 + it, "forward-backward-time-ms": 30.0,
                   "optimizer-time-ms": 5.0}  # fmt: skip
            f.write(json.dumps(row) + "\n")
        for it, value in ((60, 6.5), (100, 6.0)):
            row = {"split": "validation", "iteration": it, "lm loss validation": value}
            f.write(json.dumps(row) + "\n")
    (run_dir / "memory.json").write_text(
        json.dumps(
            {
                "theoretical": {"weights_optimizer_bytes": 5.9e7, "activation_bytes": 1.4e8,
                                "total_bytes": 1.96e8, "num_parameters": 3709952},
                "measured": {"mem-rss-bytes": 4.9e8, "mem-max-rss-bytes": 5.6e8},
                "measured_source": "cpu-rss",
                "measured_peak_bytes": 5.6e8,
                "theoretical_over_measured": 0.346,
            }
        )
    )  # fmt: skip
    append_event(run_dir, LAST, EventKind.CHECKPOINT, "saved checkpoint")
    append_event(run_dir, LAST, EventKind.EXIT, "finished: reached --train-iters (exit code 0)")
    (run_dir / "exit_reason.json").write_text(
        json.dumps({"reason": "finished", "iteration": LAST, "exit_code": 0})
    )
    config = {"optim": {"lr": lr, "weight_decay": 0.1}, "training": {"train_iters": LAST}}
    (run_dir / "run.json").write_text(json.dumps({"version": 1, "config": config}))


def test_docstring_examples() -> None:
    assert doctest.testmod(report_config).failed == 0


# ------------------------------------------------------------------ the last iteration is logged
def _log(train_iters: int, lines: list[str]) -> TrainingLog:
    timers = Timers(0, TimingLogOption.MINMAX, device=torch.device("cpu"))
    log = TrainingLog(
        LogConfig(log_interval=20, log_timestamp=False, log_format="megatron"),
        train_iters=train_iters,
        sink=NullSink(), timers=timers, rank=0, world_size=1, print_fn=lines.append,
    )  # fmt: skip
    timers(INTERVAL_TIME).start(barrier=True)
    return log


def _iterate(log: TrainingLog, iterations: range) -> None:
    for it in iterations:
        log.on_iteration(it, losses={"lm loss": torch.tensor(float(it))}, learning_rate=1e-3,
                         global_batch_size=8, consumed_samples=8 * it, grad_norm=None,
                         skipped=False)  # fmt: skip


def _logged(lines: list[str]) -> list[int]:
    return [int(m.group(1)) for ln in lines if (m := re.search(r"iteration +(\d+)/", ln))]


def test_the_last_iteration_gets_its_line_and_an_early_exit_flushes() -> None:
    lines: list[str] = []
    log = _log(45, lines)
    _iterate(log, range(1, 46))
    log.flush()  # nothing pending: no second line for 45
    assert _logged(lines) == [1, 20, 40, 45]
    assert "lm loss: 4.300000E+01" in lines[-1]  # (41 + ... + 45) / 5: the partial interval
    lines.clear()
    log = _log(100, lines)
    _iterate(log, range(1, 31))  # an exit at 30 (signal, --exit-interval) between log steps
    log.flush()
    log.flush()
    assert _logged(lines) == [1, 20, 30]
    assert "lm loss: 2.550000E+01" in lines[-1]


def test_the_trainer_records_its_config_and_its_last_iteration(tmp_path: Path) -> None:
    save = tmp_path / "run"
    args = ["train", *TINY_FLAGS, "--train-iters", "7", "--lr", "0.002", "--save", str(save)]
    assert main(args) == 0
    records = [json.loads(x) for x in (save / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records if r["split"] == "train"] == [1, 5, 7]
    manifest = json.loads((save / "run.json").read_text())
    assert manifest["config"]["optim"]["lr"] == 0.002
    assert manifest["config"]["training"]["train_iters"] == 7
    page = write_report(save, pngs=False, interactive=False).read_text()
    assert re.search(r"<td>optim\.lr</td><td>0\.002</td>", page)


# ------------------------------------------------------------------ one run's page
def test_cpu_memory_panel_says_what_it_shows_and_compares_nothing(tmp_path: Path) -> None:
    run = tmp_path / "demo"
    demo_like_run(run)
    page = write_report(run, pngs=False, interactive=False).read_text()
    memory = page.split('id="memory"')[1].split("</section>")[0]
    assert "theoretical / measured" not in memory and "0.346" not in memory
    assert "process's resident memory (RSS)" in memory
    assert "not compared" in memory
    assert "max process RSS (measured; not comparable)" in memory
    config = page.split('id="config"')[1].split("</section>")[0]
    assert "<td>optim.lr</td><td>0.002</td>" in config
    assert "<td>training.train_iters</td><td>150</td>" in config


def test_comparison_of_runs_from_the_cli(tmp_path: Path, capsys) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    demo_like_run(a)
    demo_like_run(b, lr=5e-4, last_logged=100)
    out = tmp_path / "cmp.html"
    assert main_report([str(a), str(b), "-o", str(out), "--static"]) == 0
    assert "comparison of 2 runs written to" in capsys.readouterr().out
    page = out.read_text()
    for sid in ("runs", "loss", "learning-rate", "throughput", "memory", "config-diff"):
        assert f'id="{sid}"' in page, sid
    diff = page.split('id="config-diff"')[1].split("</section>")[0]
    assert "<td>optim.lr</td><td>0.002</td><td>0.0005</td>" in diff
    assert "weight_decay" not in diff  # the same in both runs
    loss = page.split('id="loss"')[1].split("</section>")[0]
    assert loss.count("<polyline") == 4  # two runs, training and validation each
    assert "a (validation)" in loss and "b (validation)" in loss
    assert main_report([str(a), str(b), "--metrics-file", str(a / "metrics.jsonl")]) == 2
    err = capsys.readouterr().err.strip()
    assert "--metrics-file applies to one run's report" in err and len(err.splitlines()) == 1
    assert main_report([str(a), str(tmp_path / "nope"), "-o", str(out)]) == 2
    assert "run directory not found" in capsys.readouterr().err
    with pytest.raises(ValueError, match="two or more"):
        write_comparison([a], out)


# ------------------------------------------------------------------ rendered in Chromium
# After load: per chart, its section, x axis range (plotly) or plot box (SVG), the largest x of
# its data, and for markers (timeline) how many lie inside the plot area.
CHART_PROBE = """<script>
window.addEventListener("load", () => setTimeout(() => {
  const charts = [];
  const inside = (r, box) => r.width > 0 && r.left + r.width / 2 >= box.left - 1 &&
      r.left + r.width / 2 <= box.right + 1 && r.top + r.height / 2 >= box.top - 1 &&
      r.top + r.height / 2 <= box.bottom + 1;
  for (const gd of document.querySelectorAll(".js-plotly-plot")) {
    const box = gd.querySelector(".bglayer .bg, .nsewdrag").getBoundingClientRect();
    const points = [...gd.querySelectorAll(".scatterlayer .point")];
    charts.push({section: gd.closest("section").id, kind: "plotly",
      range: gd._fullLayout.xaxis.range, type: gd._fullLayout.xaxis.type,
      xmax: Math.max(...gd.data.flatMap(t => (t.x || []).map(Number))),
      traces: gd.data.length, markers: points.length,
      inside: points.filter(p => inside(p.getBoundingClientRect(), box)).length});
  }
  for (const svg of document.querySelectorAll("section > svg")) {
    const frame = svg.querySelector("rect");
    if (!frame) continue;
    const box = frame.getBoundingClientRect();
    const circles = [...svg.querySelectorAll("circle")];
    const bottom = Number(frame.getAttribute("y")) + Number(frame.getAttribute("height")) + 15;
    const ticks = [...svg.querySelectorAll('text[text-anchor="middle"]')]
      .filter(t => Number(t.getAttribute("y")) === bottom && t.textContent.trim() !== "" &&
                   isFinite(Number(t.textContent)))
      .map(t => [Number(t.textContent), Number(t.getAttribute("x"))]);
    const xs = [...svg.querySelectorAll("polyline")].flatMap(
      p => p.getAttribute("points").split(" ").map(q => Number(q.split(",")[0])));
    charts.push({section: svg.closest("section").id, kind: "svg",
      frame: [Number(frame.getAttribute("x")),
              Number(frame.getAttribute("x")) + Number(frame.getAttribute("width"))],
      polyline_xmax: xs.length ? Math.max(...xs) : null, markers: circles.length, ticks: ticks,
      inside: circles.filter(c => inside(c.getBoundingClientRect(), box)).length});
  }
  const pre = document.createElement("pre");
  pre.id = "charts"; pre.textContent = JSON.stringify(charts);
  document.body.appendChild(pre);
}, 500));
</script>"""


def _charts(tmp_path: Path, page: Path) -> list[dict[str, Any]]:
    probe = page.with_name(page.stem + "_probe.html")
    probe.write_text(page.read_text().replace("</body>", CHART_PROBE + "</body>"))
    cmd = _chromium_cmd(tmp_path, "--dump-dom", probe.resolve().as_uri())
    dom = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=180).stdout
    match = re.search(r'<pre id="charts">(.*?)</pre>', dom, re.S)
    assert match, dom[-2000:]
    charts: list[dict[str, Any]] = json.loads(html.unescape(match.group(1)))
    return charts


def _reaches(chart: dict[str, Any], last: float) -> bool:
    """The chart's x axis ends at (or just past) ``last``: the run's last iteration is drawn."""
    if chart["kind"] == "plotly":
        lo, hi = (float(v) for v in chart["range"])
        return last <= hi <= last + 0.05 * (last - lo) + 1
    # SVG: the axis value at the frame's right edge, from two tick labels' positions.
    (v0, p0), (v1, p1) = chart["ticks"][0], chart["ticks"][-1]
    end = v0 + (chart["frame"][1] - p0) * (v1 - v0) / (p1 - p0)
    return math.isclose(end, last, rel_tol=1e-3)


needs_chromium = pytest.mark.skipif(
    _chromium() is None and not os.environ.get("STALWART_REQUIRE_CHROMIUM"),
    reason="chromium not installed (CI installs it and sets STALWART_REQUIRE_CHROMIUM)",
)


@pytest.mark.slow
@needs_chromium
@pytest.mark.parametrize("interactive", [True, False], ids=["plotly", "svg"])
def test_demo_report_timeline_has_its_events_and_every_chart_reaches_the_end(
    tmp_path: Path, interactive: bool
) -> None:
    if interactive:
        pytest.importorskip("plotly")
    run = tmp_path / "demo"
    demo_like_run(run)  # metrics end at 140, the events are at 150
    charts = _charts(tmp_path, write_report(run, pngs=False, interactive=interactive))
    (timeline,) = [c for c in charts if c["section"] == "timeline"]
    assert timeline["markers"] == 2 and timeline["inside"] == 2, timeline
    lines = [c for c in charts if c["section"] in ("loss", "learning-rate", "throughput")]
    assert len(lines) >= 4  # loss, lr, TFLOP/s, tokens/s, ms
    for chart in lines:
        assert _reaches(chart, LAST), chart


@pytest.mark.slow
@needs_chromium
def test_comparison_renders_every_run_in_chromium(tmp_path: Path) -> None:
    pytest.importorskip("plotly")
    a, b = tmp_path / "a", tmp_path / "b"
    demo_like_run(a)
    demo_like_run(b, lr=5e-4, last_logged=100)
    page = write_comparison([a, b], tmp_path / "cmp.html")
    charts = _charts(tmp_path, page)
    (loss,) = [c for c in charts if c["section"] == "loss"]
    assert loss["traces"] == 4 and loss["xmax"] == 140
    overlays = [c for c in charts if c["section"] in ("loss", "learning-rate", "throughput")]
    assert len(overlays) >= 5
    for chart in overlays:
        assert chart["traces"] >= 2 and _reaches(chart, LAST), chart


def test_straggler_section_shows_the_gpu_fields_per_rank(tmp_path: Path) -> None:
    run = tmp_path / "run"
    demo_like_run(run)
    gpu = [{"temperature_c": 61.0, "power_w": 650.5, "utilization_pct": 99.0, "clock_mhz": 1980.0},
           None, {"temperature_c": "hot"}]  # fmt: skip
    record = {"iteration": 140, "compute_ms": [10.0, 11.0, 10.5], "median_ms": 10.5,
              "min_ms": 10.0, "max_ms": 11.0, "slowest": [[1, 11.0]], "fastest": [[0, 10.0]],
              "stragglers": [], "threshold": 1.2, "gpu": gpu}  # fmt: skip
    (run / "straggler.jsonl").write_text(json.dumps(record) + "\n")
    page = write_report(run, pngs=False, interactive=False).read_text()
    section = page.split('id="stragglers"')[1].split("</section>")[0]
    assert "GPUs at the last report (NVML)" in section
    assert "<tr><td>0</td><td>61</td><td>650.5</td><td>99</td><td>1980</td></tr>" in section
    assert "<tr><td>2</td><td>n/a</td>" in section  # a hostile value is not rendered


def test_a_copied_run_directory_reads_its_own_metrics(tmp_path: Path) -> None:
    from stalwart.observability.run_dir import RunPaths

    run = tmp_path / "run"
    demo_like_run(run)
    RunPaths.for_run(run).write_manifest({"optim": {"lr": 1.0}})  # what the trainer records
    assert json.loads((run / "run.json").read_text())["metrics"] == "metrics.jsonl"
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    (copy / "metrics.jsonl").write_text(json.dumps({"split": "train", "iteration": 7}) + "\n")
    assert RunPaths.discover(copy).metrics == copy / "metrics.jsonl"
    elsewhere = tmp_path / "logs" / "m.jsonl"
    RunPaths.for_run(run, metrics_file=elsewhere).write_manifest()
    assert json.loads((run / "run.json").read_text())["metrics"] == str(elsewhere.resolve())
