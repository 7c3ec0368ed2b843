"""Benchmark: the lower kernel floor (issue 19) against torch.compile(mode="reduce-overhead").

For each preset, in one process, side by side:

* ``reduce_overhead``: the plain loop users write: ``torch.compile(model, mode="reduce-overhead")``
  under bf16 autocast, ``--num-microbatches`` (4), ``clip_grad_norm_`` and fused AdamW, no checks;
* the reference trainer's guarded step (built by ``Trainer`` from its flags, all its default
  checks on: loss and gradient NaN/Inf, gated optimizer, speculative launch where it applies) on
  the ``--base`` (default ``graph_compiled``: ``--compile --cuda-graph-impl full_iteration
  --optimizer-cuda-graph``, i.e. today's graph + compiled model with fused AdamW in its own
  graph), with each ingredient of the lower floor. Since the fast path
  (``stalwart.config.fast_path``) that base turns on every same-numerics ingredient itself:
  ``today`` is the base alone (what a user gets), ``best`` adds the numerics switch
  ``--bf16-residual-connection``, ``fast_path_off`` is the base with every fast-path setting
  given off (today before the fast path), and the ingredient rows below are measured on top of
  ``fast_path_off`` (each turns on only its own): ``optimizer_in_graph``
  (``--cuda-graph-include-optimizer``), ``bf16_weights`` (``--bf16-compute-weights``),
  ``bf16_residual`` (``--bf16-residual-connection``), ``weights_residual`` (both), ``all``
  (all three), ``weights_residual_clip`` (the best set with ``--clip-grad-in-optimizer``: the
  clip factor in the fused AdamW step's ``grad_scale``, no separate pass over the gradients),
  ``weights_residual_nomix`` (the best set with ``--inductor-config
  triton.mix_order_reduction=False``: no eager fp32 ``sum(dim=0)`` finishing each LayerNorm
  weight/bias gradient), ``weights_residual_split64`` (mix-order reduction in splits of 64 rows:
  4x fewer partial sums), ``weights_residual_clip_nomix`` (clip in the step, no mix-order) and
  ``weights_residual_clip_nomix_fused`` (and ``--gradient-accumulation-fusion``: the
  weight-gradient GEMMs add into the fp32 grads, the lookup adds its rows).

Every variant is built and warmed up first (compile, capture), then they take turns in windows of
``--iters`` iterations timed from a device sync to a device sync (the order rotates every round).
Reported: median ms/iteration over the windows, min-max, TFLOP/s (Megatron's formula), and the
median of the per-round ratios ``reduce_overhead / variant`` (> 1: faster than reduce-overhead)
and ``today / variant`` (what each ingredient buys; ``best``'s is the issue-45 target: today
within 3% of the best set). Then the kernel floor of each variant
(``bench/kernel_sum.py``): ``--profile-iters`` iterations under torch.profiler, the sum of their
kernel times per iteration against the unprofiled median wall time (``wall - kernels``: what
launches and replay add), the union of the kernel intervals, the kernel count, and the sum split
into gemm / attention / Inductor Triton / copy / other kernels. Then (``--trainer-iters`` > 0)
the trainer itself (``stalwart train --log-throughput``, all checks on, i.e. also
``--check-for-spiky-loss --check-for-large-grads``) at ``--trainer-preset`` with the fastest
measured ingredient set (``--trainer-variant auto``), as the fraction of 989 TFLOP/s.

Compile times are minutes: variants are built in priority order while the ``--budget-s`` share
of their preset lasts (the first two always), results print as they come and the JSON is
rewritten after each preset. Targets: graph + compiled >= 1.1x reduce-overhead at small and
gpt2-124m, >= 3x at tiny; the trainer >= 45% of 989 TFLOP/s at gpt2-124m.

    PYTHONPATH=src python3 bench/kernel_floor.py --presets small,gpt2-124m --budget-s 200 \\
        --trainer-iters 0 --json $OUT/kernel_floor.json       # the H200 (scripts/gpu_check.sh)
    PYTHONPATH=src python3 bench/kernel_floor.py --presets gpt2-124m --variants \\
        reduce_overhead,today,best,fast_path_off --profile-iters 0 --trainer-iters 0 \\
        --budget-s 400                                        # the fast path vs the best set
    PYTHONPATH=src python3 bench/kernel_floor.py --smoke       # CPU, seconds; figures meaningless
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from stalwart.cli.args import parse_train_args
from stalwart.config import fast_path
from stalwart.config.inductor import known_inductor_options
from stalwart.config.run import RunConfig, build_run_config
from stalwart.distributed.process_group import DistributedContext
from stalwart.models import GPT, num_floating_point_operations
from stalwart.train.trainer import Trainer

from bench_utils import sync  # bench/ is the script's directory
from kernel_sum import kernel_floor, print_floor, print_gaps

SRC = Path(__file__).resolve().parents[1] / "src"
PEAK_TFLOPS = 989.0  # H200 dense bf16, datasheet
ALL_CHECKS = ["--check-for-spiky-loss", "--check-for-large-grads"]
BASES = {
    "graph_compiled": [
        "--compile",
        "--cuda-graph-impl",
        "full_iteration",
        "--optimizer-cuda-graph",
    ],
    "graph": ["--cuda-graph-impl", "full_iteration", "--optimizer-cuda-graph"],
    "eager": [],
}
BEST = ["--bf16-compute-weights", "--bf16-residual-connection"]
NO_MIX_ORDER = ["--inductor-config", "triton.mix_order_reduction=False"]
SPLIT_64 = ["--inductor-config", "triton.mix_order_reduction_split_size=64"]
# The fast path's settings (stalwart.config.fast_path): off, each unless a variant sets it.
FAST_PATH_SWITCHES = [f"--{name.replace('_', '-')}" for name in fast_path.SWITCHES]
INGREDIENTS = {
    "today": [],
    # The fast path and the numerics switch: the fastest set with every check on.
    "best": ["--bf16-residual-connection"],
    # today before the fast path: every fast-path setting given off.
    "fast_path_off": [],
    "optimizer_in_graph": ["--cuda-graph-include-optimizer"],
    "bf16_weights": ["--bf16-compute-weights"],
    "bf16_residual": ["--bf16-residual-connection"],
    "weights_residual": ["--bf16-compute-weights", "--bf16-residual-connection"],
    "all": [
        "--bf16-compute-weights",
        "--bf16-residual-connection",
        "--cuda-graph-include-optimizer",
    ],
    # The best set with the clip factor inside the fused AdamW step (one pass over the grads less).
    "weights_residual_clip": [*BEST, "--clip-grad-in-optimizer"],
    # The best set without Inductor's mix-order reduction: the LayerNorm backward's weight and
    # bias sums are Triton kernels again instead of a fused kernel + an eager fp32 sum(dim=0)
    # per weight and bias (the 200 aten reduce kernels per iteration at gpt2-124m).
    "weights_residual_nomix": [*BEST, *NO_MIX_ORDER],
    # ... or with it, in fewer, larger splits (the final eager sums read 4x fewer partials).
    "weights_residual_split64": [*BEST, *SPLIT_64],
    "weights_residual_clip_nomix": [*BEST, "--clip-grad-in-optimizer", *NO_MIX_ORDER],
    # ... and Megatron's gradient accumulation fusion: the weight-gradient GEMMs add into the
    # fp32 grads (no bf16 grad + foreach add per micro-batch), the lookup adds its rows.
    "weights_residual_clip_nomix_fused": [
        *BEST,
        "--clip-grad-in-optimizer",
        *NO_MIX_ORDER,
        "--gradient-accumulation-fusion",
    ],
    # ... and the output layer + loss as one op whose forward writes the logits' gradient in
    # place (--cross-entropy-loss-fusion: one pass over the [tokens, vocab] logits less).
    "weights_residual_clip_nomix_fused_ce": [
        *BEST,
        "--clip-grad-in-optimizer",
        *NO_MIX_ORDER,
        "--gradient-accumulation-fusion",
        "--cross-entropy-loss-fusion",
    ],
}
BASELINES = ("reduce_overhead", "plain_eager")
ON_THE_FAST_PATH = ("today", "best")  # the variants that keep the fast path's defaults
# Priority order: the baseline, the best set (the target's ratio; built even when compiles eat
# the budget: bf16 weights + bf16 residual, the clip in the step, no mix-order reduction,
# gradient accumulation fusion, the fused loss, the optimizer in its own graph so the next
# iteration is launched ahead), the same without the fused loss, the bf16 weights + residual
# alone, today, all three (the optimizer in the graph: no launch ahead),
# then the single ingredients (those sharing a compiled model graph with an earlier variant
# compile from the cache).
DEFAULT_VARIANTS = (
    "reduce_overhead,today,best,fast_path_off,weights_residual_clip_nomix_fused_ce,"
    "weights_residual_clip_nomix_fused,weights_residual,weights_residual_clip,"
    "all,optimizer_in_graph,bf16_weights,bf16_residual"
)
PRESET_WEIGHT = {"gpt2-124m": 3.0, "small": 2.0}  # budget shares (others 1)
TFLOPS_LINE = re.compile(r"iteration\s+(\d+)/.*?throughput per GPU \(TFLOP/s/GPU\): ([0-9.]+)")


def variant_flags(preset: str, name: str, args: argparse.Namespace) -> list[str]:
    """The trainer flags of a variant (the plain baselines read the model shape from them)."""
    flags = ["--preset", preset, "--train-iters", str(10**6), "--seed", "1234", "--bf16",
             "--no-progress-bar", "--log-interval", str(10**6), "--eval-interval", "0",
             "--log-format", "megatron"]  # fmt: skip
    if args.device == "cpu":
        flags.append("--use-cpu")
    flags += args.extra.split()
    mbs = parse_train_args(flags).micro_batch_size or 8
    flags += ["--global-batch-size", str(mbs * args.num_microbatches)]
    if name in BASELINES:
        return flags
    own = INGREDIENTS[name]
    off = (
        fast_path_off(own) if args.base == "graph_compiled" and name not in ON_THE_FAST_PATH else []
    )
    return flags + BASES[args.base] + off + own


def fast_path_off(own: list[str]) -> list[str]:
    """The flags that turn off every fast-path setting ``own`` does not set: ``--no-<switch>``
    and ``--inductor-config KEY=<this torch's default>`` (an ingredient row measures its own
    flags over today before the fast path)."""
    off = [f"--no-{flag[2:]}" for flag in FAST_PATH_SWITCHES if flag not in own]
    given = {
        own[i + 1].partition("=")[0] for i, f in enumerate(own[:-1]) if f == "--inductor-config"
    }
    known = known_inductor_options()
    for key, _ in fast_path.INDUCTOR_OPTIONS:
        if key in known and key not in given:
            off += ["--inductor-config", f"{key}={known[key]}"]
    return off


def config_of(flags: list[str]) -> RunConfig:
    return build_run_config(parse_train_args(flags), flags)


@dataclass
class TrainerVariant:
    """The trainer's guarded step, stepped in place (no logging, no exit decisions)."""

    name: str
    trainer: Trainer
    iteration: int = 0
    counted: list[int] = field(default_factory=lambda: [0, 0])  # [iterations, launched ahead]

    def run(self, iters: int) -> None:
        t = self.trainer
        launched = t.step.num_launched
        for _ in range(iters):
            t.scheduler.set_iteration(self.iteration)
            if t.step.run(self.iteration + 1).verdict.exit:
                raise RuntimeError(f"{self.name}: the rerun state machine asked to exit")
            self.iteration += 1
        self.counted[0] += iters
        self.counted[1] += t.step.num_launched - launched

    @property
    def launched_per_iter(self) -> float | None:
        """Next iterations launched before the host read, per iteration (1.0: every one)."""
        return self.counted[1] / self.counted[0] if self.counted[0] else None

    def close(self) -> None:
        self.trainer.close()


