"""Benchmark: what result validation launches per iteration (ops, kernels, host syncs), off vs on.

The reference trainer's guarded step is built twice (same seed and data, like
``bench/check_overhead.py``): ``off`` (the checks truly off: ``--rerun-mode disabled
--no-check-for-nan-in-loss-and-grad``) and ``checks`` (the defaults). After warm-up,
``--iters`` iterations of each are profiled with ``torch.profiler`` and reported per iteration:

* ``aten ops``: every aten op the host dispatched (nested ones included), ``top-level``: those
  called from Python (each costs a dispatch, the eager host overhead);
* ``kernels`` (CUDA only): device kernels, memcpys and memsets launched;
* ``host reads``: calls of ``Tensor.item/tolist/__bool__/__float__/__int__`` in the step, each a
  device sync on CUDA when its tensor is on the device (on CPU every tensor is, so this is an
  upper bound), with their call sites; on CUDA also ``torch.cuda.set_sync_debug_mode`` warnings.

The difference ``checks - off`` is what the checks cost the host; it should not grow with the
number of parameters (compare presets with more layers).

    python3 bench/check_ops.py --device cpu --presets tiny,small \\
        --extra "--seq-length 32 --micro-batch-size 1"                      # CPU (docs)
    python3 bench/check_ops.py --device cuda --bf16 --presets tiny,small,gpt2-124m   # GPU
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import sys
import time
import traceback
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from stalwart.cli.args import parse_train_args
from stalwart.config.run import build_run_config
from stalwart.distributed.process_group import DistributedContext
from stalwart.train.trainer import Trainer

VARIANTS = {
    "off": ["--rerun-mode", "disabled", "--no-check-for-nan-in-loss-and-grad"],
    "checks": [],
}
MODES = {"eager": [], "graphed": ["--cuda-graph-impl", "full_iteration", "--optimizer-cuda-graph"]}
_READS = ("item", "tolist", "__bool__", "__float__", "__int__")


def build(preset: str, mode: str, variant: str, args: argparse.Namespace) -> Trainer:
    flags = ["--preset", preset, "--train-iters", str(10**6), "--seed", "1234",
             "--no-progress-bar", "--log-interval", str(10**6)]  # fmt: skip
    if args.device == "cpu":
        flags.append("--use-cpu")
    if args.bf16:
        flags.append("--bf16")
    flags += args.extra.split() + MODES[mode] + VARIANTS[variant]
    mbs = parse_train_args(flags).micro_batch_size or 8
    flags += ["--global-batch-size", str(mbs * args.num_microbatches)]
    config = build_run_config(parse_train_args(flags), flags)
    return Trainer(config, DistributedContext(device=torch.device(args.device)))


@contextlib.contextmanager
def count_host_reads(sites: collections.Counter[str], cpu_too: bool) -> Iterator[None]:
    """Count ``Tensor`` -> Python conversions (a sync on a device tensor) by call site; CPU
    tensors only with ``cpu_too`` (a CPU run, where every tensor stands for a device one)."""
    saved = {name: getattr(torch.Tensor, name) for name in _READS}

    def wrap(name: str, original: Any) -> Any:
        def counted(self: torch.Tensor, *a: Any, **kw: Any) -> Any:
            if cpu_too or self.device.type != "cpu":
                frame = traceback.extract_stack(limit=2)[0]
                sites[f"{name} at {frame.filename.split('/src/')[-1]}:{frame.lineno}"] += 1
            return original(self, *a, **kw)

        return counted

    for name, original in saved.items():
        setattr(torch.Tensor, name, wrap(name, original))
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)


def run_iterations(trainer: Trainer, start: int, iters: int) -> int:
    for it in range(start, start + iters):
        trainer.scheduler.set_iteration(it)
        if trainer.step.run(it + 1).verdict.exit:
            raise RuntimeError("the rerun state machine asked to exit")
    return start + iters


def profile_variant(trainer: Trainer, args: argparse.Namespace) -> dict[str, Any]:
    it = run_iterations(trainer, 0, args.warmup)
    cuda = args.device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sites: collections.Counter[str] = collections.Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.synchronize()
        with profile(activities=activities) as prof, count_host_reads(sites, not cuda):
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")  # counts the step's implicit syncs
            t0 = time.perf_counter()
            try:
                run_iterations(trainer, it, args.iters)
            finally:
                if cuda:  # before the explicit sync below, which would warn too
                    torch.cuda.set_sync_debug_mode(0)
            host_ms = (time.perf_counter() - t0) * 1e3  # the steps' host time (no final drain)
            if cuda:
                torch.cuda.synchronize()
    events = prof.events()
    aten = [e for e in events if e.name.startswith("aten::")]
    top = [e for e in aten if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    kernels = [e for e in events if e.device_type.name == "CUDA"]
    runtime = [e for e in events if e.device_type.name == "CPU" and e.name.startswith("cuda")]
    n = args.iters
    kernel_us: collections.Counter[str] = collections.Counter()
    for k in kernels:  # device time by kernel name: what the checks add inside a graph
        kernel_us[k.name[:80]] += k.time_range.elapsed_us()
    return {
        "aten_ops": len(aten) / n,
        "top_level_ops": len(top) / n,
        "kernels": len(kernels) / n if cuda else None,
        "host_reads": sum(sites.values()) / n,
        "host_read_sites": {k: v / n for k, v in sites.most_common()},
        "sync_warnings": sum("synchroniz" in str(w.message) for w in caught) / n if cuda else None,
        "top_ops": {k: v / n for k, v in collections.Counter(e.name for e in top).most_common()},
        "kernel_us": {k: v / n for k, v in kernel_us.most_common()},
        "kernel_counts": {
            k: v / n for k, v in collections.Counter(e.name[:80] for e in kernels).most_common()
        },
        "host_ms": host_ms / n,
        "idle": device_idle(kernels, n, top + runtime) if cuda else None,
    }


def device_idle(kernels: list[Any], iters: int, top_ops: list[Any], top: int = 8) -> dict:
    """The device's idle time between the first and last kernel of the profiled iterations (per
    iteration), and the largest gaps with the kernels around them and the host op dispatched
    last before the device resumed: where the host stalls it."""
    spans = sorted((k.time_range.start, k.time_range.end, k.name[:50]) for k in kernels)
    if not spans:
        return {"idle_us": 0.0, "gaps": []}
    host = sorted((e.time_range.start, e.name) for e in top_ops)

    def host_op_before(t: float) -> str:
        names = [name for start, name in host if start <= t]
        return " < ".join(names[-3:])

    gaps, end, last = [], spans[0][1], spans[0][2]
    for start, stop, name in spans[1:]:
        if start > end:
            gap = start - end
            gaps.append(
                (gap, last, name + (f" [host: {host_op_before(start)}]" if gap > 5 else ""))
            )
        if stop > end:
            end, last = stop, name
    idle = sum(g for g, _, _ in gaps)
    small = sum(g for g, _, _ in gaps if g < 5)
    return {
        "idle_us": idle / iters,
        "idle_small_gaps_us": small / iters,  # gaps under 5 us: kernel boundaries
        "span_us": (end - spans[0][0]) / iters,
        "gaps": sorted(gaps, reverse=True)[:top],
    }


def host_profile(trainer: Trainer, start: int, args: argparse.Namespace, label: str) -> None:
    """The Python functions the steps spend host time in (cProfile, after the profiled run)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    run_iterations(trainer, start, args.iters)
    prof.disable()
    print(f"\n[{label}] host functions by own time, {args.iters} iterations:")
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)


