"""A relaunch under ``stalwart launch --fork-workers``, from the failure to the next first step,
with the launcher's pre-imports as they are against the same without ``torch._dynamo`` (what
the launcher imported before Dynamo was among `stalwart.cli.launch.RESTART_IMPORTS` for runs
without ``--compile``), the two alternated.

Each run: 2 gloo ranks, the tiny model, rank 1's loss NaN once at iteration 20 (``transient_error``:
exit 17, restart on the same devices). From the job's goodput ledger: the failed session's end
to the launcher's ``restart`` action (``failure -> action``), and that action to the relaunched
session's resume (``action -> resumed``); and the first launch's start-up (``startup``).

    PYTHONPATH=src python bench/launch_relaunch.py --repeats 3 --work-dir /tmp/relaunch

CPU only. Prints the median and range of each phase per variant.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

TRAIN = ["--preset", "tiny", "--num-layers", "1", "--hidden-size", "64", "--num-attention-heads",
         "2", "--seq-length", "32", "--vocab-size", "512", "--micro-batch-size", "4",
         "--global-batch-size", "8", "--lr-warmup-iters", "2", "--no-progress-bar", "--use-cpu",
         "--train-iters", "40", "--save-interval", "10", "--log-interval", "50",
         "--exit-signal-handler", "--enable-ft", "--ft-num-warmup-iters", "2", "--ft-timeouts",
         "setup=180,step=30,checkpointing=180,out_of_section=180", "--error-injection-rate", "1",
         "--error-injection-type", "transient_error", "--error-injection-iterations", "20",
         "--error-injection-once", "--error-injection-ranks", "1"]  # fmt: skip
# The launcher, optionally without a pre-import (this bench's only knob on it).
LAUNCHER = (
    "import sys\n"
    "import stalwart.cli.launch as launch\n"
    "drop = sys.argv[1]\n"
    "launch.RESTART_IMPORTS = tuple(n for n in launch.RESTART_IMPORTS if n != drop)\n"
    "from stalwart.cli.main import main\n"
    "raise SystemExit(main(['launch', *sys.argv[2:]]))\n"
)


def one_run(save: Path, drop: str) -> dict[str, float]:
    argv = ["--nproc-per-node", "2", "--devices", "dev-a,dev-b", "--max-restarts", "1",
            "--monitor-interval", "0.2", "--fork-workers", "--", *TRAIN, "--save", str(save)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-c", LAUNCHER, drop, *argv], env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)  # fmt: skip
    records = [json.loads(line) for line in (save / "goodput.jsonl").read_text().splitlines()]
    sessions = [r for r in records if r["k"] == "session"]
    end = next(r["t"] for r in records if r["k"] == "end")
    action = next(r["t"] for r in records if r["k"] == "action" and r["action"] == "restart")
    resumed = next(r["t"] for r in records if r["k"] == "resume")
    first = next(r for r in records if r["k"] == "span" and r["b"] == "startup")
    assert len(sessions) == 2, sessions
    return {"startup": first["t1"] - first["t0"], "failure -> action": action - end,
            "action -> resumed": resumed - action}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--work-dir", required=True, help="an empty or new directory")
    args = p.parse_args()
    work = Path(args.work_dir)
    variants = {"as now": "", "without torch._dynamo": "torch._dynamo"}
    got: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    for i in range(args.repeats):
        for name, drop in variants.items():
            got[name].append(one_run(work / f"{i}-{'now' if not drop else 'nodynamo'}", drop))
    for name, runs in got.items():
        cells = []
        for phase in runs[0]:
            values = [r[phase] for r in runs]
            cells.append(f"{phase} {statistics.median(values):.2f} s "
                         f"({min(values):.2f}-{max(values):.2f})")  # fmt: skip
        print(f"{name:<22} " + "; ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