@dataclass
class PlainVariant:
    """``reduce_overhead`` (or ``plain_eager``): the loop a user writes around torch.compile."""

    name: str
    config: RunConfig
    device: torch.device
    model: Any = None
    optimizer: Any = None
    batches: list[dict[str, torch.Tensor]] = field(default_factory=list)

    def __post_init__(self) -> None:
        torch.manual_seed(1234)
        raw = GPT(self.config.model).to(self.device)
        self.params = list(raw.parameters())
        self.model = torch.compile(raw, mode="reduce-overhead") if self.compiled else raw
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-4, fused=True)
        gen = torch.Generator().manual_seed(0)
        m, mbs = self.config.model, self.config.training.micro_batch_size
        self.num_microbatches = (self.config.training.global_batch_size or mbs) // mbs
        for _ in range(self.num_microbatches):
            tokens = torch.randint(0, m.vocab_size, (mbs, m.seq_length + 1), generator=gen)
            self.batches.append(
                {"ids": tokens[:, :-1].to(self.device), "labels": tokens[:, 1:].to(self.device)}
            )

    launched_per_iter = None  # the plain loop reads nothing on the host: nothing to launch

    @property
    def compiled(self) -> bool:
        return self.name == "reduce_overhead"

    def run(self, iters: int) -> None:
        for _ in range(iters):
            if self.compiled:
                torch.compiler.cudagraph_mark_step_begin()
            self.optimizer.zero_grad(set_to_none=True)
            for batch in self.batches:
                with torch.autocast(self.device.type, dtype=torch.bfloat16):
                    out = self.model(batch["ids"], batch["labels"])
                (out["loss"] / self.num_microbatches).backward()
            torch.nn.utils.clip_grad_norm_(self.params, 1.0, foreach=True)
            self.optimizer.step()

    def close(self) -> None:
        self.model = self.optimizer = None
        self.batches.clear()


