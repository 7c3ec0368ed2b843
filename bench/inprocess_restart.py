"""Benchmark: recovery time of in-process restart vs a torchrun restart of the same job.

Both variants run the same 2-rank job under ``torchrun --standalone`` with an exception injected
on rank 1 at iteration ``--fault-iteration`` (checkpoints every ``--save-interval``):

* ``inprocess``: ``--inprocess-restart`` (torchrun ``--max-restarts 0``): the processes stay,
  the failed attempt is aborted/finalized and the trainer is rebuilt in-process;
* ``torchrun``: no in-process restart, torchrun ``--max-restarts 1``: the agent tears the worker
  group down and starts fresh processes (new interpreters, ``import torch``, new process group).

Measured: wall time from the fault (arrival of rank 1's ``FAULT INJECTION`` line) to the first
completed iteration after recovery (arrival of the first iteration log line of rank 0 after the
``resumed from`` line; ``--log-interval 1``). Output is unbuffered and read from one merged pipe;
each variant runs ``--repeats`` times and the median is reported.

    PYTHONPATH=src .venv/bin/python bench/inprocess_restart.py --repeats 3 [--json out.json]

Device: CPU + gloo by default (``--use-cpu``); pass ``--gpu`` on a machine with 2 GPUs (NCCL).
``--compile`` compiles the model (the in-process restart keeps the compiled code; a torchrun
restart loads it from ``<save>/compile_cache``); ``--variants inprocess`` runs one variant;
``--nproc-per-node 1`` one rank (one GPU); the trainer's own flags go after ``--``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MODEL = ["--preset", "tiny", "--num-layers", "2", "--hidden-size", "128",
         "--num-attention-heads", "4", "--seq-length", "64", "--vocab-size", "1024",
         "--micro-batch-size", "4", "--global-batch-size", "8", "--lr", "1e-3",
         "--lr-warmup-iters", "2", "--log-interval", "1", "--no-progress-bar", "--seed", "3"]  # fmt: skip
ITER_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+")


def _command(variant: str, save: Path, args: argparse.Namespace) -> list[str]:
    restarts = "0" if variant == "inprocess" else "1"
    nproc = args.nproc_per_node
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(nproc), "--max-restarts", restarts, "-m", "stalwart", "train", *MODEL,
           *args.trainer_flags, "--train-iters", str(args.train_iters), "--save", str(save),
           "--save-interval", str(args.save_interval), "--inject-fault", "exception",
           "--inject-fault-iteration", str(args.fault_iteration),
           "--inject-fault-rank", str(nproc - 1)]  # fmt: skip
    if not args.gpu:
        cmd.append("--use-cpu")
    if args.compile:  # the compile cache goes to <save>/compile_cache
        cmd.append("--compile")
    if variant == "inprocess":
        cmd.append("--inprocess-restart")
    return cmd


def run_once(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """One job; returns fault->first-iteration seconds and the job's total wall time."""
    save = Path(tempfile.mkdtemp(prefix=f"stalwart-bench-{variant}-"))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO / "src")}  # fmt: skip
    started = time.monotonic()
    t_fault = t_resumed = t_first = None
    first_iteration = None
    proc = subprocess.Popen(
        _command(variant, save, args),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=REPO,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        now = time.monotonic()
        if t_fault is None and "FAULT INJECTION" in line:
            t_fault = now
        elif t_fault is not None and t_resumed is None and line.startswith("resumed from"):
            t_resumed = now
        elif t_resumed is not None and t_first is None and (m := ITER_LINE.search(line)):
            t_first, first_iteration = now, int(m.group(1))
    rc = proc.wait()
    shutil.rmtree(save, ignore_errors=True)
    if rc != 0 or t_fault is None or t_first is None or t_resumed is None:
        raise RuntimeError(f"{variant}: rc={rc}, fault={t_fault}, first={t_first}")
    return {
        "variant": variant,
        "fault_to_first_iteration_s": t_first - t_fault,
        "fault_to_resumed_s": t_resumed - t_fault,
        "first_iteration_after_recovery": first_iteration,
        "job_wall_s": time.monotonic() - started,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    trainer_flags: list[str] = []
    if "--" in argv:  # the trainer's own flags (later ones win over MODEL's)
        argv, trainer_flags = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--train-iters", type=int, default=12)
    p.add_argument("--save-interval", type=int, default=4)
    p.add_argument("--fault-iteration", type=int, default=6)
    p.add_argument("--gpu", action="store_true", help="NCCL on 2 GPUs instead of CPU + gloo")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (--compile)")
    p.add_argument("--variants", default="inprocess,torchrun", help="comma-separated subset")
    p.add_argument("--json", help="write all runs and the summary here")
    p.add_argument("--nproc-per-node", type=int, default=2, help="ranks (the last one faults)")
    args = p.parse_args(argv)
    args.trainer_flags = trainer_flags
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in args.variants.split(",")}
    for i in range(args.repeats):
        for variant in runs:  # interleaved, so machine load drifts affect both alike
            result = run_once(variant, args)
            runs[variant].append(result)
            print(f"run {i + 1} {variant:9s}: fault -> first iteration "
                  f"{result['fault_to_first_iteration_s']:.2f}s "
                  f"(-> resumed {result['fault_to_resumed_s']:.2f}s)", flush=True)  # fmt: skip
    med = {
        v: statistics.median(r["fault_to_first_iteration_s"] for r in rs) for v, rs in runs.items()
    }
    ratio = med["inprocess"] / med["torchrun"] if len(med) == 2 else float("nan")
    print("\n| variant | fault -> first completed iteration after recovery (median s) | runs |")
    print("|---|---|---|")
    for v, rs in runs.items():
        all_s = ", ".join(f"{r['fault_to_first_iteration_s']:.2f}" for r in rs)
        print(f"| {v} | {med[v]:.2f} | {all_s} |")
    if len(med) == 2:
        verdict = "meets" if ratio <= 0.25 else "misses"
        print(f"\nin-process / torchrun = {ratio:.1%} ({verdict} the 25% target)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs, "median_s": med, "ratio": ratio}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
