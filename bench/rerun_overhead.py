"""Benchmark: per-iteration cost of result validation in the reference trainer step, side by side.

Variants (each its own fresh model, same seed, same data; built by the trainer's
``build_components``, stepped with ``stalwart.train.step.train_step`` like ``Trainer`` does):

* ``no_checks``: ``--rerun-mode disabled --no-check-for-nan-in-loss-and-grad`` (the floor);
* ``disabled``: ``--rerun-mode disabled`` (NaN/Inf checks recorded, read once per iteration,
  fatal ones raise; no replay machinery);
* ``validate_results``: the default (checks + RNG snapshot + rank agreement; no rerun happens);
* ``naive_item``: ``no_checks`` plus a per-micro-batch ``loss.item()`` NaN/Inf check and a
  per-iteration ``grad_norm.item()`` check, the pattern result validation replaces.

Iterations alternate between variants (the order rotates every round) so drift in clocks or
load hits every variant alike. Times are wall-clock per iteration with the device synchronised
before and after (outside the step). Host syncs are counted in separate, untimed iterations:
calls of ``Tensor.item/tolist/__bool__/__float__/__int__`` made outside torch's own code (on any
device), plus, on CUDA, every synchronising call reported by
``torch.cuda.set_sync_debug_mode("warn")`` (torch internals included).

    PYTHONPATH=src python3 bench/rerun_overhead.py --preset tiny --device cpu --iters 40
    PYTHONPATH=src python3 bench/rerun_overhead.py --preset small --device cuda --bf16
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from stalwart.cli.args import parse_train_args
from stalwart.config.run import build_run_config
from stalwart.distributed.process_group import DistributedContext
from stalwart.models import PRESET_MICRO_BATCH_SIZE
from stalwart.reliability.rerun import local_grad_norm
from stalwart.train.components import Components, build_components
from stalwart.train.step import train_step

from bench_utils import percentile, sync

VARIANTS = ("no_checks", "disabled", "validate_results", "naive_item")
_READS = ("item", "tolist", "__bool__", "__float__", "__int__")


@dataclass
class Variant:
    name: str
    components: Components
    iteration: int = 0

    def step(self) -> None:
        """One reference trainer step (what ``Trainer._run_iteration`` does, minus hooks)."""
        c = self.components
        c.scheduler.set_iteration(self.iteration)
        c.rerun.set_iteration(self.iteration)
        result = train_step(c.step_parts, c.train_iterator)
        if result.should_exit:
            raise RuntimeError(f"{self.name}: the rerun state machine asked to exit")
        self.iteration += 1


def _naive_checks(c: Components) -> None:
    """Replace the recorded checks by a host read per micro-batch and one per iteration."""
    params = [p for p in c.model.parameters() if p.requires_grad]

    def loss_check(loss: torch.Tensor) -> None:
        value = loss.item()  # the naive pattern: a host sync per micro-batch
        if not math.isfinite(value):
            raise RuntimeError(f"non-finite loss {value}")

    def grad_check() -> None:
        value = local_grad_norm(params).item()
        if not math.isfinite(value):
            raise RuntimeError(f"non-finite grad norm {value}")

    c.forward_step.loss_check = loss_check
    c.step_parts.after_backward = grad_check


def build_variant(name: str, args: argparse.Namespace, ctx: DistributedContext) -> Variant:
    mbs = args.micro_batch_size or PRESET_MICRO_BATCH_SIZE[args.preset]
    flags = ["--preset", args.preset, "--micro-batch-size", str(mbs),
             "--global-batch-size", str(mbs * args.num_microbatches),
             "--train-iters", str(10**6), "--seed", "1234", "--no-progress-bar"]  # fmt: skip
    if ctx.device.type == "cpu":
        flags.append("--use-cpu")
    if args.bf16:
        flags.append("--bf16")
    if name == "validate_results":
        flags += ["--rerun-mode", "validate_results"]
    else:
        flags += ["--rerun-mode", "disabled"]
    if name in ("no_checks", "naive_item"):
        flags.append("--no-check-for-nan-in-loss-and-grad")
    config = build_run_config(parse_train_args(flags), flags)
    components = build_components(config, ctx)
    if name == "naive_item":
        _naive_checks(components)
    return Variant(name, components)


@contextlib.contextmanager
def count_host_reads(counter: list[int]) -> Iterator[None]:
    """Count tensor-to-host reads made outside torch's own code (any device) while active.

    Reads inside torch are left out: the CPU AdamW reads its CPU ``step`` counters with
    ``.item()`` (no device sync on CUDA either); device syncs inside torch show up in the CUDA
    sync count instead.
    """
    originals = {n: getattr(torch.Tensor, n) for n in _READS}
    torch_dir = os.path.dirname(torch.__file__)

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: torch.Tensor, *a: Any, **k: Any) -> Any:
            if not sys._getframe(1).f_code.co_filename.startswith(torch_dir):
                counter[0] += 1
            return fn(self, *a, **k)

        return wrapper

    for n, fn in originals.items():
        setattr(torch.Tensor, n, wrap(fn))
    try:
        yield
    finally:
        for n, fn in originals.items():
            setattr(torch.Tensor, n, fn)


def count_syncs(variant: Variant, device: torch.device, iters: int) -> dict[str, float | None]:
    """Host reads (and CUDA synchronising calls) per iteration, over ``iters`` untimed steps."""
    reads = [0]
    cuda_syncs: float | None = None
    with count_host_reads(reads):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    for _ in range(iters):
                        variant.step()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            flagged = [w for w in caught if "synchroniz" in str(w.message).lower()]
            cuda_syncs = len(flagged) / iters
        else:
            for _ in range(iters):
                variant.step()
    return {"host_reads_per_iter": reads[0] / iters, "cuda_syncs_per_iter": cuda_syncs}


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    ctx = DistributedContext(device=device)
    names = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown or "disabled" not in names:
        raise SystemExit(f"--variants: unknown {unknown}; allowed {VARIANTS} (disabled required)")
    variants = [build_variant(n, args, ctx) for n in names]
    for v in variants:  # warm-up (allocator, autotuning, the large-value windows)
        for _ in range(args.warmup):
            v.step()
    sync(device)
    syncs = {v.name: count_syncs(v, device, args.sync_iters) for v in variants}
    times: dict[str, list[float]] = {v.name: [] for v in variants}
    for r in range(args.iters):
        order = variants[r % len(variants) :] + variants[: r % len(variants)]
        for v in order:
            sync(device)
            start = time.perf_counter()
            v.step()
            sync(device)
            times[v.name].append((time.perf_counter() - start) * 1e3)
    base = times["disabled"]
    rows = []
    for v in variants:
        t = times[v.name]
        paired = [a / b for a, b in zip(t, base, strict=True)]
        rows.append(
            {
                "variant": v.name,
                "median_ms": statistics.median(t),
                "p10_ms": percentile(t, 0.1),
                "p90_ms": percentile(t, 0.9),
                "vs_disabled": statistics.median(t) / statistics.median(base),
                "paired_ratio_median": statistics.median(paired),
                **syncs[v.name],
            }
        )
    for v in variants:
        v.components.close()
    return {
        "preset": args.preset,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "bf16": args.bf16,
        "num_microbatches": args.num_microbatches,
        "iters": args.iters,
        "rows": rows,
    }


def print_table(result: dict[str, Any]) -> None:
    print(
        f"preset={result['preset']} device={result['device_name']} torch={result['torch']} "
        f"bf16={result['bf16']} micro-batches={result['num_microbatches']} iters={result['iters']}"
    )
    print(
        "| variant | median ms | p10–p90 ms | vs disabled (medians) | paired ratio (median) "
        "| host reads/iter | CUDA syncs/iter |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        cuda = "n/a" if r["cuda_syncs_per_iter"] is None else f"{r['cuda_syncs_per_iter']:.2f}"
        print(
            f"| {r['variant']} | {r['median_ms']:.2f} | {r['p10_ms']:.2f}–{r['p90_ms']:.2f} "
            f"| {r['vs_disabled']:.3f}x | {r['paired_ratio_median']:.3f}x "
            f"| {r['host_reads_per_iter']:.2f} | {cuda} |"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", choices=("tiny", "small", "gpt2-124m"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (as --bf16 trains)")
    parser.add_argument("--iters", type=int, default=40, help="timed iterations per variant")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--sync-iters", type=int, default=3, help="untimed, sync-counted")
    parser.add_argument("--num-microbatches", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=None)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (CPU)")
    parser.add_argument("--json", default=None, help="also write the result to this file")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run(args)
    print_table(result)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