def host_busy(trainer: Trainer, start: int, args: argparse.Namespace) -> dict[str, float]:
    """Unprofiled: wall ms per iteration and the part of it the host spends waiting in the
    machine's read (``Event.synchronize``); the rest is host work. Host work close to the wall
    time means the host, not the device, sets the pace."""
    original = torch.cuda.Event.synchronize
    waited = [0.0]

    def timed(self: Any) -> None:
        t = time.perf_counter()
        original(self)
        waited[0] += time.perf_counter() - t

    iters = 5 * args.iters
    torch.cuda.synchronize()
    torch.cuda.Event.synchronize = timed  # type: ignore[method-assign]
    try:
        t0 = time.perf_counter()
        run_iterations(trainer, start, iters)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    finally:
        torch.cuda.Event.synchronize = original  # type: ignore[method-assign]
    return {"wall_ms": wall * 1e3 / iters, "wait_ms": waited[0] * 1e3 / iters}


def measure(preset: str, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"preset": preset, "mode": mode}
    for variant in VARIANTS:
        trainer = build(preset, mode, variant, args)
        out["params"] = sum(1 for p in trainer.step.params)
        try:
            out[variant] = profile_variant(trainer, args)
            if args.device.startswith("cuda"):
                out[variant]["busy"] = host_busy(trainer, 10**5 + 10**4, args)
            if args.cprofile:
                host_profile(trainer, 10**5, args, f"{preset}/{mode}/{variant}")
        finally:
            trainer.close()
    return out


