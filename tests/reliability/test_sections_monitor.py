"""The monitor process: kills a hung worker, leaves a healthy one alone, exits with its worker.

Workers are plain Python subprocesses that never import torch (startup ~0.1 s).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

SRC = str(Path(__file__).resolve().parents[2] / "src")

WORKER = textwrap.dedent(
    """
    import os, sys, time
    from stalwart.reliability.hang.sections import (
        FaultToleranceConfig, Section, SectionTimeouts, build_section_monitor,
    )

    save_dir, scenario = sys.argv[1], sys.argv[2]
    timeouts = SectionTimeouts(setup=1.0, step=1.0, checkpointing=1.0, out_of_section=1.0)
    if scenario != "setup_hang":
        timeouts = SectionTimeouts(setup=5.0, step=1.0, checkpointing=1.0, out_of_section=1.0)
    cfg = FaultToleranceConfig(
        enable_ft=True, timeouts=timeouts, ft_num_warmup_iters=1, poll_interval_s=0.05,
        stack_dump_wait_s=0.5,
    )
    mon = build_section_monitor(cfg, rank=3, save_dir=save_dir)
    print(mon.monitor_pid, flush=True)

    def tear_the_record():
        # What a worker frozen half-way through a write, or anything scribbling on /dev/shm,
        # leaves behind: no byte of the record can be trusted. The monitor (polling every
        # 50 ms) has seen the current record first.
        time.sleep(0.2)
        with open(mon.heartbeat_path, "r+b") as f:
            f.write(bytes([255]) * os.path.getsize(mon.heartbeat_path))

    def stuck_in_the_step():
        time.sleep(30)

    if scenario == "setup_hang":
        time.sleep(30)
    for i in range(4):
        with mon.step_section():
            if scenario == "step_hang" and i == 2:
                stuck_in_the_step()
            if scenario == "torn_step_hang" and i == 2:
                tear_the_record()
                stuck_in_the_step()
            time.sleep(0.02)
        if scenario == "oos_hang" and i == 2:
            time.sleep(30)
        if scenario == "torn_oos_hang" and i == 2:
            tear_the_record()
            time.sleep(30)
        with mon.section(Section.CHECKPOINTING):
            time.sleep(0.01)
    if scenario == "crash":
        os._exit(7)
    mon.close()
    print("clean", flush=True)
    """
)


def _start(tmp_path: Path, scenario: str) -> tuple[subprocess.Popen[str], int]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "save"), scenario],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    monitor_pid = int(proc.stdout.readline())
    return proc, monitor_pid


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _gone(pid):
            return True
        time.sleep(0.05)
    return _gone(pid)


@pytest.mark.parametrize(
    ("scenario", "section"),
    [
        ("step_hang", "step"),
        ("oos_hang", "out_of_section"),
        ("setup_hang", "setup"),
        # An unreadable record counts as no progress: the last valid one keeps ageing.
        ("torn_step_hang", "step"),
        ("torn_oos_hang", "out_of_section"),
    ],
)
def test_hung_worker_is_killed_with_report_and_stack(
    tmp_path: Path, scenario: str, section: str
) -> None:
    proc, monitor_pid = _start(tmp_path, scenario)
    # From the monitor's start (the worker's interpreter start-up, seconds on a loaded machine,
    # is not the monitor's latency): everything before the hang takes < 0.5 s, the timeout is
    # 1 s, the stack dump waits 0.5 s; budget 4 s.
    started = time.monotonic()
    try:
        proc.wait(timeout=4.0)
    finally:
        proc.kill()
    elapsed = time.monotonic() - started
    assert proc.returncode == -9
    assert elapsed < 4.0
    assert _wait_gone(monitor_pid, 2.0)
    logs = tmp_path / "save" / "ft_logs"
    log = (logs / "monitor_rank3.log").read_text()
    assert "rank 3" in log and f"section '{section}'" in log and "open for" in log
    assert "Current thread" in log or "Thread 0x" in log  # faulthandler's dump was copied in
    if scenario == "step_hang":
        assert "stuck_in_the_step" in log
    report = json.loads((logs / "ft_hang_rank3.json").read_text())
    assert report["rank"] == 3 and report["section"] == section
    assert report["elapsed_s"] >= report["timeout_s"] == 1.0
    assert "HANG" in (proc.stderr.read() if proc.stderr else "")
    if scenario.startswith("torn"):
        assert "unreadable; counting it as no progress" in log
        assert "monitor stops" not in log


def test_healthy_worker_is_not_killed_and_monitor_stops(tmp_path: Path) -> None:
    proc, monitor_pid = _start(tmp_path, "healthy")
    out, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    assert "clean" in out
    assert _wait_gone(monitor_pid, 2.0)
    assert not (tmp_path / "save" / "ft_logs" / "ft_hang_rank3.json").exists()


def test_monitor_exits_when_worker_dies(tmp_path: Path) -> None:
    proc, monitor_pid = _start(tmp_path, "crash")
    proc.communicate(timeout=10)
    assert proc.returncode == 7
    assert _wait_gone(monitor_pid, 2.0)
    assert not (tmp_path / "save" / "ft_logs" / "ft_hang_rank3.json").exists()


def test_absurd_ft_state_is_rejected_in_one_line_and_the_job_runs(tmp_path: Path) -> None:
    """A parseable ft_state.json with 1 ms learned timeouts must not make the watchdog kill the
    job it guards (on main the monitor killed every attempt during setup)."""
    from dist_utils import run_cli_on_ranks
    from train_utils import TINY_FLAGS

    save = tmp_path / "ckpt"
    save.mkdir()
    absurd = {"setup": 0.001, "step": 0.001, "checkpointing": 0.001, "out_of_section": 0.001}
    (save / "ft_state.json").write_text(
        json.dumps({"version": 1, "timeouts": absurd, "calculated_sections": sorted(absurd)})
    )
    args = ["train", *TINY_FLAGS, "--train-iters", "3", "--save", str(save), "--enable-ft"]
    # One fresh process forked from the fork server (no torch import), as `python -m stalwart`.
    proc = run_cli_on_ranks([*args, "--ft-num-warmup-iters", "1"], tmp_path / "logs", world_size=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if "rejected learned timeouts" in line]
    assert len(lines) == 1, proc.stderr
    for key in absurd:
        assert f"{key} (0.001 s is below the 30 s floor" in lines[0]
    assert not (save / "ft_logs" / "ft_hang_rank0.json").exists()


def test_monitor_stops_at_once_after_the_closing_record_not_at_its_next_poll(
    tmp_path: Path,
) -> None:
    """Every rank's exit reaps its monitor: with a 30 s poll, stop() would wait out the poll
    (up to --poll seconds of every restart); the wake pipe ends the wait at the closing record."""
    import signal as signals

    from stalwart.reliability.hang import monitor as hb
    from stalwart.reliability.hang.monitor_client import MonitorClient

    client = MonitorClient(
        0, str(tmp_path), poll_s=30.0, dump_signal=int(signals.SIGUSR2), dump_wait_s=0.1,
        term_grace_s=0.0,
    )  # fmt: skip
    huge = (1e6, 1e6, 1e6, 1e6)
    now = time.monotonic()
    client.publish(0, 0, now, now, huge)
    client.start()
    monitor_pid = client.pid
    time.sleep(0.5)  # the monitor is in its 30 s pause
    client.publish(0, hb.FLAG_CLOSED, now, time.monotonic(), huge)
    started = time.monotonic()
    status = client.stop(timeout_s=20.0)
    assert time.monotonic() - started < 5.0
    assert status == int(hb.MonitorExit.WORKER_CLOSED)
    assert monitor_pid is not None and not psutil.pid_exists(monitor_pid)
