"""Benchmark: what the in-step replica fingerprint costs the guarded step, side by side.

The fingerprint (``stalwart.reliability.rerun.attribution.replicas``) hashes the due weights and their
all-reduced gradients after the backward, gathers them across the data-parallel group and
records one device check (its value rides on the machine's one per-iteration read; nothing else
is read on the host). For each mode (``graphed``: ``--cuda-graph-impl full_iteration
--optimizer-cuda-graph``, where the step's spread is tight; ``eager``) three variants are built
by the reference trainer (same seed, same data, default checks on) and stepped with
``GuardedStep.run`` in one process:

* ``off``: no fingerprint flag: the machine has no replica gate, the step does nothing for it;
* ``sampled``: ``--check-weight-hash-sample-fraction F`` (default 0.01): every iteration one of
  ceil(1/F) size-balanced groups of the parameters (issue 15: <= 0.5% per iteration at
  gpt2-124m on the H200);
* ``full``: ``--check-weight-hash-across-dp-replicas-interval 1``: every parameter every
  iteration (the cost of one checked iteration; at interval N it is spread over N).

On one GPU (world size 1) there is no peer: the all-gather of one rank is its own row, but the
fingerprint kernels, the comparison, the gate and the check's slot in the read all run. The
benchmark asserts it: each fingerprinting variant's gate recorded exactly one fingerprint per
iteration stepped, and it reports how many of the fingerprinted parameters had a gradient.

Variants take turns in windows of ``--iters`` iterations (the order rotates every round), each
window timed from a device sync to a device sync. Reported per variant: median ms/iteration over
the windows and p10-p90, and the per-round ratio to ``off``: median, mean and p10-p90. Groups
differ in cost (the embedding may be a group alone), so ``--rounds`` x ``--iters`` should be a
multiple of ceil(1/F) (the defaults: 10 x 10 for F = 0.01): the mean then covers whole cycles.

    python3 bench/fingerprint_overhead.py --device cuda --bf16 --preset gpt2-124m
    python3 bench/fingerprint_overhead.py --device cpu --preset tiny --modes eager --rounds 2 \\
        --iters 2 --warmup 1 --sample-fraction 0.5 --extra "--num-layers 1 --hidden-size 32 \\
        --num-attention-heads 2 --seq-length 16 --vocab-size 256 --micro-batch-size 2"  # smoke
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

from check_overhead import Variant  # the trainer stepped in place, as check_overhead does
from stalwart.cli.args import parse_train_args
from stalwart.config.run import build_run_config
from stalwart.distributed.process_group import DistributedContext
from stalwart.reliability.rerun import ReplicaCheck
from stalwart.train.trainer import Trainer

from bench_utils import add_step_args, close_all, paired_rows, pin_device, rotated_windows

MODES = {"graphed": ["--cuda-graph-impl", "full_iteration", "--optimizer-cuda-graph"], "eager": []}
TARGET = 0.005  # issue 15: the sampled fingerprint, per iteration, at gpt2-124m on the H200


def variant_flags(sample_fraction: float) -> dict[str, list[str]]:
    return {
        "off": [],
        "sampled": ["--check-weight-hash-sample-fraction", str(sample_fraction)],
        "full": ["--check-weight-hash-across-dp-replicas-interval", "1"],
    }


@dataclass
class Stepper(Variant):
    """One trainer stepped by its guarded step (``check_overhead.Variant``), counting its
    fingerprints."""

    gate: ReplicaCheck | None = field(init=False)
    recorded_at_start: int = field(init=False)

    def __post_init__(self) -> None:
        self.gate = self.trainer.machine.replicas
        self.recorded_at_start = self.gate.num_recorded if self.gate is not None else 0

    def fingerprint_count(self) -> dict[str, Any]:
        """How many fingerprints the gate recorded (one per iteration, or the figure is void)
        and how many of the parameters it covered had a gradient."""
        if self.gate is None:
            return {"recorded": 0, "iterations": self.iteration}
        params = self.trainer.step.params
        return {
            "recorded": self.gate.num_recorded - self.recorded_at_start,
            "iterations": self.iteration,
            "groups": self.gate.schedule.num_groups,
            "with_grad": sum(p.grad is not None for p in params),
            "parameters": len(params),
        }


def build(name: str, flags: list[str], mode: str, args: argparse.Namespace) -> Stepper:
    base = ["--preset", args.preset, "--train-iters", str(10**6), "--seed", "1234",
            "--no-progress-bar", "--log-interval", str(10**6)]  # fmt: skip
    base += ["--use-cpu"] if args.device == "cpu" else []
    base += ["--bf16"] if args.bf16 else []
    base += args.extra.split() + MODES[mode] + flags
    mbs = parse_train_args(base).micro_batch_size or 8
    base += ["--global-batch-size", str(mbs * args.num_microbatches)]
    config = build_run_config(parse_train_args(base), base)
    stepper = Stepper(name, Trainer(config, DistributedContext(device=torch.device(args.device))))
    if (stepper.gate is None) != (name == "off"):
        raise RuntimeError(f"{name}: the flags {flags} built the wrong replica gate")
    return stepper


def measure(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    steppers: list[Stepper] = []
    try:
        for name, flags in variant_flags(args.sample_fraction).items():
            steppers.append(build(name, flags, mode, args))
    except Exception:
        for s in steppers:  # the next mode gets the device's memory back
            s.trainer.close()
        raise
    for s in steppers:  # warm-up: allocator, autotuning, graph capture
        s.run(args.warmup)
    times = rotated_windows(steppers, args.rounds, args.iters, device)
    counts = {s.name: s.fingerprint_count() for s in steppers}
    close_all(steppers, device)
    for name, c in counts.items():  # the work measured must have run, every iteration
        if name != "off" and c["recorded"] != c["iterations"]:
            raise RuntimeError(f"{name}: {c['recorded']} fingerprints in {c['iterations']} steps")
    return summarize(mode, times, counts, args)


def summarize(
    mode: str, times: dict[str, list[float]], counts: dict[str, Any], args: argparse.Namespace
) -> dict[str, Any]:
    rows = paired_rows(times)
    for row in rows:
        name = row["variant"]
        row["fingerprints"] = counts[name]
    cost = {r["variant"]: r["ratio"] - 1 for r in rows}
    return {
        "preset": args.preset,
        "mode": mode,
        "sample_fraction": args.sample_fraction,
        "timed_iterations_per_variant": args.rounds * args.iters,
        "rows": rows,
        "sampled_cost": cost["sampled"],
        "full_cost": cost["full"],
        "target": TARGET if args.preset == "gpt2-124m" and args.device.startswith("cuda") else None,
    }


def print_result(result: dict[str, Any]) -> None:
    print(f"\n{result['preset']} / {result['mode']} (sample fraction {result['sample_fraction']})")
    print("| variant | median ms/iter | p10-p90 | vs off: median | mean | p10-p90 | fingerprints |")
    print("|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        fp = r["fingerprints"]
        counted = f"{fp['recorded']}/{fp['iterations']}" if r["variant"] != "off" else "-"
        if "with_grad" in fp:
            counted += f" ({fp['with_grad']}/{fp['parameters']} params with grad)"
        print(
            f"| {r['variant']} | {r['median_ms']:.2f} | {r['p10_ms']:.2f}-{r['p90_ms']:.2f} "
            f"| {r['ratio']:.4f} | {r['ratio_mean']:.4f} | {r['ratio_p10']:.4f}-"
            f"{r['ratio_p90']:.4f} | {counted} |"
        )
    target = result["target"]
    verdict = "" if target is None else (" PASS" if result["sampled_cost"] <= target else " FAIL")
    shown = "" if target is None else f" (target <= {target:.1%})"
    print(
        f"- sampled fingerprint costs {result['sampled_cost']:+.2%} per iteration{shown}{verdict}"
    )
    print(f"- full fingerprint costs {result['full_cost']:+.2%} per checked iteration")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--preset", default="gpt2-124m")
    parser.add_argument("--modes", default="graphed,eager")
    parser.add_argument("--sample-fraction", type=float, default=0.01)
    add_step_args(parser, iters=10, rounds=10, warmup=10)
    args = parser.parse_args(argv)
    pin_device(args)
    results: list[dict[str, Any]] = []
    failed = []
    for mode in args.modes.split(","):
        try:
            results.append(measure(mode, args))
        except Exception:  # one GPU call measures every mode it can: the failure is reported
            failed.append(mode)
            print(f"\n{args.preset} / {mode}: Error\n{traceback.format_exc()}", flush=True)
            continue
        print_result(results[-1])
        if args.json:  # after every mode: a run cut short keeps what it measured
            with open(args.json, "w") as fh:
                json.dump({"torch": torch.__version__, "results": results}, fh, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
