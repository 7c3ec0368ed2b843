"""Benchmark: hang detection latency, torchrun restart-to-first-step, SIGTERM-to-exit (2 ranks, CPU).

Hang (``--repeats`` jobs): a tiny 2-rank gloo job under ``torchrun --max-restarts 1`` with
``--enable-ft --ft-timeouts step=<T>``; rank 1 sleeps inside ``step`` at iteration ``--hang-at``.

* detection: how long the ``step`` section had been open when the monitor declared the hang
  (``elapsed_s`` of ``ft_hang_rank1.json``); the target is timeout + 2 s.
* hang to kill: the fault marker's timestamp (written just before the sleep) to the hang report
  (written right after the SIGKILL; includes the stack dump).
* restart to first step: the kill to the first iteration logged by the restarted job (torchrun
  noticing the failure, stopping the other rank, new rendezvous, worker start-up with torch import,
  checkpoint load, one step).

SIGTERM (``--sigterm-repeats`` jobs, ``--sigterm-preset``): SIGTERM to torchrun after iteration 3 of
a job with ``--exit-signal-handler``; reports signal to checkpoint committed and signal to job end
(torchrun SIGKILLs workers 30 s after its SIGTERM).

    PYTHONPATH=src python3 bench/hang_restart.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TINY = ["--preset", "tiny", "--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "2",
        "--seq-length", "32", "--vocab-size", "512", "--micro-batch-size", "4",
        "--no-progress-bar", "--use-cpu", "--log-interval", "1", "--seed", "3",
        "--log-format", "megatron"]  # fmt: skip
ITERATION_RE = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+)\] iteration\s+(\d+)/")
SAVED_RE = re.compile(r"saved checkpoint iteration (\d+)")


def _env() -> dict[str, str]:
    src = str(REPO / "src")
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{src}:{path}" if path else src}


def _torchrun(nproc: int, extra: list[str], args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc), *extra, "-m", "stalwart", "train", *args]  # fmt: skip


def hang_once(workdir: Path, step_timeout: float, hang_at: int, train_iters: int) -> dict[str, Any]:
    save = workdir / "ckpt"
    args = [*TINY, "--train-iters", str(train_iters), "--global-batch-size", "8",
            "--save", str(save), "--save-interval", str(max(1, hang_at - 2)),
            "--enable-ft", "--ft-num-warmup-iters", "2",
            "--ft-timeouts", f"setup=120,step={step_timeout},checkpointing=120,out_of_section=60",
            "--inject-fault", "hang", "--inject-fault-iteration", str(hang_at),
            "--inject-fault-rank", "1"]  # fmt: skip
    cmd = _torchrun(2, ["--max-restarts", "1", "--monitor-interval", "0.1"], args)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"hang job failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    report_path = save / "ft_logs" / "ft_hang_rank1.json"
    report = json.loads(report_path.read_text())
    fired = json.loads(next(save.glob(".stalwart_fault_fired_hang_*")).read_text())["time"]
    killed = report_path.stat().st_mtime
    out = proc.stdout[proc.stdout.index("resumed from") :]
    first = ITERATION_RE.search(out)
    assert first is not None, "restarted job logged no iteration"
    first_step = datetime.strptime(first.group(1), "%Y-%m-%d %H:%M:%S.%f").timestamp()
    return {
        "detection_s": report["elapsed_s"],
        "hang_to_kill_s": killed - fired,
        "restart_to_first_step_s": first_step - killed,
    }


def sigterm_once(workdir: Path, preset: str, train_iters: int) -> dict[str, Any]:
    save = workdir / "ckpt"
    model = TINY if preset == "tiny-bench" else ["--preset", preset, "--use-cpu",
                                                  "--no-progress-bar", "--log-interval", "1",
                                                  "--log-format", "megatron",
                                                  "--micro-batch-size", "1", "--seq-length", "128"]  # fmt: skip
    args = [*model, "--train-iters", str(train_iters), "--save", str(save), "--exit-signal-handler"]
    proc = subprocess.Popen(_torchrun(2, [], args), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=_env(), cwd=REPO)  # fmt: skip
    sent: list[float] = []
    events: dict[str, float] = {}

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            m = ITERATION_RE.search(line)
            if m and int(m.group(2)) >= 3 and not sent:
                sent.append(time.monotonic())
                proc.send_signal(signal.SIGTERM)
            if sent and SAVED_RE.search(line) and "saved" not in events:
                events["saved"] = time.monotonic()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    proc.wait(timeout=300)
    ended = time.monotonic()
    reader.join(5)
    reason = json.loads((save / "exit_reason.json").read_text())
    if not sent or reason["reason"] != "signal":
        raise RuntimeError(f"no signal exit: {reason}")
    return {
        "signal_to_saved_s": events.get("saved", float("nan")) - sent[0],
        "signal_to_end_s": ended - sent[0],
        "iteration": reason["iteration"],
    }


def _stats(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def summarize(result: dict[str, Any]) -> list[str]:
    lines = ["| measurement | seconds, median (min-max) | runs |", "| --- | --- | --- |"]
    hang, t = result["hang"], result["step_timeout_s"]
    names = {
        "detection_s": f"hang detection (step timeout {t:g} s; target <= {t + 2:g} s)",
        "hang_to_kill_s": "hang start to SIGKILL of the worker (incl. stack dump)",
        "restart_to_first_step_s": "SIGKILL to first step of the restarted job",
    }
    for key, name in names.items():
        values = [r[key] for r in hang]
        if values:
            lines.append(f"| {name} | {_stats(values)} | {len(values)} |")
    term = result["sigterm"]
    for key, name in (("signal_to_saved_s", "SIGTERM to checkpoint committed"),
                      ("signal_to_end_s", "SIGTERM to job end (torchrun kills at 30 s)")):  # fmt: skip
        values = [r[key] for r in term]
        if values:
            label = f"{name}, {result['sigterm_preset']}"
            lines.append(f"| {label} | {_stats(values)} | {len(values)} |")
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3, help="hang jobs")
    p.add_argument("--step-timeout", type=float, default=2.0)
    p.add_argument("--hang-at", type=int, default=8)
    p.add_argument("--train-iters", type=int, default=10)
    p.add_argument("--sigterm-repeats", type=int, default=2)
    p.add_argument("--sigterm-preset", default="small", choices=("tiny-bench", "tiny", "small"))
    p.add_argument("--sigterm-iters", type=int, default=50)
    p.add_argument("--json", help="write raw results and the summary here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result: dict[str, Any] = {
        "step_timeout_s": args.step_timeout,
        "sigterm_preset": args.sigterm_preset,
        "hang": [],
        "sigterm": [],
    }
    with tempfile.TemporaryDirectory(prefix="stalwart_bench_hang_") as tmp:
        for i in range(args.repeats):
            run = hang_once(
                Path(tmp) / f"hang{i}", args.step_timeout, args.hang_at, args.train_iters
            )
            print(f"hang run {i}: {run}", flush=True)
            result["hang"].append(run)
        for i in range(args.sigterm_repeats):
            run = sigterm_once(Path(tmp) / f"term{i}", args.sigterm_preset, args.sigterm_iters)
            print(f"sigterm run {i}: {run}", flush=True)
            result["sigterm"].append(run)
    lines = summarize(result)
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps({**result, "summary": lines}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
