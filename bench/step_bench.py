"""Side-by-side per-iteration timing of the reference trainer's step under flag variants.

Every variant is built once (same preset, data and seed), then the variants take turns for
``--rounds`` rounds of ``--iters`` iterations each, so drift of the machine hits them equally.
Each iteration is timed with CUDA events on GPU (read after the round: no extra syncs inside) or
``perf_counter`` on CPU. Prints median ms, p10-p90 spread, ratio to the first variant, tokens/s
and model TFLOP/s (``stalwart.models.num_floating_point_operations``: 3 x forward matmul FLOPs,
full s^2 attention, logits included).

Examples::

    python bench/step_bench.py --preset tiny --suite baseline
    PYTHONPATH=src python3 bench/step_bench.py --preset small --device cuda --bf16 --suite rerun
    PYTHONPATH=src python3 bench/step_bench.py --preset gpt2-124m --device cuda --bf16 --suite timers

Suites: ``baseline`` (eager), ``timers`` (timing-log-level 0/1/2 in sync and events modes), ``dumps``
(stats-mode tensor dumps off/on), ``graphs`` (eager vs full-iteration graph + optimizer graph).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

from stalwart.cli.args import parse_train_args
from stalwart.config.run import build_run_config
from stalwart.distributed.process_group import DistributedContext, choose_device
from stalwart.observability.timer_names import INTERVAL_TIME
from stalwart.train.trainer import Trainer

SUITES: dict[str, list[tuple[str, list[str]]]] = {
    "baseline": [("eager", [])],
    "timers": [
        ("level 0", ["--timing-log-level", "0"]),
        ("level 1 sync", ["--timing-log-level", "1", "--timing-mode", "sync"]),
        ("level 2 sync (Megatron)", ["--timing-log-level", "2", "--timing-mode", "sync"]),
        ("level 1 events", ["--timing-log-level", "1", "--timing-mode", "events"]),
        ("level 2 events", ["--timing-log-level", "2", "--timing-mode", "events"]),
    ],
    "dumps": [
        ("dumps off", []),
        (
            "stats-mode dumps every iteration",
            ["--dump-stats-only", "--save-activations-interval", "1", "--dump-dir", "{tmp}"],
        ),
    ],
    "graphs": [
        ("eager", []),
        (
            "full_iteration + optimizer graph",
            ["--cuda-graph-impl", "full_iteration", "--optimizer-cuda-graph"],
        ),
    ],
}


def build_variant(base: list[str], extra: list[str]) -> Trainer:
    """The reference trainer for ``base + extra`` (validation costs: bench/check_overhead.py)."""
    tmp = tempfile.mkdtemp(prefix="stalwart-bench-")
    argv = [*base, *[a.format(tmp=tmp) for a in extra]]
    config = build_run_config(parse_train_args(argv), argv)
    device = choose_device(0, config.training.use_cpu)
    trainer = Trainer(config, DistributedContext(device=device))
    trainer.shell.timers(INTERVAL_TIME).start()
    return trainer


def run_iterations(c: Trainer, iteration: int, n: int, device: torch.device) -> list[float]:
    """Run ``n`` training iterations; per-iteration milliseconds."""
    cuda = device.type == "cuda"
    marks: list[Any] = []
    for k in range(n):
        it = iteration + k
        c.scheduler.set_iteration(it)
        marks.append(torch.cuda.Event(enable_timing=True) if cuda else time.perf_counter())
        if cuda:
            marks[-1].record()
        result = c.step.run(it + 1)
        c.shell.log.on_iteration(
            it + 1,
            losses=result.losses,
            learning_rate=c.scheduler.last_lr,
            global_batch_size=c.data.global_batch_size,
            consumed_samples=(it + 1) * c.data.global_batch_size,
            grad_norm=result.grad_norm,
            skipped=result.skipped,
        )
    end: Any = torch.cuda.Event(enable_timing=True) if cuda else time.perf_counter()
    if cuda:
        end.record()
        torch.cuda.synchronize()  # Deliberate sync: read the round's events once.
        marks.append(end)
        return [marks[i].elapsed_time(marks[i + 1]) for i in range(n)]
    marks.append(end)
    return [(marks[i + 1] - marks[i]) * 1e3 for i in range(n)]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument(
        "--suite", default="baseline", help=f"comma list of: {', '.join(sorted(SUITES))}"
    )
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--micro-batch-size", type=int)
    p.add_argument("--num-microbatches", type=int, default=4)
    p.add_argument("--seq-length", type=int)
    p.add_argument("--iters", type=int, default=10, help="iterations per round per variant")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--json")
    args = p.parse_args(argv)
    mbs = args.micro_batch_size or 8
    base = ["--preset", args.preset, "--micro-batch-size", str(mbs),
            "--global-batch-size", str(mbs * args.num_microbatches),
            "--train-iters", "100000", "--log-interval", "1000000", "--no-progress-bar"]  # fmt: skip
    if args.seq_length:
        base += ["--seq-length", str(args.seq_length)]
    if args.bf16:
        base.append("--bf16")
    if args.device == "cpu":
        base.append("--use-cpu")
    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    suites = args.suite.split(",")
    unknown = [s for s in suites if s not in SUITES]
    if unknown:
        p.error(f"--suite: unknown {unknown}; allowed: {', '.join(sorted(SUITES))}")
    specs = [
        (f"{s}: {name}" if len(suites) > 1 else name, extra)
        for s in suites
        for name, extra in SUITES[s]
    ]
    variants = [(name, build_variant(base, extra)) for name, extra in specs]
    times: dict[str, list[float]] = {name: [] for name, _ in variants}
    position = 0
    for _name, c in variants:
        run_iterations(c, position, args.warmup, device)
    position += args.warmup
    for _ in range(args.rounds):
        for name, c in variants:
            times[name] += run_iterations(c, position, args.iters, device)
        position += args.iters
    report(args, variants, times)
    return 0


def report(
    args: argparse.Namespace, variants: list[tuple[str, Trainer]], times: dict[str, list[float]]
) -> None:
    c0 = variants[0][1]
    tokens = c0.data.global_batch_size * c0.config.model.seq_length
    base_median = statistics.median(times[variants[0][0]])
    rows = []
    print(f"\npreset={args.preset} device={args.device} bf16={args.bf16} "
          f"global batch={c0.data.global_batch_size} ({c0.data.num_microbatches} micro-batches) seq={c0.config.model.seq_length}")  # fmt: skip
    print(
        f"{'variant':36s} {'median ms':>10s} {'p10-p90 ms':>16s} {'ratio':>7s} {'tokens/s':>10s} {'TFLOP/s':>8s}"
    )
    for name, c in variants:
        t = times[name]
        med = statistics.median(t)
        row = {
            "variant": name,
            "median_ms": med,
            "p10_ms": percentile(t, 0.1),
            "p90_ms": percentile(t, 0.9),
            "ratio": med / base_median,
            "tokens_per_s": tokens / (med / 1e3),
            "tflops": c.flops_per_iteration / (med / 1e3) / 1e12,
            "n": len(t),
        }
        rows.append(row)
        print(f"{name:36s} {med:10.2f} {row['p10_ms']:7.2f}-{row['p90_ms']:<8.2f} {row['ratio']:7.3f} "
              f"{row['tokens_per_s']:10.0f} {row['tflops']:8.2f}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