def build(preset: str, name: str, args: argparse.Namespace) -> TrainerVariant | PlainVariant:
    device = torch.device(args.device)
    config = config_of(variant_flags(preset, name, args))
    if name in BASELINES:
        return PlainVariant(name, config, device)
    return TrainerVariant(name, Trainer(config, DistributedContext(device=device)))


def _timed(variants: list[Any], args: argparse.Namespace) -> dict[str, list[float]]:
    """ms/iteration per window; the order rotates every round."""
    device = torch.device(args.device)
    times: dict[str, list[float]] = {v.name: [] for v in variants}
    for v in variants:
        if isinstance(v, TrainerVariant):
            v.counted = [0, 0]  # the timed windows' launches only (not the warm-up's)
    for r in range(args.rounds):
        for v in variants[r % len(variants) :] + variants[: r % len(variants)]:
            sync(device)
            start = time.perf_counter()
            v.run(args.iters)
            sync(device)
            times[v.name].append((time.perf_counter() - start) * 1e3 / args.iters)
    return times


def _build_all(
    preset: str, names: list[str], args: argparse.Namespace, deadline: float
) -> tuple[list[Any], dict[str, dict[str, Any]]]:
    """Build and warm up ``names`` in order while the deadline allows (the first two always)."""
    built: list[Any] = []
    notes: dict[str, dict[str, Any]] = {}
    estimate = 0.0
    for index, name in enumerate(names):
        if index >= 2 and time.perf_counter() + estimate > deadline:
            notes[name] = {"error": "skipped (time budget)"}
            continue
        start = time.perf_counter()
        try:
            variant = build(preset, name, args)
            variant.run(args.warmup)  # compile, capture, allocator and autotuning
            sync(torch.device(args.device))
        except Exception as err:  # one failing variant must not hide the others
            notes[name] = {"error": f"{type(err).__name__}: {err}"[:300]}
            print(json.dumps({"preset": preset, "variant": name, **notes[name]}), flush=True)
            gc.collect()
            continue
        seconds = time.perf_counter() - start
        estimate = max(estimate, seconds)
        notes[name] = {"build_s": round(seconds, 1)}
        print(json.dumps({"preset": preset, "variant": name, **notes[name]}), flush=True)
        built.append(variant)
    return built, notes


