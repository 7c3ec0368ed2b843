"""Theoretical vs measured peak memory of the reference trainer, per preset (GPU).

For each preset: build the trainer's components (AdamW, 4 micro-batches, optional bf16), run a few
iterations so the optimizer state exists, then compare ``torch.cuda.max_memory_allocated`` with
``stalwart.observability.memory.theoretical_memory``. Target: within 15% at every preset.

    PYTHONPATH=src python3 bench/memory_check.py --device cuda --json memory.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys

import torch

from stalwart.cli.args import parse_train_args
from stalwart.config.run import build_run_config
from stalwart.distributed.process_group import DistributedContext, choose_device
from stalwart.observability.memory import theoretical_memory
from stalwart.train.trainer import Trainer


def measure(preset: str, bf16: bool, device_kind: str, iters: int) -> dict[str, float | str]:
    argv = ["--preset", preset, "--global-batch-size", "32", "--train-iters", "1000",
            "--log-interval", "100000", "--no-progress-bar"]  # fmt: skip
    if bf16:
        argv.append("--bf16")
    if device_kind == "cpu":
        argv.append("--use-cpu")
    config = build_run_config(parse_train_args(argv), argv)
    device = choose_device(0, config.training.use_cpu)
    c = Trainer(config, DistributedContext(device=device))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for it in range(iters):
        c.scheduler.set_iteration(it)
        c.step.run(it)
    measured = (
        float(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else float("nan")
    )
    est = theoretical_memory(config.model, config.training.micro_batch_size, 1, bf16=bf16)
    c.close()
    del c
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "preset": preset,
        "bf16": str(bf16),
        "theoretical_mib": est.total_bytes / 2**20,
        "measured_peak_mib": measured / 2**20,
        "ratio": est.total_bytes / measured,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--presets", default="tiny,small,gpt2-124m")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args(argv)
    rows = [
        measure(preset, bf16, args.device, args.iters)
        for preset in args.presets.split(",")
        for bf16 in (True, False)
    ]
    print(
        f"{'preset':10s} {'bf16':5s} {'theoretical MiB':>16s} {'measured peak MiB':>18s} {'ratio':>6s}"
    )
    for r in rows:
        print(
            f"{r['preset']:10s} {r['bf16']:5s} {r['theoretical_mib']:16.1f} {r['measured_peak_mib']:18.1f} {r['ratio']:6.3f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
