"""Benchmark: causal scaled-dot-product attention, forward + backward, per SDPA backend (cuDNN,
flash, memory-efficient, math) at one shape (default: gpt2-124m's micro-batch of 32).

Which backend torch picks decides a large share of the model's kernel time; this says whether
pinning another one would be faster. Each backend is timed over ``--iters`` passes between two
device syncs, ``--rounds`` times (order rotated); median ms per pass and min-max. A backend that
cannot run the shape is reported as such.

    PYTHONPATH=src python3 bench/attention_backends.py            # the H200
    PYTHONPATH=src python3 bench/attention_backends.py --smoke    # CPU, seconds
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench_utils import sync  # bench/ is the script's directory

BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shape", default="32,12,1024,64", help="batch,heads,seq,head_dim")
    p.add_argument("--backends", default="cudnn,flash,efficient")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--smoke", action="store_true", help="CPU, small shape (a test)")
    args = p.parse_args(argv)
    if args.smoke:
        args.device, args.shape, args.backends, args.iters, args.rounds = (
            "cpu",
            "2,2,16,8",
            "math",
            2,
            2,
        )
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    b, h, s, d = (int(v) for v in args.shape.split(","))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(b, h, s, d, generator=gen).to(device, dtype).requires_grad_() for _ in range(3)
    )
    grad = torch.randn(b, h, s, d, generator=gen).to(device, dtype)

    def one_pass() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

    names = args.backends.split(",")
    times: dict[str, list[float]] = {}
    for name in names:
        try:
            with sdpa_kernel([BACKENDS[name]]):
                one_pass()  # warm-up (and: can this backend run the shape?)
            times[name] = []
        except RuntimeError as err:
            print(f"| {name} | cannot run this shape: {str(err).splitlines()[0][:120]} |")
    runnable = list(times)
    for r in range(args.rounds):
        for name in runnable[r % len(runnable) :] + runnable[: r % len(runnable)]:
            with sdpa_kernel([BACKENDS[name]]):
                sync(device)
                start = time.perf_counter()
                for _ in range(args.iters):
                    one_pass()
                sync(device)
            times[name].append((time.perf_counter() - start) * 1e3 / args.iters)
    print(f"causal attention forward + backward, shape {args.shape}, {dtype}")
    print("| backend | median ms | min-max |\n|---|---|---|")
    for name in runnable:
        t = times[name]
        print(f"| {name} | {statistics.median(t):.3f} | {min(t):.3f}-{max(t):.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