def measure(preset: str, names: list[str], args: argparse.Namespace, deadline: float) -> dict:
    device = torch.device(args.device)
    variants, notes = _build_all(preset, names, args, deadline)
    times = _timed(variants, args) if variants else {}
    launched = {v.name: v.launched_per_iter for v in variants}
    floors = _floors(variants, times, args, deadline)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    for v in variants:
        v.close()
    del variants
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    torch._dynamo.reset()  # next preset: fresh compile caches (no recompile limit hit)
    config = config_of(variant_flags(preset, "today", args))
    flops = num_floating_point_operations(config.model, config.training.global_batch_size or 0)
    result = summarize(preset, names, times, notes, flops)
    for row in result["rows"]:
        if row["variant"] in floors:
            row["floor"] = floors[row["variant"]]
        if launched.get(row["variant"]) is not None:
            row["launched_per_iter"] = launched[row["variant"]]
    return result | {"peak_allocated_gib": peak}


def _floors(
    variants: list[Any], times: dict[str, list[float]], args: argparse.Namespace, deadline: float
) -> dict[str, dict[str, Any]]:
    """The kernel floor of each timed variant (``--profile-iters`` under torch.profiler), in
    priority order while the preset's time lasts (the first three always: the baseline, all
    and today, a few seconds each)."""
    floors: dict[str, dict[str, Any]] = {}
    if args.profile_iters <= 0:
        return floors
    device = torch.device(args.device)
    for index, v in enumerate(variants):
        if index >= 3 and time.perf_counter() > deadline:
            floors[v.name] = {"error": "skipped (time budget)"}
            continue
        wall = statistics.median(times[v.name]) if times.get(v.name) else None
        try:
            floors[v.name] = kernel_floor(
                v.run, args.profile_iters, device, wall, args.gap_us, args.gap_top
            )
        except Exception as err:  # a profiler failure must not lose the timings
            floors[v.name] = {"error": f"{type(err).__name__}: {err}"[:300]}
    return floors


