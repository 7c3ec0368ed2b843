"""bench/warm_restart.py reads a relaunch's figures from its goodput ledger (the runs themselves
compile for minutes on CPU: the command is in docs/benchmarks-inprocess.md)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import warm_restart  # type: ignore[import-not-found]
from stalwart.observability.goodput import Bucket, CompileSource, GoodputLedger


class FakeClock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_last_session_is_launch_to_the_end_of_its_last_compile_span(tmp_path: Path) -> None:
    clock = FakeClock(1000.0)
    for first_s in (30.0, 3.0):  # the faulted job, then the relaunch
        start = clock.t
        ledger = GoodputLedger(tmp_path, clock=clock, launcher_start=start, print_fn=lambda s: None)
        clock.t += 2.0  # start-up
        with ledger.step(1) as span:
            clock.t += first_s
            span.reclassify(Bucket.COMPILE, CompileSource.WARM)
        with ledger.span(Bucket.COMPILE, CompileSource.SAVE):
            clock.t += 0.5
        with ledger.step(2):
            clock.t += 1.0
        ledger.close("fault")
        clock.t += 5.0
    result = warm_restart.last_session(tmp_path)
    assert result["to_first_productive_s"] == 2.0 + 3.0 + 0.5
    assert result["startup_s"] == 2.0
    assert result["compile_sources"] == {"warm": 3.0, "save": 0.5}
    table = warm_restart.summary_table({"cold": [result], "warm": [result]})
    assert "| warm | 5.50 | 5.50-5.50 | 5.50 | 3.50 | warm 3.00, save 0.50 |" in table
    # --launch: from the fault (the failed session's last span ended 5 s before the relaunch).
    from_fault = warm_restart.last_session(tmp_path, from_fault=True)
    assert from_fault["to_first_productive_s"] == 5.0 + 2.0 + 3.0 + 0.5
    assert from_fault["startup_s"] == 5.0 + 2.0


def test_the_phase_timers_time_a_real_start_up(tmp_path: Path) -> None:
    """bench/startup_phases.py runs `stalwart train` with a timer around each start-up part;
    every part it names exists (a moved function would silently leave its phase out)."""
    import json
    import os
    import subprocess

    from train_utils import REPO, TINY_FLAGS

    out = tmp_path / "phases.json"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(REPO / "bench" / "startup_phases.py"), "--out", str(out), "--",
           "train", *TINY_FLAGS, "--train-iters", "2", "--save", str(tmp_path / "run")]  # fmt: skip
    done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["missing"] == []
    spans = {s["phase"]: s for s in result["spans"]}
    for phase in ("import torch", "trainer build (all)", "  model: build, DDP, torch.compile wrapper",
                  "checkpoint load (--load)", "first iteration (warm compile, capture)"):  # fmt: skip
        assert spans[phase]["end"] >= spans[phase]["start"] >= 0.0, phase
    build, model = spans["trainer build (all)"], spans["  model: build, DDP, torch.compile wrapper"]
    assert build["start"] <= model["start"] <= model["end"] <= build["end"]  # nested by time
    assert spans["first iteration (warm compile, capture)"]["start"] >= build["end"]


def test_the_phase_table_sums_a_phase_timed_twice_and_takes_medians() -> None:
    def run(scale: float) -> dict[str, object]:
        return {"phases": [
            {"phase": "import torch", "start": 0.0, "end": 2.0 * scale, "cpu": 1.0},
            {"phase": "cli", "start": 2.0, "end": 2.5, "cpu": 0.1},
            {"phase": "cli", "start": 2.5, "end": 3.0, "cpu": 0.1},
            {"phase": "interpreter start", "start": -0.1, "end": 0.0},
        ]}  # fmt: skip

    table = warm_restart.phase_table({"warm": [run(1.0), run(2.0), run(3.0)]})
    lines = table.splitlines()
    assert lines[2] == "| interpreter start | 0.10 | - |"
    assert "| import torch | 4.00 | 1.00 |" in lines
    assert "| cli | 1.00 | 0.20 |" in lines


def test_without_a_compile_span_the_first_iteration_ends_the_measure(tmp_path: Path) -> None:
    # Dynamo loaded precompiled frames (TORCH_CACHING_PRECOMPILE=1): torch's counters saw no
    # compile, the first iteration is booked productive; it is where the code was loaded.
    clock = FakeClock(1000.0)
    ledger = GoodputLedger(tmp_path, clock=clock, launcher_start=1000.0, print_fn=lambda s: None)
    clock.t += 2.0
    with ledger.step(3):
        clock.t += 0.75
    with ledger.span(Bucket.CHECKPOINT):  # a productive span next to it would merge with it
        clock.t += 0.5
    with ledger.step(4):
        clock.t += 0.25
    ledger.close("finished")
    result = warm_restart.last_session(tmp_path)
    assert result["to_first_productive_s"] == 2.75 and result["compile_s"] == 0
