"""Benchmark: asynchronous vs synchronous checkpoint save, and the checksum manifest's cost,
side by side (one process).

For a preset's GPT plus AdamW state (fp32 weights, two moments), saves rotate between a
synchronous `CheckpointManager`, an ``--async-save`` one and an ``--async-save`` one with the
checksum manifest truly off (``checksums=False``: no CRC-32 pass, no manifest file), so drift
(page cache, clocks, other load) hits all alike. Per save:

* blocking: wall time until ``save()`` returns, i.e. what the training loop waits for (the whole
  write for sync; the host staging copy for async).
* total: until the checkpoint is committed (marker, rename, tracker): sync = blocking; async =
  ``save()`` + a blocking ``finalize()`` issued at once. This is also the cost of a save on an exit
  signal, which must finish inside torchrun's 30 s SIGTERM-to-SIGKILL window.

Medians with min-max over ``--repeats`` saves per mode after ``--warmup`` untimed ones. The
checksum's cost is reported as a share of the async save: (total with checksums - total
without) / total with checksums, from the medians, and the same for the blocking time (the
checksums run on the writer's background thread, so that one should be ~0).

    PYTHONPATH=src python3 bench/checkpoint_save.py --preset small --device cpu
    PYTHONPATH=src python3 bench/checkpoint_save.py --preset gpt2-124m --device cuda --json out.json
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from stalwart.checkpoint import CheckpointManager, integrity, iteration_dir_name
from stalwart.models import GPT, preset_model_config

from bench_utils import sync

MODES = ("sync", "async", "async-no-checksums")
TARGET_RATIO = 0.10  # issue 4: async blocking time <= 10% of the synchronous save


def build_state(preset: str, device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The preset's model and an AdamW whose moments exist (one step on zero gradients)."""
    torch.manual_seed(0)
    model = GPT(preset_model_config(preset)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for state in optimizer.state.values():
        total += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))
    return total


def timed_save(
    manager: CheckpointManager,
    iteration: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
) -> tuple[float, float]:
    """(blocking seconds, total seconds to committed) of one save."""
    common = {"iteration": iteration}
    per_rank = {"rng": torch.get_rng_state()}
    sync(device)
    start = time.perf_counter()
    manager.save(iteration, model, optimizer, common, per_rank)
    blocking = time.perf_counter() - start
    manager.finalize()  # no-op for sync; waits for the background write and commits for async
    sync(device)
    return blocking, time.perf_counter() - start


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    model, optimizer = build_state(args.preset, device)
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="stalwart_bench_ckpt_"))
    managers = {
        mode: CheckpointManager(
            str(root / mode),
            keep_last=1,
            async_save=mode.startswith("async"),
            checksums=mode != "async-no-checksums",
        )
        for mode in MODES
    }
    samples: dict[str, list[tuple[float, float]]] = {mode: [] for mode in MODES}
    try:
        for i in range(args.warmup + args.repeats):
            order = MODES[i % len(MODES) :] + MODES[: i % len(MODES)]  # rotate who goes first
            for mode in order:
                sample = timed_save(managers[mode], i + 1, model, optimizer, device)
                if i >= args.warmup:
                    samples[mode].append(sample)
        last = root / "async" / iteration_dir_name(args.warmup + args.repeats)
        manifest_s = [_timed_manifest(last) for _ in range(args.repeats)]
    finally:
        for manager in managers.values():
            manager.close()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return {
        "preset": args.preset,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "state_mb": state_bytes(model, optimizer) / 2**20,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "samples_s": {m: [list(s) for s in v] for m, v in samples.items()},
        "manifest_s": manifest_s,
    }


def _timed_manifest(path: Path) -> float:
    """Seconds of one checksum pass (CRC-32 of every file + the manifest write) over ``path``."""
    start = time.perf_counter()
    integrity.write_manifest(str(path))
    return time.perf_counter() - start


def _stats(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def summarize(result: dict[str, Any]) -> list[str]:
    samples = result["samples_s"]
    sync_blocking = _stats([s[0] for s in samples["sync"]])[0]
    lines = [
        f"preset {result['preset']} on {result['device_name']} (torch {result['torch']}), "
        f"state {result['state_mb']:.0f} MiB, {result['repeats']} saves per mode after "
        f"{result['warmup']} warm-up",
        "| mode | blocking s, median (min-max) | total s, median (min-max) | blocking / sync |",
        "| --- | --- | --- | --- |",
    ]
    for mode in MODES:
        b, t = _stats([s[0] for s in samples[mode]]), _stats([s[1] for s in samples[mode]])
        lines.append(
            f"| {mode} | {b[0]:.3f} ({b[1]:.3f}-{b[2]:.3f}) | {t[0]:.3f} ({t[1]:.3f}-{t[2]:.3f}) "
            f"| {b[0] / sync_blocking:.1%} |"
        )
    ratio = _stats([s[0] for s in samples["async"]])[0] / sync_blocking
    verdict = "meets" if ratio <= TARGET_RATIO else "MISSES"
    lines.append(
        f"async blocking = {ratio:.1%} of sync: {verdict} the <= {TARGET_RATIO:.0%} target"
    )
    return lines + checksum_lines(samples, result["manifest_s"], result["state_mb"])


def checksum_lines(
    samples: dict[str, list[list[float]]], manifest_s: list[float], state_mb: float
) -> list[str]:
    """The checksum manifest's cost as a share of the async save: the difference of the
    medians with and without it, and one checksum pass timed alone (less noisy)."""
    total = _stats([s[1] for s in samples["async"]])[0]
    alone = _stats(manifest_s)
    lines = [
        f"checksums: one pass alone {alone[0]:.3f} s ({alone[1]:.3f}-{alone[2]:.3f}) over "
        f"{state_mb:.0f} MiB = {alone[0] / total:.1%} of the async save's total ({total:.3f} s)"
    ]
    for index, what in ((1, "total"), (0, "blocking")):
        on = _stats([s[index] for s in samples["async"]])[0]
        off = _stats([s[index] for s in samples["async-no-checksums"]])[0]
        lines.append(
            f"checksums: async {what} {on:.3f} s with, {off:.3f} s without: "
            f"{(on - off) / on:+.1%} of the async save's {what}"
        )
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small", choices=("tiny", "small", "gpt2-124m"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--dir", help="checkpoint directory (default: a fresh temp dir, removed)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints")
    p.add_argument("--json", help="write raw samples and the summary here")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        p.error("--repeats must be >= 1 and --warmup >= 0")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available")
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING)
    args = parse_args(argv)
    result = run(args)
    lines = summarize(result)
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps({**result, "summary": lines}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
