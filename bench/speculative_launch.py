"""Benchmark: the trainer under full-iteration graphs with and without the speculative launch.

Runs ``stalwart train`` (graphs + optimizer graph, in-graph validation with the rerun state
machine) as subprocesses, alternating ``--cuda-graph-speculative-launch`` and
``--no-cuda-graph-speculative-launch`` for ``--rounds`` rounds, and reads the training log's
"elapsed time per iteration (ms)" of the last ``--windows`` log intervals (after capture). Prints
per-run values, the medians and the ratio; the final losses must agree (the launch is exact).

    PYTHONPATH=src python3 bench/speculative_launch.py --preset tiny --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from typing import Any

ELAPSED = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")
LOSS = re.compile(r"lm loss: ([0-9.E+-]+)")
VARIANTS = {"speculative": [], "no_speculative": ["--no-cuda-graph-speculative-launch"]}


def run_trainer(preset: str, iters: int, log_interval: int, extra: list[str]) -> str:
    cmd = [
        sys.executable, "-m", "stalwart", "train", "--preset", preset, "--bf16",
        "--train-iters", str(iters), "--log-interval", str(log_interval), "--no-progress-bar",
        "--eval-interval", "0", "--cuda-graph-impl", "full_iteration", "--optimizer-cuda-graph",
        *extra,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=os.environ)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return proc.stdout + proc.stderr


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--iters", type=int, default=400)
    parser.add_argument("--log-interval", type=int, default=50)
    parser.add_argument("--windows", type=int, default=4, help="log intervals measured per run")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    results: dict[str, list[float]] = {name: [] for name in VARIANTS}
    losses: dict[str, list[str]] = {name: [] for name in VARIANTS}
    for round_index in range(args.rounds):
        order = list(VARIANTS) if round_index % 2 == 0 else list(reversed(VARIANTS))
        for name in order:
            out = run_trainer(args.preset, args.iters, args.log_interval, VARIANTS[name])
            windows = [float(v) for v in ELAPSED.findall(out)][-args.windows :]
            results[name].extend(windows)
            losses[name].append(LOSS.findall(out)[-1])
            print(f"round {round_index} {name}: ms/iteration {windows}", flush=True)
    medians = {name: statistics.median(values) for name, values in results.items()}
    spread = {name: (min(values), max(values)) for name, values in results.items()}
    print(f"| {args.preset} | median ms/iteration | min–max | final lm loss |")
    print("|---|---|---|---|")
    for name in VARIANTS:
        low, high = spread[name]
        print(f"| {name} | {medians[name]:.3f} | {low:.3f}–{high:.3f} | {losses[name]} |")
    ratio = medians["no_speculative"] / medians["speculative"]
    print(f"- {args.preset}: speculative launch {ratio:.3f}x the trainer's iteration rate")
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