def print_result(r: dict[str, Any], verbose: bool, top: int) -> None:
    print(f"\n{r['preset']} / {r['mode']} ({r['params']} parameter tensors), per iteration")
    print("| variant | aten ops | top-level ops | kernels | host reads |")
    print("|---|---|---|---|---|")
    for v in VARIANTS:
        x = r[v]
        kernels = "-" if x["kernels"] is None else f"{x['kernels']:.0f}"
        print(
            f"| {v} | {x['aten_ops']:.0f} | {x['top_level_ops']:.0f} | {kernels} "
            f"| {x['host_reads']:.1f} |"
        )
    off, on = r["off"], r["checks"]
    extra_k = "" if on["kernels"] is None else f", {on['kernels'] - off['kernels']:+.0f} kernels"
    print(
        f"- checks add {on['aten_ops'] - off['aten_ops']:+.0f} aten ops, "
        f"{on['top_level_ops'] - off['top_level_ops']:+.0f} top-level ops{extra_k}, "
        f"{on['host_reads'] - off['host_reads']:+.1f} host reads"
    )
    if verbose:
        print(f"  host reads (checks): {on['host_read_sites']}")
        names = set(on["top_ops"]) | set(off["top_ops"])
        diff = {k: on["top_ops"].get(k, 0) - off["top_ops"].get(k, 0) for k in names}
        diff = {k: d for k, d in sorted(diff.items(), key=lambda kv: -abs(kv[1])) if d}
        print(f"  top-level ops added: {dict(list(diff.items())[:top])}")
        print(
            f"  host ms / iteration (profiled): off {off['host_ms']:.2f}, checks {on['host_ms']:.2f}"
        )
        if on["kernels"] is not None:
            _print_kernel_diff(off, on, top)
            for name in VARIANTS:
                busy = r[name]["busy"]
                print(
                    f"  {name} unprofiled: {busy['wall_ms']:.3f} ms / iteration, host waiting "
                    f"{busy['wait_ms']:.3f} ms of it (host work {busy['wall_ms'] - busy['wait_ms']:.3f})"
                )
            for name in VARIANTS:
                idle = r[name]["idle"]
                print(
                    f"  {name}: device span {idle['span_us']:.1f} us / iteration, idle "
                    f"{idle['idle_us']:.1f} us (of it gaps < 5 us: {idle['idle_small_gaps_us']:.1f})"
                )
                for gap, before, after in idle["gaps"]:
                    print(f"    gap {gap:8.1f} us after {before} | before {after}")


def _print_kernel_diff(off: dict[str, Any], on: dict[str, Any], top: int) -> None:
    """Kernels whose device time or count differs between the variants (per iteration)."""
    names = set(on["kernel_us"]) | set(off["kernel_us"])
    rows = []
    for k in names:
        dt = on["kernel_us"].get(k, 0.0) - off["kernel_us"].get(k, 0.0)
        dn = on["kernel_counts"].get(k, 0.0) - off["kernel_counts"].get(k, 0.0)
        if dn or abs(dt) > 1.0:
            rows.append((dt, dn, k))
    total = sum(on["kernel_us"].values()) - sum(off["kernel_us"].values())
    print(f"  device time added: {total:+.1f} us / iteration; by kernel (us, count):")
    for dt, dn, k in sorted(rows, key=lambda r: -abs(r[0]))[:top]:
        print(f"    {dt:+8.1f} us {dn:+5.1f}  {k}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--presets", default="tiny,small")
    parser.add_argument("--modes", default=None, help="default: eager (CPU), eager,graphed (CUDA)")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--num-microbatches", type=int, default=4)
    parser.add_argument("--iters", type=int, default=4, help="profiled iterations per variant")
    parser.add_argument("--warmup", type=int, default=4, help="untimed iterations per variant")
    parser.add_argument("--extra", default="", help="more trainer flags for every variant")
    parser.add_argument("--top", type=int, default=25, help="ops listed by -v")
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("--cprofile", action="store_true", help="also the host functions")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.device == "cuda":
        torch.cuda.set_device(0)
        args.device = "cuda:0"
    modes = args.modes or ("eager,graphed" if args.device.startswith("cuda") else "eager")
    results = []
    for preset in args.presets.split(","):
        for mode in modes.split(","):
            results.append(measure(preset, mode, args))
            print_result(results[-1], args.verbose, args.top)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"torch": torch.__version__, "results": results}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