def summarize(
    preset: str,
    names: list[str],
    times: dict[str, list[float]],
    notes: dict[str, dict[str, Any]],
    flops: float,
) -> dict[str, Any]:
    base_name = next((n for n in names if n in BASELINES and n in times), None)
    today = times.get("today")
    rows = []
    for name in names:
        row: dict[str, Any] = {"variant": name, **notes.get(name, {})}
        t = times.get(name)
        if t:
            median = statistics.median(t)
            row |= {"median_ms": median, "min_ms": min(t), "max_ms": max(t),
                    "tflops": flops / (median / 1e3) / 1e12}  # fmt: skip
            if base_name:
                row["vs_baseline"] = statistics.median(
                    [b / a for a, b in zip(t, times[base_name], strict=True)]
                )
            if today and name != "today":
                row["vs_today"] = statistics.median([b / a for a, b in zip(t, today, strict=True)])
        rows.append(row)
    return {"preset": preset, "baseline": base_name, "rows": rows}


def print_result(result: dict[str, Any], base: str) -> None:
    baseline = result["baseline"] or "-"
    print(f"\n{result['preset']} (base {base}; ratios: {baseline} / variant, per-round median)")
    print(
        "| variant | median ms/iter | min-max | TFLOP/s | vs "
        + baseline
        + " | vs today | build s |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        if "median_ms" not in r:
            print(f"| {r['variant']} | {r.get('error', 'not run')} | | | | | |")
            continue
        ratio = f"{r['vs_baseline']:.3f}x" if "vs_baseline" in r else ""
        today = f"{r['vs_today']:.3f}x" if "vs_today" in r else ""
        print(
            f"| {r['variant']} | {r['median_ms']:.2f} | {r['min_ms']:.2f}-{r['max_ms']:.2f} "
            f"| {r['tflops']:.1f} | {ratio} | {today} | {r.get('build_s', '')} |"
        )
    print_floor(result)
    print_gaps(result)
    sys.stdout.flush()


def trainer_variant(args: argparse.Namespace, results: list[dict[str, Any]]) -> str:
    """``auto``: the fastest ingredient set measured at the trainer's preset (else ``all``)."""
    if args.trainer_variant != "auto":
        return str(args.trainer_variant)
    rows = [
        r
        for result in results
        if result["preset"] == args.trainer_preset
        for r in result["rows"]
        if "median_ms" in r and r["variant"] in INGREDIENTS
    ]
    return min(rows, key=lambda r: r["median_ms"])["variant"] if rows else "all"


def trainer_flags(args: argparse.Namespace, name: str) -> list[str]:
    """The variant's flags for a real ``stalwart train`` run: ``--trainer-iters`` iterations,
    throughput logged every ``--trainer-log-interval``, all checks on."""
    flags = variant_flags(args.trainer_preset, name, args)
    flags[flags.index("--train-iters") + 1] = str(args.trainer_iters)
    flags[flags.index("--log-interval") + 1] = str(args.trainer_log_interval)
    return [*flags, "--log-throughput", *ALL_CHECKS]


def run_trainer(args: argparse.Namespace, name: str, timeout: float) -> dict[str, Any]:
    """``stalwart train`` with all checks on; TFLOP/s from the last log intervals."""
    cmd = [sys.executable, "-m", "stalwart", "train", *trainer_flags(args, name)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    result: dict[str, Any] = {
        "preset": args.trainer_preset,
        "variant": name,
        "command": " ".join(cmd),
    }
    print(f"\ntrainer: {' '.join(cmd[1:])}", flush=True)
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as err:
        out = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        result["error"] = f"timed out after {timeout:.0f} s"
    else:
        out = proc.stdout + proc.stderr
        result["exit_code"] = proc.returncode
    result["wall_s"] = round(time.perf_counter() - start, 1)
    values = [(int(i), float(v)) for i, v in TFLOPS_LINE.findall(out)]
    steady = [v for i, v in values if i > args.trainer_log_interval][-args.trainer_windows :]
    if steady:
        result["tflops_windows"] = steady
        result["tflops"] = statistics.median(steady)
        result["fraction_of_peak"] = result["tflops"] / PEAK_TFLOPS
    else:
        result["log_tail"] = out[-2000:]
    print(json.dumps({k: v for k, v in result.items() if k != "log_tail"}), flush=True)
    return result


def print_targets(results: list[dict[str, Any]], trainer: dict[str, Any] | None) -> None:
    targets = {"tiny": 3.0, "small": 1.1, "gpt2-124m": 1.1}
    print("\ntargets")
    for result in results:
        rows = [r for r in result["rows"] if "vs_baseline" in r and r["variant"] in INGREDIENTS]
        if not rows:
            continue
        best = max(rows, key=lambda r: r["vs_baseline"])
        today = next((r for r in rows if r["variant"] == "today"), None)
        goal = targets.get(result["preset"])
        verdict = "" if goal is None else (" PASS" if best["vs_baseline"] >= goal else " FAIL")
        shown = f" (target >= {goal}x)" if goal else ""
        was = f"; today {today['vs_baseline']:.3f}x" if today else ""
        print(f"- {result['preset']}: best {best['variant']} {best['vs_baseline']:.3f}x "
              f"{result['baseline']}{shown}{verdict}{was}")  # fmt: skip
        fast = next((r for r in rows if r["variant"] == "best" and "vs_today" in r), None)
        if fast is not None:  # today / best per round: today within 3% of the best set
            ok = "PASS" if fast["vs_today"] <= 1.03 else "FAIL"
            print(
                f"- {result['preset']}: today / best = {fast['vs_today']:.3f} "
                f"(target <= 1.03: today within 3% of the best set) {ok}"
            )
    if trainer and "tflops" in trainer:
        ok = " PASS" if trainer["fraction_of_peak"] >= 0.45 else " FAIL"
        print(f"- trainer {trainer['preset']} {trainer['variant']}: {trainer['tflops']:.1f} "
              f"TFLOP/s = {trainer['fraction_of_peak']:.1%} of {PEAK_TFLOPS:.0f} (target >= 45%){ok}")  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--presets", default="gpt2-124m,small,tiny")
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help="in priority order")
    p.add_argument("--base", choices=sorted(BASES), default="graph_compiled")
    p.add_argument("--num-microbatches", type=int, default=4)
    p.add_argument("--iters", type=int, default=8, help="iterations per timed window")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=8, help="untimed iterations (compile, capture)")
    p.add_argument("--budget-s", type=float, default=300.0, help="whole run, trainer included")
    p.add_argument("--extra", default="", help="more trainer flags for every variant")
    p.add_argument("--trainer-preset", default="gpt2-124m")
    p.add_argument("--trainer-variant", default="auto", help="auto or an ingredient set")
    p.add_argument("--trainer-iters", type=int, default=150, help="0: no trainer run")
    p.add_argument("--trainer-log-interval", type=int, default=25)
    p.add_argument("--trainer-windows", type=int, default=3, help="last log intervals measured")
    p.add_argument("--trainer-timeout-s", type=float, default=110.0)
    p.add_argument("--profile-iters", type=int, default=2, help="kernel floor; 0: off")
    p.add_argument("--gap-us", type=float, default=5.0, help="device gaps counted as large")
    p.add_argument("--gap-top", type=int, default=5, help="largest gaps listed per variant")
    p.add_argument("--json", default=None)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, seconds (a test)")
    return p


