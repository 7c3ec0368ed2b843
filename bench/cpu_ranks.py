"""Iteration time of the reference trainer on CPU with 1 and 2 ranks (torchrun + gloo), same job.

Both runs train the same global batch (``--global-batch-size``) of the ``tiny`` preset; the 1-rank run
accumulates twice as many micro-batches. Reads ``elapsed_ms`` from the metrics file (interval means,
first interval dropped as warm-up) and prints the median and spread per world size.

    python bench/cpu_ranks.py --iters 24 --seq-length 256
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def run(world: int, args: argparse.Namespace, tmp: str) -> list[float]:
    metrics = os.path.join(tmp, f"metrics_{world}.jsonl")
    flags = ["train", "--preset", "tiny", "--use-cpu", "--no-progress-bar",
             "--seq-length", str(args.seq_length), "--micro-batch-size", "8",
             "--global-batch-size", "16", "--train-iters", str(args.iters),
             "--log-interval", "4", "--metrics-file", metrics]  # fmt: skip
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(world),
    ]
    cmd = (
        [*launcher, "-m", "stalwart", *flags]
        if world > 1
        else [sys.executable, "-m", "stalwart", *flags]
    )
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, args.threads // world))}
    subprocess.run(cmd, check=True, env=env, capture_output=True)
    with open(metrics) as f:
        rows = [json.loads(line) for line in f]
    return [r["elapsed_ms"] for r in rows if r.get("split") == "train"][2:]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=24)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--threads", type=int, default=2, help="cores shared by the ranks")
    args = p.parse_args()
    tokens = 16 * args.seq_length
    with tempfile.TemporaryDirectory() as tmp:
        print(f"tiny preset, global batch 16 x {args.seq_length} tokens, {args.threads} cores")
        print(f"{'ranks':>5s} {'median ms/iter':>15s} {'min-max':>17s} {'tokens/s':>9s}")
        for world in (1, 2):
            ms = run(world, args, tmp)
            med = statistics.median(ms)
            print(
                f"{world:5d} {med:15.1f} {min(ms):8.1f}-{max(ms):<8.1f} {tokens / med * 1e3:9.0f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
