from __future__ import annotations

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

from stalwart.cli.report import main_report
from stalwart.observability.run_dir import EventKind, RunPaths, append_event, timer_names
from stalwart.report.html import timer_stacks
from stalwart.report.run_report import load_run, write_report

SECTIONS = (
    'id="goodput"',
    'id="ettr"',
    'id="loss"',
    'id="grad-norm"',
    'id="learning-rate"',
    'id="throughput"',
    'id="timers"',
    'id="memory"',
    'id="stragglers"',
    'id="timeline"',
    'id="chaos"',
    'id="config"',
)


def make_run(run_dir: Path, iters: int = 60) -> None:
    """Synthetic artefacts shaped like the trainer's (metrics, straggler, memory, events, ...)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "metrics.jsonl", "w") as f:
        for it in range(1, iters + 1):
            row = {
                "split": "train",
                "iteration": it,
                "consumed_samples": it * 32,
                "loss": 10.0 * math.exp(-it / 20) + 2.0,
                "lm loss": 10.0 * math.exp(-it / 20) + 2.0,
                "lr": 3e-4 * min(1.0, it / 10),
                "grad_norm": 1.0,
                "elapsed_ms": 100.0 + (it % 7),
                "throughput_tflops_per_gpu": 150.0 + (it % 5),
                "forward-backward-time-ms": 70.0,  # --timing-log-level 2: parent and children
                "forward-compute-time-ms": 30.0,
                "backward-compute-time-ms": 30.0,
                "optimizer-time-ms": 20.0,
                "batch-generator-time-ms": 5.0,
                "mem-max-allocated-bytes": 3.0e9 + it * 1e6,
            }
            if it == 30:
                row["loss"] = None  # a non-finite loss is written as null
            f.write(json.dumps(row) + "\n")
        f.write(
            json.dumps({"split": "validation", "iteration": 50, "lm loss validation": 2.5}) + "\n"
        )
        f.write('{"torn line')
    with open(run_dir / "goodput.jsonl", "w") as f:  # two sessions, a restart between them
        t = 1_000_000.0
        for b, secs, s in [
            ("startup", 20, "a"),
            ("productive", 60, "a"),
            ("checkpoint", 2, "a"),
            ("restart", 15, "b"),
            ("lost_work", 5, "b"),
            ("productive", 40, "b"),
        ]:
            f.write(json.dumps({"k": "span", "b": b, "t0": t, "t1": t + secs, "s": s}) + "\n")
            t += secs  # fmt: skip
    with open(run_dir / "straggler.jsonl", "w") as f:
        for it in range(10, iters + 1, 10):
            ms = [50.0 + r for r in range(8)]
            ms[5] = 80.0 if it >= 30 else 52.0
            med = sorted(ms)[4]
            f.write(
                json.dumps(
                    {
                        "iteration": it,
                        "compute_ms": ms,
                        "median_ms": med,
                        "min_ms": min(ms),
                        "max_ms": max(ms),
                        "slowest": [[5, ms[5]]],
                        "fastest": [[0, 50.0]],
                        "stragglers": [5] if it >= 30 else [],
                        "threshold": 1.2,
                    }
                )
                + "\n"
            )
    (run_dir / "memory.json").write_text(
        json.dumps(
            {
                "theoretical": {
                    "weights_optimizer_bytes": 2.2e9,
                    "activation_bytes": 1.0e9,
                    "total_bytes": 3.2e9,
                    "num_parameters": 124_000_000,
                    "bytes_per_parameter": 18.0,
                    "breakdown": {"params_fp32": 4.96e8},
                },
                "measured": {"mem-max-allocated-bytes": 3.0e9, "mem-max-reserved-bytes": 3.5e9},
                "measured_source": "cuda-allocator",
                "measured_peak_bytes": 3.0e9,
                "theoretical_over_measured": 3.2 / 3.0,
            }
        )
    )
    append_event(run_dir, 30, EventKind.NAN, "loss is NaN")
    append_event(run_dir, 30, "skipped", "update skipped")
    append_event(run_dir, 31, EventKind.RERUN, "transient")
    append_event(run_dir, 40, EventKind.CHECKPOINT, "iter_0000040")
    append_event(run_dir, 45, EventKind.RESTART, "in-process restart")
    append_event(run_dir, 60, EventKind.EXIT, "train-iters reached")
    (run_dir / "exit_reason.json").write_text(json.dumps({"reason": "done", "exit_code": 0}))
    (run_dir / "chaos.json").write_text(
        json.dumps(
            {
                "passed": True,
                "faults": [
                    {"kind": "sigterm", "iteration": 20, "recovered": True},
                    {"kind": "nan", "iteration": 30, "recovered": True},
                ],
            }
        )
    )


def test_append_event_validates_kind(tmp_path: Path) -> None:
    rec = append_event(tmp_path, 3, EventKind.SKIPPED, "x")
    assert rec["kind"] == "skipped"
    with pytest.raises(ValueError, match="event kind must be one of"):
        append_event(tmp_path, 3, "explode")


def test_report_contains_every_section(tmp_path: Path) -> None:
    run = tmp_path / "run"
    make_run(run)
    art = load_run(run)
    assert len(art.metrics) == 60  # validation row and torn line dropped
    assert [r["iteration"] for r in art.validation] == [50]
    assert any("unreadable" in n for n in art.notes)
    assert main_report([str(run), "--static"]) == 0
    page = (run / "report.html").read_text()
    for section in SECTIONS:
        assert section in page
    assert "rank 5 (4)" in page  # flagged straggler, 4 reports
    assert "PASSED" in page and "<svg" in page and "<script" not in page
    assert "lm loss validation" in page  # the validation loss is on the loss chart
    assert "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert "https://" not in page
    pngs = {p.name for p in (run / "report").glob("*.png")}
    assert {"loss.png", "learning_rate.png", "throughput.png", "timers.png"} <= pngs


def test_interactive_report_inlines_plotly_from_the_package(tmp_path: Path) -> None:
    pytest.importorskip("plotly")
    from plotly.offline import get_plotlyjs

    run = tmp_path / "run"
    make_run(run)
    page = write_report(run, pngs=False).read_text()
    for section in SECTIONS:
        assert section in page
    assert "charts: interactive (plotly)" in page
    assert get_plotlyjs()[:2000] in page  # the installed plotly.js, inline
    assert page.count("Plotly.newPlot") >= 7  # loss, lr, throughput x2, timers, memory x2, ...
    # Nothing is loaded from anywhere: no external script, stylesheet, image or frame.
    assert not re.search(r"<(script|link|img|iframe)[^>]+(src|href)=", page)
    assert "lm loss validation" in page


def test_timer_breakdown_stacks_own_time_not_parents_on_children() -> None:
    rows = [
        {
            "iteration": 10,
            "forward-backward-time-ms": 70.0,
            "forward-compute-time-ms": 30.0,
            "backward-compute-time-ms": 30.0,
            "batch-generator-time-ms": 5.0,
            "optimizer-time-ms": 20.0,
            "optimizer-inner-step-time-ms": 15.0,
        }
    ]
    names = timer_names(rows)
    stacks = timer_stacks(rows, names)
    assert stacks["forward-backward (other)"] == [5.0]
    assert stacks["optimizer (other)"] == [5.0]
    assert stacks["forward-compute"] == [30.0] and stacks["optimizer-inner-step"] == [15.0]
    assert sum(v[0] for v in stacks.values()) == 90.0  # = the two top-level timers, not 175
    # Level 1 (no children logged): the parent is shown whole, under its own name.
    assert timer_stacks([{"forward-backward-time-ms": 70.0}], ["forward-backward-time-ms"]) == {
        "forward-backward": [70.0]
    }


def test_one_rank_heat_map_is_visible() -> None:
    from stalwart.report.svg import heat_colour

    assert heat_colour(1.0, 1.2) not in ("rgb(255,255,255)", "#fff", "#ffffff")
    assert heat_colour(1.5, 1.2) == "rgb(214,39,40)" and heat_colour(0.5, 1.2) == "rgb(49,130,189)"


def test_missing_artefacts_are_notes(tmp_path: Path) -> None:
    # A run that stopped before its first log line: no metrics, its exit reason.
    (tmp_path / "exit_reason.json").write_text('{"reason": "signal", "iteration": 0}')
    path = write_report(tmp_path, pngs=False)
    page = path.read_text()
    assert "metrics JSONL not found" in page and "straggler.jsonl not found" in page
    assert 'id="chaos"' not in page


@pytest.mark.parametrize("source", ["empty", "tensorboard", "comparison"])
def test_a_directory_without_run_artefacts_is_one_line_exit_2_and_writes_nothing(
    tmp_path: Path, source: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from stalwart.cli.main import main

    empty = tmp_path / "logs"
    empty.mkdir()
    if source == "tensorboard":
        (empty / "events.out.tfevents.1700000000.host.1.0").write_bytes(b"\x18\x00" * 64)
    if source == "comparison":
        run = tmp_path / "run"
        make_run(run)
        argv = ["report", str(run), str(empty), "-o", str(tmp_path / "compare.html")]
    else:
        argv = ["report", str(empty)]
    before = sorted(tmp_path.rglob("*"))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"stalwart report: error: {empty} holds no run artefacts: looked for ")
    assert "metrics.jsonl" in err and "goodput.jsonl" in err and "events.jsonl" in err
    assert ("TensorBoard's event files" in err) == (source == "tensorboard")
    assert sorted(tmp_path.rglob("*")) == before  # no report.html, no report/*.png


def test_metrics_file_outside_the_run_dir_found_through_the_manifest(tmp_path: Path) -> None:
    run = tmp_path / "save"
    make_run(run)
    elsewhere = tmp_path / "logs" / "train.jsonl"
    elsewhere.parent.mkdir()
    (run / "metrics.jsonl").rename(elsewhere)
    assert "metrics JSONL not found" in write_report(run, pngs=False).read_text()
    RunPaths.for_run(run, metrics_file=elsewhere).write_manifest()  # what the trainer records
    page = write_report(run, pngs=False, interactive=False).read_text()
    assert "60 metric rows" in page and "metrics JSONL not found" not in page
    assert 'id="loss"' in page and "Loss: not available" not in page
    (run / "run.json").write_text("\x00garbage{")  # an unreadable manifest is ignored
    assert RunPaths.discover(run).metrics == run / "metrics.jsonl"


def test_metrics_file_elsewhere(tmp_path: Path) -> None:
    run = tmp_path / "run"
    make_run(run)
    moved = tmp_path / "train_log.jsonl"
    (run / "metrics.jsonl").rename(moved)
    out = tmp_path / "r.html"
    assert main_report([str(run), "--metrics-file", str(moved), "-o", str(out), "--no-png"]) == 0
    assert "60 metric rows" in out.read_text()


def test_missing_run_dir_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main_report([str(tmp_path / "nope")]) == 2
    assert "run directory not found" in capsys.readouterr().err


def _chromium() -> str | None:
    for name in ("/usr/bin/chromium", "chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    return None


# Injected into a copy of the report: after load (and plotly's drawing), record each section's
# box and chart count, the page height and every resource the page requested.
LAYOUT_PROBE = """<script>
window.addEventListener("load", () => setTimeout(() => {
  const out = {sections: {}, height: document.documentElement.scrollHeight,
               resources: performance.getEntriesByType("resource").map(e => e.name),
               plotly: typeof Plotly};
  for (const s of document.querySelectorAll("section")) {
    const r = s.getBoundingClientRect();
    out.sections[s.id] = {x: r.left + scrollX, y: r.top + scrollY, w: r.width, h: r.height,
                          charts: s.querySelectorAll("svg.main-svg, svg").length};
  }
  const pre = document.createElement("pre");
  pre.id = "layout"; pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
}, 300));
</script>"""


def _chromium_cmd(tmp_path: Path, *extra: str) -> list[str]:
    return [
        str(_chromium()),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-extensions",
        "--force-device-scale-factor=1",
        "--hide-scrollbars",
        # Any host lookup fails: a page that needs the network renders broken, and the netlog
        # below shows the attempt.
        "--host-resolver-rules=MAP * ~NOTFOUND",
        "--virtual-time-budget=15000",
        f"--user-data-dir={tmp_path / 'profile'}",
        *extra,
    ]


def _layout(tmp_path: Path, page: Path) -> dict[str, Any]:
    netlog = tmp_path / "netlog.json"
    cmd = _chromium_cmd(tmp_path, f"--log-net-log={netlog}", "--dump-dom", page.as_uri())
    dom = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=180).stdout
    match = re.search(r'<pre id="layout">(.*?)</pre>', dom, re.S)
    assert match, dom[-2000:]
    layout: dict[str, Any] = json.loads(html.unescape(match.group(1)))
    layout["netlog_urls"] = _page_requests(netlog)
    return layout


def _page_requests(netlog: Path) -> list[str]:
    """URLs the page asked the network stack for (the browser's own update/time requests carry
    the initiator "not an origin"; a file:// page's requests carry "null")."""
    events = json.loads(netlog.read_text(errors="replace")).get("events", [])
    return sorted(
        {
            str(params["url"])
            for params in (e.get("params") or {} for e in events)
            if "url" in params and params.get("initiator", "not an origin") != "not an origin"
        }
    )


@pytest.mark.slow
@pytest.mark.skipif(
    _chromium() is None and not os.environ.get("STALWART_REQUIRE_CHROMIUM"),
    reason="chromium not installed (CI installs it and sets STALWART_REQUIRE_CHROMIUM)",
)
def test_network_check_sees_a_page_that_fetches(tmp_path: Path) -> None:
    page = tmp_path / "fetches.html"
    page.write_text(
        '<html><body><script src="https://cdn.example.com/x.js"></script>'
        + LAYOUT_PROBE.replace('document.querySelectorAll("section")', "[]")
        + "</body></html>"
    )
    layout = _layout(tmp_path, page)
    assert "https://cdn.example.com/x.js" in layout["netlog_urls"]


def _distinct_colours(img: Any) -> int:
    colours = img.convert("RGB").getcolors(maxcolors=1 << 18)
    return len(colours) if colours is not None else 1 << 18


@pytest.mark.slow
@pytest.mark.skipif(
    _chromium() is None and not os.environ.get("STALWART_REQUIRE_CHROMIUM"),
    reason="chromium not installed (CI installs it and sets STALWART_REQUIRE_CHROMIUM)",
)
@pytest.mark.parametrize("interactive", [True, False], ids=["plotly", "svg"])
def test_report_sections_render_in_headless_chromium(tmp_path: Path, interactive: bool) -> None:
    """Every section is laid out with a non-zero size and its screenshot crop is not blank; the
    page requests nothing but itself (no network)."""
    if interactive:
        pytest.importorskip("plotly")
    pil = pytest.importorskip("PIL.Image")
    run = tmp_path / "run"
    make_run(run)
    report = write_report(run, pngs=False, interactive=interactive)
    probe = tmp_path / "probe.html"
    probe.write_text(report.read_text().replace("</body>", LAYOUT_PROBE + "</body>"))
    layout = _layout(tmp_path, probe.resolve())
    external = [
        u
        for u in layout["resources"] + layout["netlog_urls"]
        if not u.startswith(("file:", "data:", "blob:", "about:", "chrome:"))
    ]
    assert external == [], external
    assert layout["plotly"] == ("object" if interactive else "undefined")
    sections = layout["sections"]
    assert set(sections) == {sid.split('"')[1] for sid in SECTIONS}
    height = min(int(layout["height"]) + 50, 16000)
    shot = tmp_path / "shot.png"
    cmd = _chromium_cmd(tmp_path, f"--screenshot={shot}", f"--window-size=1280,{height}")
    subprocess.run([*cmd, report.resolve().as_uri()], check=True, capture_output=True, timeout=180)
    with pil.open(shot) as img:
        assert _distinct_colours(img) > 50  # not blank
        for sid, box in sections.items():
            assert box["w"] > 100 and box["h"] > 40, (sid, box)
            if sid not in ("chaos", "config", "ettr"):  # a verdict, tables; the others: a chart
                assert box["charts"] >= 1, (sid, box)
            crop = img.crop(
                (int(box["x"]), int(box["y"]), int(box["x"] + box["w"]), int(box["y"] + box["h"]))
            )
            assert crop.size[0] > 0 and crop.size[1] > 0
            assert _distinct_colours(crop) > 8, sid  # something is drawn in it


def test_timeline_falls_back_to_metric_counters(tmp_path: Path) -> None:
    rows = [
        {"split": "train", "iteration": 10, "loss": 3.0, "skipped_iterations": 0},
        {
            "split": "train",
            "iteration": 20,
            "loss": 2.9,
            "skipped_iterations": 2,
            "nan_iterations": 1,
        },
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    page = write_report(tmp_path, pngs=False).read_text()
    assert "2 in the log interval ending here" in page
    assert "1 in the log interval ending here" in page


def test_a_missing_sections_hint_names_the_setting_as_the_runs_path_spells_it(
    tmp_path: Path,
) -> None:
    """A loop's run (no run.json settings) that logged no learning rate is told about
    ``Shell.record(learning_rate=...)``, not the CLI's metrics-file flags; a CLI run the flags."""
    loop = tmp_path / "loop"
    loop.mkdir()
    rows = [{"split": "train", "iteration": i, "loss": 2.0} for i in (1, 2)]
    (loop / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    page = write_report(loop, pngs=False, interactive=False).read_text()
    assert "Shell.record(learning_rate=...)" in page and "TimerConfig(timing_log_level" in page
    assert "--save or --metrics-file" not in page and "--timing-log-level" not in page
    empty = tmp_path / "cli"
    empty.mkdir()
    RunPaths.for_run(empty, metrics_file=None).write_manifest({"preset": "tiny"})
    page = write_report(empty, pngs=False, interactive=False).read_text()
    assert "--save or --metrics-file" in page and "ShellConfig" not in page
