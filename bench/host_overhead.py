"""Benchmark: the host's work per iteration of the graphed guarded step, once captured.

At the tiny preset on the H200 the graphed trainer is host-bound (docs/benchmarks.md, "The lower
kernel floor": the device idles ~1 ms per iteration waiting for the host), so what counts is the
host's per-iteration work outside the graph replays. This script builds the reference trainer
(``Trainer``, the kernel floor's ``weights_residual`` flags: ``--cuda-graph-impl full_iteration
--optimizer-cuda-graph --bf16-compute-weights --bf16-residual-connection``, every default check
on) twice in one process, and steps each as ``bench/kernel_floor.py`` does
(``scheduler.set_iteration`` + ``step.run``):

* ``before``: the micro-batches built one by one (``MicroBatchIterator(chunk_microbatches=1)``:
  slice, contiguous and pin per tensor, one copy per tensor into the graph's static inputs) and
  the reported values averaged by host ops after every replay (``GraphPlan(means_in_graph=False)``);
* ``after``: what the trainer does now: the iteration's micro-batches built at once into one
  pinned buffer and loaded with one copy; the means computed inside the graph.

Reported per variant: Python wall time per iteration (median and min-max over windows taking
turns, the order rotating), and from a profiled window the aten ops per iteration (top level:
the calls the step makes; all: with their children) by name.

On CPU (default) the graphs are the fake backend of the tests (``tests/graphs``: capture runs
the body once, a replay runs nothing), so the figures are exactly the host's work outside the
replays; the model is shrunk (host work does not depend on it once captured) so the warm-up
takes seconds. ``--device cuda`` uses real graphs and the preset's model (add ``--compile``).

    PYTHONPATH=src python3 bench/host_overhead.py                   # CPU, ~1 min
    PYTHONPATH=src python3 bench/host_overhead.py --device cuda --preset tiny --compile
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

import stalwart.train.build as build
from stalwart.cli.args import parse_train_args
from stalwart.config.run import GraphConfig, build_run_config
from stalwart.distributed.process_group import DistributedContext
from stalwart.train.trainer import Trainer

TESTS_GRAPHS = Path(__file__).resolve().parents[1] / "tests" / "graphs"
GRAPH_FLAGS = ["--cuda-graph-impl", "full_iteration", "--optimizer-cuda-graph",
               "--bf16-compute-weights", "--bf16-residual-connection"]  # fmt: skip
CPU_MODEL = ["--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "2",
             "--seq-length", "64", "--vocab-size", "256"]  # fmt: skip
VARIANTS = ("before", "after")


def trainer_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--preset", args.preset, "--train-iters", str(10**6), "--seed", "1234", "--bf16",
             "--no-progress-bar", "--log-interval", str(10**6), "--eval-interval", "0",
             "--micro-batch-size", str(args.micro_batch_size),
             "--global-batch-size", str(args.micro_batch_size * args.num_microbatches)]  # fmt: skip
    if args.device == "cpu":
        flags += ["--use-cpu", *CPU_MODEL]
    if args.compile:
        flags.append("--compile")
    return flags + GRAPH_FLAGS + args.extra.split()


@contextlib.contextmanager
def variant_build(name: str, device: str) -> Iterator[None]:
    """Build the trainer as ``name`` has it: ``before`` turns both changes off; on CPU the
    graphs use the tests' fake backend (the graph flags' CUDA check is skipped for it)."""
    saved = (GraphConfig.build, build.build_sampler, build.check_graph_flags)
    original_build, original_sampler = saved[0], saved[1]
    fake = None
    if device == "cpu":
        sys.path.insert(0, str(TESTS_GRAPHS))
        from graphs_fake_backend import FakeGraphContext  # type: ignore[import-not-found]

        fake = FakeGraphContext
        build.check_graph_flags = lambda *a, **k: None  # type: ignore[assignment]

    def plan(self: GraphConfig) -> Any:
        built = original_build(self)
        changes: dict[str, Any] = {"means_in_graph": name == "after"}
        if fake is not None:
            changes["context"] = fake()
        return dataclasses.replace(built, **changes)

    def sampler(config: Any, ctx: Any, train: Any, num_microbatches: int = 1) -> Any:
        return original_sampler(config, ctx, train, num_microbatches if name == "after" else 1)

    GraphConfig.build = plan  # type: ignore[method-assign]
    build.build_sampler = sampler  # type: ignore[assignment]
    try:
        yield
    finally:
        GraphConfig.build, build.build_sampler, build.check_graph_flags = saved  # type: ignore[method-assign]


@dataclasses.dataclass
class Variant:
    name: str
    trainer: Trainer
    iteration: int = 0

    def run(self, iters: int, losses: list[dict[str, torch.Tensor]] | None = None) -> None:
        """``iters`` iterations; ``losses``: collects each one's reported values (tests)."""
        t = self.trainer
        for _ in range(iters):
            t.scheduler.set_iteration(self.iteration)
            result = t.step.run(self.iteration + 1, launch_next=True)
            if result.verdict.exit:
                raise RuntimeError(f"{self.name}: the rerun state machine asked to exit")
            if losses is not None:
                losses.append(result.losses)
            self.iteration += 1