SMOKE_SHAPE = ("--num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 16 "
               "--vocab-size 256 --micro-batch-size 2")  # fmt: skip


def smoke(args: argparse.Namespace) -> argparse.Namespace:
    """``--smoke``: the whole script on CPU in seconds (graphs need CUDA, so the eager base and
    the ingredients that work without a graph); the figures mean nothing."""
    return argparse.Namespace(**(vars(args) | dict(
        device="cpu", presets="tiny", base="eager", iters=1, rounds=2, warmup=1,
        num_microbatches=2, variants="plain_eager,today,weights_residual,weights_residual_clip",
        profile_iters=1, trainer_iters=0, extra=f"{SMOKE_SHAPE} {args.extra}".strip(),
    )))  # fmt: skip


def _deadline(preset: str, pending: list[str], end: float, reserve: float) -> float:
    """This preset's share of what is left (the trainer's time reserved while it is pending)."""
    now = time.perf_counter()
    weights = [PRESET_WEIGHT.get(p, 1.0) for p in pending]
    share = PRESET_WEIGHT.get(preset, 1.0) / sum(weights)
    return now + max(0.0, end - now - reserve) * share


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.smoke:
        args = smoke(args)
    names = args.variants.split(",")
    unknown = [n for n in names if n not in INGREDIENTS and n not in BASELINES]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; allowed: {[*BASELINES, *INGREDIENTS]}")
    if args.device == "cuda":
        torch.cuda.set_device(0)
        args.device = "cuda:0"
        print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    for limit in ("cache_size_limit", "recompile_limit"):  # 7 variants may each add one entry
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, 64)
    end = time.perf_counter() + args.budget_s
    presets = args.presets.split(",")
    results: list[dict[str, Any]] = []
    trainer: dict[str, Any] | None = None
    for index, preset in enumerate(presets):
        pending_trainer = trainer is None and args.trainer_iters > 0
        reserve = args.trainer_timeout_s if pending_trainer else 0.0
        result = measure(preset, names, args, _deadline(preset, presets[index:], end, reserve))
        results.append(result)
        print_result(result, args.base)
        if pending_trainer and preset == args.trainer_preset:
            trainer = run_trainer(args, trainer_variant(args, results), args.trainer_timeout_s)
        _write(args.json, results, trainer)
    if trainer is None and args.trainer_iters > 0:
        trainer = run_trainer(args, trainer_variant(args, results), args.trainer_timeout_s)
        _write(args.json, results, trainer)
    if not args.smoke:
        print_targets(results, trainer)
    return 0


def _write(path: str | None, results: list[dict[str, Any]], trainer: dict[str, Any] | None) -> None:
    if path:
        with open(path, "w") as fh:
            json.dump({"torch": torch.__version__, "results": results, "trainer": trainer}, fh,
                      indent=1)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
