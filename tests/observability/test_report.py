from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from stalwart.cli.report import main_report
from stalwart.observability.report import EventKind, append_event, load_run, write_report

SECTIONS = (
    'id="loss"',
    'id="learning-rate"',
    'id="throughput"',
    'id="timers"',
    'id="memory"',
    'id="stragglers"',
    'id="timeline"',
    'id="chaos"',
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
                "forward-backward-time-ms": 70.0,
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
    assert any("unreadable" in n for n in art.notes)
    assert main_report([str(run)]) == 0
    page = (run / "report.html").read_text()
    for section in SECTIONS:
        assert section in page
    assert "rank 5 (4)" in page  # flagged straggler, 4 reports
    assert "PASSED" in page and "<svg" in page
    assert "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert "https://" not in page
    pngs = {p.name for p in (run / "report").glob("*.png")}
    assert {"loss.png", "learning_rate.png", "throughput.png", "timers.png"} <= pngs


def test_missing_artefacts_are_notes(tmp_path: Path) -> None:
    path = write_report(tmp_path, pngs=False)
    page = path.read_text()
    assert "metrics JSONL not found" in page and "straggler.jsonl not found" in page
    assert 'id="chaos"' not in page


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


@pytest.mark.slow
@pytest.mark.skipif(
    _chromium() is None and not os.environ.get("STALWART_REQUIRE_CHROMIUM"),
    reason="chromium not installed (CI installs it and sets STALWART_REQUIRE_CHROMIUM)",
)
def test_report_renders_in_headless_chromium(tmp_path: Path) -> None:
    run = tmp_path / "run"
    make_run(run)
    report = write_report(run, pngs=False)
    shot = tmp_path / "shot.png"
    cmd = [
        str(_chromium()),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}",
        f"--screenshot={shot}",
        "--window-size=1280,2000",
        report.resolve().as_uri(),
    ]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    assert shot.exists() and shot.stat().st_size > 20_000
    try:
        from PIL import Image
    except ImportError:  # pillow comes with matplotlib; the size check above still ran
        return
    with Image.open(shot) as img:
        colours = img.convert("RGB").getcolors(maxcolors=1 << 16)
    assert colours is None or len(colours) > 50  # not blank


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
