"""Benchmark: the fused output layer + cross entropy (``--cross-entropy-loss-fusion``) against the
unfused ``F.cross_entropy(F.linear(x, W).float(), labels)``, both under ``torch.compile``, forward
and backward, side by side in one process.

Each round times every variant once (``--iters`` forward-backward passes between two device
syncs, the order rotated each round); the table gives the median ms per pass, min-max, the
per-round median ratio ``unfused / fused`` and each variant's peak memory above its inputs.
It first checks the fused loss and gradients against the unfused ones (relative norms).
``--kernel-only`` also times the loss kernel alone (on given logits) for each ``--blocks``
configuration against Inductor's loss forward + backward on the same logits.

    PYTHONPATH=src python3 bench/cross_entropy_fusion.py                # the H200
    PYTHONPATH=src python3 bench/cross_entropy_fusion.py --smoke        # CPU, eager, seconds
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from stalwart.models.fused_cross_entropy import linear_cross_entropy

from bench_utils import sync  # bench/ is the script's directory


def _unfused(x: torch.Tensor, w: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(x, w).float(), labels)


def _fused(x: torch.Tensor, w: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return linear_cross_entropy(x, w, labels)


VARIANTS: dict[str, Callable[..., torch.Tensor]] = {"unfused": _unfused, "fused": _fused}


def _inputs(args: argparse.Namespace, device: torch.device) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(args.tokens, args.hidden, generator=gen).to(device, args.dtype)
    w = (torch.randn(args.vocab, args.hidden, generator=gen) * 0.02).to(device, args.dtype)
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=gen).to(device)
    labels[:: args.ignore_every] = -100
    return x.requires_grad_(), w.requires_grad_(), labels


def _pass(fn: Callable[..., torch.Tensor], x: Any, w: Any, labels: Any) -> torch.Tensor:
    x.grad = w.grad = None
    loss = fn(x, w, labels)
    (loss * 0.25).backward()
    return loss


def check(fns: dict[str, Callable[..., torch.Tensor]], inputs: tuple[Any, ...]) -> dict:
    """Loss difference and gradient relative norms, fused against unfused."""
    out: dict[str, Any] = {}
    for name, fn in fns.items():
        loss = _pass(fn, *inputs)
        out[name] = (loss.detach().float(), inputs[0].grad.float(), inputs[1].grad.float())
    a, b = out["unfused"], out["fused"]
    rel = [((u - v).norm() / u.norm()).item() for u, v in zip(a[1:], b[1:], strict=True)]
    return {"loss_unfused": a[0].item(), "loss_diff": (a[0] - b[0]).abs().item(),
            "grad_x_rel": rel[0], "grad_w_rel": rel[1]}  # fmt: skip


def time_variants(
    fns: dict[str, Callable[..., Any]], rounds: int, iters: int, device: torch.device
) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {n: [] for n in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            sync(device)
            start = time.perf_counter()
            for _ in range(iters):
                fns[name]()
            sync(device)
            times[name].append((time.perf_counter() - start) * 1e3 / iters)
    return times


def peak_mib(fn: Callable[[], Any], device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    sync(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def kernel_only(args: argparse.Namespace, device: torch.device) -> dict[str, list[float]]:
    """The loss kernel alone per block configuration vs Inductor's loss fwd + bwd on logits."""
    from stalwart.models.cross_entropy_triton import loss_and_grad_in_place

    gen = torch.Generator(device="cpu").manual_seed(1)
    logits = torch.randn(args.tokens, args.vocab, generator=gen).to(device, args.dtype)
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=gen).to(device)
    scale = torch.ones(1, device=device)
    work = logits.clone()

    @torch.compile
    def inductor(z: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(z.float(), labels)

    z = logits.clone().requires_grad_()
    fns: dict[str, Callable[[], Any]] = {"inductor_fwd_bwd": lambda: inductor(z).backward()}
    for spec in args.blocks.split(","):
        block, warps = (int(v) for v in spec.split("x"))
        fns[f"fused_{block}x{warps}"] = lambda b=block, nw=warps: loss_and_grad_in_place(
            work, labels, scale, -100, b, nw
        )
    for fn in fns.values():
        fn()
    return time_variants(fns, args.rounds, args.iters, device)


def _summary(times: dict[str, list[float]], base: str) -> list[dict[str, Any]]:
    rows = []
    for name, t in times.items():
        ratio = statistics.median([b / a for a, b in zip(t, times[base], strict=True)])
        rows.append({"variant": name, "median_ms": statistics.median(t), "min_ms": min(t),
                     "max_ms": max(t), f"{base}/variant": ratio})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--ignore-every", type=int, default=97, help="every N-th label ignored")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--kernel-only", action="store_true")
    p.add_argument("--blocks", default="4096x8,8192x8,8192x16,16384x16,16384x32")
    p.add_argument("--json", default=None)
    p.add_argument("--no-compile", dest="compile", action="store_false", help="eager variants")
    p.add_argument("--smoke", action="store_true", help="CPU, small shapes, eager (a test)")
    args = p.parse_args(argv)
    if args.smoke:
        args.device, args.tokens, args.vocab, args.hidden = "cpu", 64, 300, 32
        args.iters, args.rounds, args.compile = 2, 2, False
    device = torch.device(args.device)
    args.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    fns = {n: torch.compile(fn) if args.compile else fn for n, fn in VARIANTS.items()}
    inputs = _inputs(args, device)
    result: dict[str, Any] = {"shape": [args.tokens, args.hidden, args.vocab]}
    result["check"] = check(fns, inputs)
    print(json.dumps(result["check"]), flush=True)
    passes = {name: (lambda fn=fn: _pass(fn, *inputs)) for name, fn in fns.items()}
    for fn in passes.values():
        fn()
    result["peak_mib"] = {name: peak_mib(fn, device) for name, fn in passes.items()}
    result["rows"] = _summary(time_variants(passes, args.rounds, args.iters, device), "unfused")
    if args.kernel_only and device.type == "cuda":
        result["kernel_rows"] = _summary(kernel_only(args, device), "inductor_fwd_bwd")
    print(f"\nshape tokens x hidden x vocab = {args.tokens} x {args.hidden} x {args.vocab}")
    print("| variant | median ms | min-max | base/variant | peak MiB |\n|---|---|---|---|---|")
    for row in result["rows"] + result.get("kernel_rows", []):
        ratio = next(v for k, v in row.items() if k.endswith("/variant"))
        peak = result["peak_mib"].get(row["variant"])
        print(f"| {row['variant']} | {row['median_ms']:.3f} | {row['min_ms']:.3f}-"
              f"{row['max_ms']:.3f} | {ratio:.3f}x | {'' if peak is None else f'{peak:.0f}'} |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
