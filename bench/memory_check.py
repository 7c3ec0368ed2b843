"""Theoretical vs measured peak memory of the reference trainer, per preset and recompute variant.

For each preset x recompute variant x dtype: build the trainer's components (AdamW, 4 micro-batches
of 8, optional bf16), run a few iterations so the optimizer state exists, then compare the measured
peak with ``stalwart.models.memory_model.theoretical_memory``. Target: within 15% everywhere.

* ``--device cuda``: ``torch.cuda.max_memory_allocated`` against the estimate's total.
* ``--device cpu`` (tiny sizes, fp32): the peak of tensor memory allocated during the measured
  iterations, read from the profiler's allocator events (``Total Allocated``), against the
  estimate minus what already exists when they start (params and Adam states: 12 bytes/param;
  the grads are freed at every ``zero_grad`` and allocated again, so they are in the window).

Variants: ``none``, ``selective``, ``full-uniform-N``, ``full-block-N`` (``N`` layers; ``L``
means all layers). The "vs none" column is the measured peak relative to the same preset and
dtype without recompute.

    PYTHONPATH=src python3 bench/memory_check.py --device cuda --json memory.json
    PYTHONPATH=src python3 bench/memory_check.py --device cpu      # tiny shapes, about a minute
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from typing import Any

import torch

from stalwart.cli.args import parse_train_args
from stalwart.config.run import RunConfig, build_run_config
from stalwart.distributed.process_group import DistributedContext, choose_device
from stalwart.models.memory_model import CUDA_WORKSPACE_BYTES, theoretical_memory
from stalwart.observability.memory import cpu_peak_allocated_bytes
from stalwart.train.trainer import Trainer

PRESETS = "tiny,small,gpt2-124m,llama-tiny,llama-150m"
CPU_PRESETS = "tiny,llama-tiny"
VARIANTS = "none,selective,full-uniform-1"
# --device cpu: every preset shrunk to these shapes (the architecture switches stay).
CPU_SHAPES = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
              "--seq-length", "64", "--vocab-size", "512", "--ffn-hidden-size", "192",
              "--micro-batch-size", "4", "--global-batch-size", "16"]  # fmt: skip


def variant_flags(variant: str, num_layers: int) -> list[str]:
    """Recompute flags of a variant name (``none``, ``selective``, ``full-<method>-<N|L>``)."""
    if variant == "none":
        return []
    if variant == "selective":
        return ["--recompute-granularity", "selective"]
    parts = variant.split("-")
    if len(parts) != 3 or parts[0] != "full" or parts[1] not in ("uniform", "block"):
        raise SystemExit(f"--variants: unknown variant {variant!r}")
    count = str(num_layers) if parts[2] == "L" else parts[2]
    return ["--recompute-granularity", "full", "--recompute-method", parts[1],
            "--recompute-num-layers", count]  # fmt: skip


def _config(preset: str, variant: str, bf16: bool, device_kind: str) -> RunConfig:
    argv = ["--preset", preset, "--global-batch-size", "32", "--train-iters", "1000",
            "--log-interval", "100000", "--no-progress-bar"]  # fmt: skip
    if device_kind == "cpu":
        argv += [*CPU_SHAPES, "--use-cpu"]
    if bf16:
        argv.append("--bf16")
    layers = build_run_config(parse_train_args(argv), argv).model.num_layers
    argv += variant_flags(variant, layers)
    return build_run_config(parse_train_args(argv), argv)


def measure(preset: str, variant: str, bf16: bool, device_kind: str, iters: int) -> dict[str, Any]:
    config = _config(preset, variant, bf16, device_kind)
    device = choose_device(0, config.training.use_cpu)
    c = Trainer(config, DistributedContext(device=device))
    count = [0]

    def step() -> None:
        c.scheduler.set_iteration(count[0])
        c.step.run(count[0] + 1)
        count[0] += 1

    n = c.raw_model.num_parameters()
    cuda = device.type == "cuda"
    est = theoretical_memory(
        config.model,
        config.training.micro_batch_size,
        1,
        bf16=bf16,
        num_parameters=n,
        workspace_bytes=CUDA_WORKSPACE_BYTES if cuda else 0,
        fused_rms_norm=cuda,
    )
    if cuda:
        step()  # Adam states exist from here on
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        for _ in range(iters):
            step()
        torch.cuda.synchronize(device)
        measured, expected = float(torch.cuda.max_memory_allocated(device)), est.total_bytes
    else:
        step()
        measured = cpu_peak_allocated_bytes(lambda: [step() for _ in range(iters)])
        expected = est.total_bytes - 12.0 * n  # fp32 params + Adam states exist before
    c.close()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return {"preset": preset, "variant": variant, "bf16": bf16,
            "theoretical_mib": expected / 2**20, "measured_peak_mib": measured / 2**20,
            "ratio": expected / measured}  # fmt: skip


def print_table(rows: list[dict[str, Any]]) -> None:
    base = {
        (r["preset"], r["bf16"]): r["measured_peak_mib"] for r in rows if r["variant"] == "none"
    }
    print("| preset | recompute | bf16 | theoretical MiB | measured peak MiB | ratio | vs none |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        ref = base.get((r["preset"], r["bf16"]))
        vs = f"{r['measured_peak_mib'] / ref - 1:+.1%}" if ref and r["variant"] != "none" else ""
        print(f"| {r['preset']} | {r['variant']} | {'yes' if r['bf16'] else 'no'} | "
              f"{r['theoretical_mib']:.1f} | {r['measured_peak_mib']:.1f} | {r['ratio']:.3f} | "
              f"{vs} |")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument(
        "--presets",
        help=f"default: {PRESETS} (cuda); tiny,llama-tiny (cpu: CPU_SHAPES make the GPT-2 "
        "presets identical)",
    )
    p.add_argument("--variants", default=VARIANTS)
    p.add_argument("--dtypes", default=None, help="bf16,fp32 (default: both on cuda, fp32 on cpu)")
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--json")
    args = p.parse_args(argv)
    dtypes = (args.dtypes or ("bf16,fp32" if args.device == "cuda" else "fp32")).split(",")
    rows = [
        measure(preset, variant, dtype == "bf16", args.device, args.iters)
        for preset in (args.presets or (PRESETS if args.device == "cuda" else CPU_PRESETS)).split(
            ","
        )
        for dtype in dtypes
        for variant in args.variants.split(",")
    ]
    print_table(rows)
    worst = max(abs(r["ratio"] - 1.0) for r in rows)
    print(f"worst |ratio - 1| = {worst:.3f} (target <= 0.15)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0 if worst <= 0.15 else 1


if __name__ == "__main__":
    sys.exit(main())
