"""Hang escalation in tiers: soft (goodput fault record, stacks, NCCL flight recorder), hard
(abort the process groups), kill; the timeout hierarchy; evaluation steps apart from training.

Workers are plain Python subprocesses (no torch) except the one that owns a process group.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from stalwart.cli.main import main
from stalwart.observability.goodput.reader import read_ledger
from stalwart.observability.goodput.records import GOODPUT_FILE, RecordKind
from stalwart.reliability.hang.sections import (
    FaultToleranceConfig,
    SectionMonitor,
    SectionTimeouts,
)

SRC = str(Path(__file__).resolve().parents[2] / "src")

WORKER = textwrap.dedent(
    """
    import os, sys, time
    from stalwart.reliability.hang.sections import (
        FaultToleranceConfig, SectionTimeouts, build_section_monitor,
    )

    save_dir, with_group = sys.argv[1], sys.argv[2] == "group"
    if with_group:  # a process group for the hard tier to abort
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"file://{save_dir}/pg", rank=0, world_size=1)
    timeouts = SectionTimeouts(setup=60.0, step=1.0, checkpointing=60.0, out_of_section=60.0)
    cfg = FaultToleranceConfig(enable_ft=True, timeouts=timeouts, ft_num_warmup_iters=1,
                               poll_interval_s=0.05, stack_dump_wait_s=0.5, abort_grace_s=1.0)
    mon = build_section_monitor(cfg, rank=3, save_dir=save_dir,
                                goodput_file=os.path.join(save_dir, "goodput.jsonl"))
    print("ready", flush=True)

    def stuck_in_the_step():
        time.sleep(60)

    for i in range(3):
        with mon.step_section():
            if i == 2:
                stuck_in_the_step()
            time.sleep(0.02)
    """
)


def _run_worker(tmp_path: Path, mode: str, env: dict[str, str] | None = None) -> tuple[float, Path]:
    save = tmp_path / "save"
    save.mkdir()
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    full_env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(save), mode], stdout=subprocess.PIPE, text=True,
        stderr=subprocess.DEVNULL, env={**full_env, **(env or {})},
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    started = time.monotonic()
    proc.wait(timeout=30)
    elapsed = time.monotonic() - started
    assert proc.returncode == -9
    # The monitor writes its report last, after the kill: on a loaded machine the test can see
    # the worker gone before the monitor's last lines and its report are on disk.
    report = save / "ft_logs" / "ft_hang_rank3.json"
    deadline = time.monotonic() + 15.0
    while not report.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return elapsed, save / "ft_logs"


def test_soft_tier_writes_its_dump_and_the_fault_record_before_the_kill(tmp_path) -> None:
    elapsed, logs = _run_worker(tmp_path, "plain")
    assert elapsed < 1.0 + 0.05 + 0.5 + 1.5  # timeout + poll + dump wait, no abort grace
    stacks = logs / "stacks_rank3.txt"
    assert "stuck_in_the_step" in stacks.read_text()  # every thread's stack, in the run dir
    report_path = logs / "ft_hang_rank3.json"
    report = json.loads(report_path.read_text())
    assert stacks.stat().st_mtime <= report_path.stat().st_mtime  # the report follows the kill
    assert report["tiers"] == ["soft", "hard", "kill"] and report["section"] == "step"
    log = (logs / "monitor_rank3.log").read_text()
    assert "no NCCL flight recorder" in log and "hard tier" not in log  # nothing to abort
    (fault,) = [r for r in read_ledger(tmp_path / "save" / GOODPUT_FILE).records
                if getattr(r, "kind", None) is RecordKind.FAULT]  # fmt: skip
    assert fault.get("cause") == "hang" and fault.t <= report["detected"] + 0.01


def test_hard_tier_aborts_the_process_group_then_kills(tmp_path) -> None:
    elapsed, logs = _run_worker(tmp_path, "group")
    log = (logs / "monitor_rank3.log").read_text()
    assert "hard tier: aborted the worker's process groups" in log
    assert "killed worker" in log  # the hung rank sleeps on: the kill tier ends it
    assert elapsed < 1.0 + 0.05 + 0.5 + 1.0 + 1.5


def test_soft_tier_asks_the_nccl_flight_recorder_through_its_pipe(tmp_path) -> None:
    """ProcessGroupNCCL's watchdog reads ``<TORCH_NCCL_DEBUG_INFO_PIPE_FILE><rank>.pipe`` and
    dumps to ``<TORCH_NCCL_DEBUG_INFO_TEMP_FILE><rank>``; a thread plays it here (no NCCL)."""
    fr = tmp_path / "fr"
    fr.mkdir()
    pipe, dump = fr / "trace_rank3.pipe", fr / "dump_rank3"
    os.mkfifo(pipe)

    def watchdog() -> None:
        with open(pipe, "rb") as f:
            if f.read(1):
                dump.write_bytes(b"\x80flight-recorder")

    threading.Thread(target=watchdog, daemon=True).start()
    env = {"TORCH_NCCL_DEBUG_INFO_PIPE_FILE": str(fr / "trace_rank"),
           "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(fr / "dump_rank")}  # fmt: skip
    _, logs = _run_worker(tmp_path, "plain", env)
    assert dump.exists()
    assert f"NCCL flight recorder dumped to {dump}" in (logs / "monitor_rank3.log").read_text()


def test_evaluation_steps_are_not_learned_into_the_step_timeout(tmp_path) -> None:
    """Quirk kept from the fault-tolerance design: evaluation steps fed the learned step
    timeout. Now they size their own (>= the step timeout) and count as no timed step."""
    cfg = FaultToleranceConfig(enable_ft=True, ft_num_warmup_iters=1, safety_factor=5.0,
                               timeouts=SectionTimeouts(step=0.5))  # fmt: skip
    mon = SectionMonitor(cfg, 0, timeouts=cfg.timeouts, calculated=frozenset(), save_dir=tmp_path)
    try:
        with mon.step_section():  # train warm-up
            pass
        with mon.step_section():
            time.sleep(0.01)
        mon.start_evaluation()
        with mon.step_section(is_eval=True):  # eval warm-up: 0.2 s
            time.sleep(0.2)
        with mon.step_section(is_eval=True):
            assert mon._eval_step_timeout() >= 5 * 0.2  # what the monitor enforces now
            time.sleep(0.05)
        assert mon._num_timed_steps == 1 and mon._max["step"] < 0.1
        assert mon._eval_step_timeout() == pytest.approx(5 * mon._eval_max)
    finally:
        mon.close()


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--ft-timeouts", "step=600"], ("--ft-timeouts step=600", "--distributed-timeout-minutes")),
        (["--ft-timeouts", "step=50", "--distributed-timeout-minutes", "0.5"],
         ("--ft-timeouts step=50", "--distributed-timeout-minutes (0.5 min = 30 s)")),
        (["--ft-timeouts", "step=30", "--inprocess-restart", "--inprocess-soft-timeout", "40",
          "--inprocess-hard-timeout", "50"],
         ("--inprocess-soft-timeout 40", "--ft-timeouts step=30")),
    ],
)  # fmt: skip
def test_unreachable_tier_is_refused_at_start_up(tmp_path, capsys, flags, named) -> None:
    code = main(["train", "--use-cpu", "--save", str(tmp_path / "ckpt"), "--enable-ft", *flags])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and all(n in err for n in named), err


def test_flight_recorder_env_is_set_before_the_process_group_and_users_win(
    tmp_path, monkeypatch
) -> None:
    from stalwart.reliability.hang.monitor_client import (
        enable_flight_recorder,
        flight_recorder_paths,
    )

    for name in ("TORCH_NCCL_DEBUG_INFO_PIPE_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
                 "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    assert flight_recorder_paths(2) == {}
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "50")  # the user's choice
    enable_flight_recorder(str(tmp_path / "ft_logs"))
    prefix = str(tmp_path / "ft_logs" / "nccl_trace_rank")
    assert os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "50"
    assert os.environ["TORCH_NCCL_DEBUG_INFO_PIPE_FILE"] == prefix
    assert flight_recorder_paths(2) == {
        "--nccl-pipe": f"{prefix}2.pipe",
        "--nccl-dump": f"{prefix}2",
    }