def build_variant(
    name: str, args: argparse.Namespace, losses: list[dict[str, torch.Tensor]] | None = None
) -> Variant:
    """The trainer as ``name`` has it, stepped through ``--warmup`` iterations (eager, then the
    capture; on the fake backend the last that compute anything)."""
    flags = trainer_flags(args)
    config = build_run_config(parse_train_args(flags), flags)
    with variant_build(name, args.device):
        trainer = Trainer(config, DistributedContext(device=torch.device(args.device)))
    variant = Variant(name, trainer)
    variant.run(args.warmup, losses)
    if trainer.step.num_launched == 0:
        raise RuntimeError(f"{name}: no iteration was launched ahead after the warm-up")
    return variant


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def host_ops(variant: Variant, iters: int) -> dict[str, Any]:
    """aten ops per iteration: top level (what the step calls) by name, and with children."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        variant.run(iters)
    aten = [e for e in prof.events() if e.name.startswith("aten::")]
    top = [e for e in aten if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    names = collections.Counter(e.name for e in top)
    return {
        "top_ops": len(top) / iters,
        "all_ops": len(aten) / iters,
        "by_name": {k: v / iters for k, v in sorted(names.items(), key=lambda kv: -kv[1])},
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    variants = [build_variant(name, args) for name in VARIANTS]
    times: dict[str, list[float]] = {v.name: [] for v in variants}
    for r in range(args.rounds):
        for v in variants[r % 2 :] + variants[: r % 2]:
            _sync(args.device)
            start = time.perf_counter()
            v.run(args.iters)
            _sync(args.device)
            times[v.name].append((time.perf_counter() - start) * 1e3 / args.iters)
    rows = []
    for v in variants:
        t = times[v.name]
        rows.append({"variant": v.name, "median_ms": statistics.median(t), "min_ms": min(t),
                     "max_ms": max(t), **host_ops(v, args.profile_iters)})  # fmt: skip
    for v in variants:
        v.trainer.close()
    ratio = [b / a for a, b in zip(times["after"], times["before"], strict=True)]
    return {"device": args.device, "flags": trainer_flags(args), "rows": rows,
            "before_over_after": statistics.median(ratio)}  # fmt: skip


def print_result(result: dict[str, Any]) -> None:
    print(f"\nhost work per iteration, {result['device']} (once captured; ratio before / after: "
          f"{result['before_over_after']:.2f}x, per-round median)")  # fmt: skip
    print("| variant | ms / iteration (min-max) | aten ops, top level | aten ops, all |")
    print("|---|---|---|---|")
    for r in result["rows"]:
        print(f"| {r['variant']} | {r['median_ms']:.3f} ({r['min_ms']:.3f}-{r['max_ms']:.3f}) "
              f"| {r['top_ops']:.0f} | {r['all_ops']:.0f} |")  # fmt: skip
    for r in result["rows"]:
        ops = ", ".join(f"{k.removeprefix('aten::')} {v:g}" for k, v in r["by_name"].items())
        print(f"- {r['variant']}: {ops}")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--compile", action="store_true", help="--compile the model (GPU)")
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--num-microbatches", type=int, default=4)
    p.add_argument("--warmup", type=int, default=6, help="iterations before timing (capture)")
    p.add_argument("--iters", type=int, default=50, help="iterations per timed window")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--profile-iters", type=int, default=10)
    p.add_argument("--extra", default="", help="more trainer flags, one string")
    p.add_argument("--json", type=Path, default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    result = measure(args)
    print_result(result)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
