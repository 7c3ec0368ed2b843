"""Benchmark: the trainer under full-iteration graphs with and without the speculative launch.

Runs ``stalwart train`` (graphs + optimizer graph, in-graph validation with the rerun state
machine) as subprocesses, alternating ``--cuda-graph-speculative-launch`` and
``--no-cuda-graph-speculative-launch`` for ``--rounds`` rounds, and reads the training log's
timestamps to time each of the last ``--windows`` log intervals (after capture). Prints
per-run values, the medians and the ratio; the final losses must agree (the launch is exact).
A third variant without in-graph checks (``--no-check-for-nan-in-loss-and-grad``) is the floor
that gives validation's cost inside the trainer.

    PYTHONPATH=src python3 bench/speculative_launch.py --preset tiny --json out.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
from datetime import datetime
from typing import Any

# The log line's timestamp and iteration: log steps sync (loss .item()), so consecutive lines
# bracket the GPU work of one log interval with microsecond resolution.
STAMP = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+)\] iteration\s+(\d+)/")
LOSS = re.compile(r"lm loss: ([0-9.E+-]+)")
VARIANTS = {
    "speculative": [],
    "no_speculative": ["--no-cuda-graph-speculative-launch"],
    # The floor: no in-graph checks, so no gated step, no read and no launch ahead.
    "no_validation": ["--no-check-for-nan-in-loss-and-grad"],
}


def run_trainer(preset: str, iters: int, log_interval: int, extra: list[str]) -> str:
    cmd = [
        sys.executable, "-m", "stalwart", "train", "--preset", preset, "--bf16",
        "--train-iters", str(iters), "--log-interval", str(log_interval), "--no-progress-bar",
        "--log-format", "megatron",
        "--eval-interval", "0", "--cuda-graph-impl", "full_iteration", "--optimizer-cuda-graph",
        *extra,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=os.environ)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return proc.stdout + proc.stderr


def interval_ms(log: str, windows: int) -> list[float]:
    """Milliseconds per iteration over each of the last ``windows`` log intervals."""
    stamps = [(datetime.fromisoformat(t), int(i)) for t, i in STAMP.findall(log)]
    stamps = stamps[-(windows + 1) :]
    return [
        (t1 - t0).total_seconds() * 1000.0 / (i1 - i0)
        for (t0, i0), (t1, i1) in itertools.pairwise(stamps)
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--iters", type=int, default=400)
    parser.add_argument("--log-interval", type=int, default=50)
    parser.add_argument("--windows", type=int, default=4, help="log intervals measured per run")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--extra", default="", help="more trainer flags, e.g. '--global-batch-size 32'"
    )
    args = parser.parse_args(argv)
    results: dict[str, list[float]] = {name: [] for name in VARIANTS}
    losses: dict[str, list[str]] = {name: [] for name in VARIANTS}
    for round_index in range(args.rounds):
        order = list(VARIANTS) if round_index % 2 == 0 else list(reversed(VARIANTS))
        for name in order:
            flags = VARIANTS[name] + args.extra.split()
            out = run_trainer(args.preset, args.iters, args.log_interval, flags)
            windows = interval_ms(out, args.windows)
            results[name].extend(windows)
            losses[name].append(LOSS.findall(out)[-1])
            shown = [round(w, 3) for w in windows]
            print(f"round {round_index} {name}: ms/iteration {shown}", flush=True)
    medians = {name: statistics.median(values) for name, values in results.items()}
    spread = {name: (min(values), max(values)) for name, values in results.items()}
    print(f"| {args.preset} | median ms/iteration | min–max | final lm loss |")
    print("|---|---|---|---|")
    for name in VARIANTS:
        low, high = spread[name]
        print(f"| {name} | {medians[name]:.3f} | {low:.3f}–{high:.3f} | {losses[name]} |")
    ratio = medians["no_speculative"] / medians["speculative"]
    print(f"- {args.preset}: speculative launch {ratio:.3f}x the trainer's iteration rate")
    for name in ("speculative", "no_speculative"):
        cost = medians[name] / medians["no_validation"] - 1
        print(f"- {args.preset}: validation cost in the trainer, {name}: {cost:+.1%}")
    # The launch is exact, so the variants may differ only as much as repeated runs of one
    # variant do (cuBLAS/cuDNN run-to-run variation at larger presets).
    finals = {name: [float(v) for v in values] for name, values in losses.items()}
    within = max(max(v) - min(v) for v in finals.values())
    between = abs(
        statistics.median(finals["speculative"]) - statistics.median(finals["no_speculative"])
    )
    print(f"- final loss: spread within a variant {within:.2e}, between medians {between:.2e}")
    if args.json:
        payload: dict[str, Any] = {"preset": args.preset, "results": results, "losses": losses}
        with open(args.json, "w") as fh:
            json.dump(payload, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
