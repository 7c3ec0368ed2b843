"""Benchmark: eager vs full-iteration CUDA graph (+optimizer graph) vs torch.compile, side by side.

One process, one GPU, every variant on a fresh model (same seed) with 4 micro-batches of bf16
autocast per iteration. Times are CUDA-event medians over ``--iters`` timed iterations after
``--warmup`` untimed ones (graph variants capture during warm-up). The kernel floor is the sum of
device-side event durations from torch.profiler over ``--profile-iters`` iterations.

    PYTHONPATH=src python3 bench/graphs.py --json out.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from stalwart.graphs import (
    FullIterationGraph,
    GraphContext,
    OptimizerGraph,
    compile_for_graph,
    make_capturable_adamw,
)
from stalwart.loop import GraphPlan, GuardedStep
from stalwart.models import GPT, PRESET_MICRO_BATCH_SIZE, preset_model_config
from stalwart.models import num_floating_point_operations as model_flops
from stalwart.reliability.rerun import RerunConfig, RerunDataIterator

from graph_gaps import format_gaps, gap_analysis  # bench/ is the script's directory

NUM_MICROBATCHES = 4
LR = 1e-4
CLIP = 1.0
VARIANTS = (
    "eager",
    "graph",
    "graph_fused_adamw",
    "graph_validation",
    "graph_validation_sync",
    "graph_validation_noread",
    "graph_validation_lagged",
    "graph_guarded",
    "graph_compiled",
    "graph_compiled_fused_adamw",
    "compile_reduce_overhead",
    "compile_reduce_overhead_fused_adamw",
)
COMPILED = (
    "graph_compiled",
    "graph_compiled_fused_adamw",
    "compile_reduce_overhead",
    "compile_reduce_overhead_fused_adamw",
)
PROFILED = ("eager", "graph", "graph_fused_adamw", "graph_compiled", "graph_compiled_fused_adamw")


def forward_backward(
    *,
    forward_step_func: Any,
    data_iterator: Iterator[dict],
    model: Any,
    num_microbatches: int,
    forward_only: bool = False,
    **_unused: Any,
) -> list[dict[str, torch.Tensor]]:
    """No-pipelining schedule with the Megatron forward_backward_func keyword signature."""
    losses = []
    for _ in range(num_microbatches):
        loss, loss_dict = forward_step_func(data_iterator, model)
        if not forward_only:
            (loss / num_microbatches).backward()
        losses.append(loss_dict)
    return losses


class Flags:
    """The bare in-graph check of these variants: a running sum of the losses (non-finite when a
    check failed), a skip gate, and a host read now or one iteration late. The library's own
    check buffer and look-ahead run in ``graph_guarded`` (``GuardedStep`` + ``GraphPlan``)."""

    def __init__(self, device: torch.device) -> None:
        self.total = torch.zeros((), dtype=torch.float32, device=device)

    def reset_(self) -> None:
        self.total.zero_()

    def record_nonfinite(self, name: str, value: torch.Tensor) -> None:
        del name
        self.total.add_(value.detach().float())

    def update_skip_gate_(self, gate: torch.Tensor) -> None:
        gate.copy_(~torch.isfinite(self.total))

    def ok(self) -> bool:
        return bool(torch.isfinite(self.total))  # Deliberate sync: the validation read.

    def read_async(self) -> Callable[[], bool]:
        host = torch.empty((), dtype=torch.float32, pin_memory=True)
        host.copy_(self.total, non_blocking=True)
        event = torch.cuda.Event()
        event.record()

        def result() -> bool:
            event.synchronize()
            return bool(torch.isfinite(host))

        return result


def make_forward_step(flags: Flags | None) -> Callable[..., Any]:
    def forward_step(data_iterator: Iterator[dict], model: Any) -> tuple[torch.Tensor, dict]:
        batch = next(data_iterator)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(batch["input_ids"], batch["labels"])
        if flags is not None:
            flags.record_nonfinite("loss", out["loss"])  # device-side, inside the graph
        return out["loss"], {"lm loss": out["lm loss"]}

    return forward_step


def make_data(preset: str, num_iters: int) -> list[list[dict]]:
    cfg = preset_model_config(preset)
    gen = torch.Generator().manual_seed(0)
    iters = []
    for _ in range(num_iters):
        mbs = []
        for _ in range(NUM_MICROBATCHES):
            tok = torch.randint(
                0,
                cfg.vocab_size,
                (PRESET_MICRO_BATCH_SIZE[preset], cfg.seq_length + 1),
                generator=gen,
            )
            mbs.append({"input_ids": tok[:, :-1].cuda(), "labels": tok[:, 1:].cuda()})
        iters.append(mbs)
    return iters


def _kwargs(model: Any, batches: list[dict], step: Any, seq: int) -> dict[str, Any]:
    return {
        "forward_step_func": step,
        "data_iterator": iter(batches),
        "model": model,
        "num_microbatches": len(batches),
        "seq_length": seq,
        "micro_batch_size": batches[0]["input_ids"].shape[0],
    }


def build_variant(
    variant: str, preset: str
) -> tuple[Callable[[list[dict]], None], GraphContext | None]:
    """Return (one-iteration step function, graph context or None) for a fresh model."""
    if variant == "graph_guarded":
        return build_guarded(preset), None
    torch.manual_seed(1234)
    model = GPT(preset_model_config(preset)).cuda()
    params = list(model.parameters())
    seq = model.config.seq_length
    if variant == "eager" or variant.startswith("compile_reduce_overhead"):
        runner: Any = model
        reduce_overhead = variant.startswith("compile_reduce_overhead")
        if reduce_overhead:
            runner = torch.compile(model, mode="reduce-overhead")
        fused = variant.endswith("fused_adamw")
        opt = torch.optim.AdamW(params, lr=LR, foreach=None if fused else True, fused=fused or None)
        step = make_forward_step(None)

        def eager_step(batches: list[dict]) -> None:
            if reduce_overhead:
                torch.compiler.cudagraph_mark_step_begin()
            opt.zero_grad(set_to_none=True)
            forward_backward(**_kwargs(runner, batches, step, seq))
            torch.nn.utils.clip_grad_norm_(params, CLIP, foreach=True)
            opt.step()

        return eager_step, None
    ctx = GraphContext(torch.device("cuda"))
    validate = variant.startswith("graph_validation")
    device = torch.device("cuda")
    flags = Flags(device) if validate else None
    gate = torch.zeros((), dtype=torch.float32, device=device) if validate else None
    runner = compile_for_graph(model) if variant.startswith("graph_compiled") else model
    fb = FullIterationGraph(
        _gated(forward_backward, flags, gate),
        context=ctx,
        warmup_steps=3,
        grad_params=params,
        validation_buffer=flags,
    )
    fused = validate or variant.endswith("fused_adamw")
    opt_graph = OptimizerGraph(
        make_capturable_adamw(params, lr=LR, device=device, fused=fused),
        context=ctx,
        clip_grad=CLIP,
        skip_gate=gate,
    )
    step = make_forward_step(flags)
    pending: list[Any] = []

    def graph_step(batches: list[dict]) -> None:
        fb(**_kwargs(runner, batches, step, seq))
        if flags is None:
            opt_graph.step(lr=LR)
        elif variant == "graph_validation_sync":
            # Host decides: the read stalls the GPU between the two graphs.
            if flags.ok():
                opt_graph.step(lr=LR)
        elif variant == "graph_validation_lagged":
            # Skip-and-count policy: the device skipped a failed step already; the host learns
            # of it one iteration later (no sync now, no rerun possible).
            opt_graph.step(lr=LR, gated=True, overlap=True)
            opt_graph.join()
            if pending and not pending.pop()():
                raise RuntimeError("benchmark data tripped a check")
            pending.append(flags.read_async())
        else:
            # Device decides (gate): the optimizer replays on a second stream while the host
            # reads the flags ("_noread" skips the read to isolate the in-graph kernels).
            opt_graph.step(lr=LR, gated=True, overlap=True)
            if variant == "graph_validation" and not flags.ok():
                raise RuntimeError("benchmark data tripped a check")
            opt_graph.join()

    return graph_step, ctx


def build_guarded(preset: str) -> Callable[[list[dict]], None]:
    """The library's path: ``GuardedStep`` with ``GraphPlan`` (checks in the machine's buffer,
    gated optimizer graph, the next iteration's replay launched before the read)."""
    torch.manual_seed(1234)
    model = GPT(preset_model_config(preset)).cuda()
    device = torch.device("cuda")
    optimizer = make_capturable_adamw(list(model.parameters()), lr=LR, device=device, fused=True)
    batches: list[dict] = []

    def source() -> Iterator[dict]:
        while True:
            yield from list(batches)

    def forward_step(batch: dict, m: Any) -> dict:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return m(batch["input_ids"], batch["labels"])  # type: ignore[no-any-return]

    step = GuardedStep(
        model=model, optimizer=optimizer, forward_step=forward_step,
        machine=RerunConfig().build(device), data=RerunDataIterator(source()),
        num_microbatches=NUM_MICROBATCHES, plan=GraphPlan(), clip_grad=CLIP,
    )  # fmt: skip
    iteration = [0]

    def guarded_step(data: list[dict]) -> None:
        if not batches:
            batches.extend(data)
        if step.run(iteration[0] + 1).verdict.exit:
            raise RuntimeError("benchmark data tripped a check")
        iteration[0] += 1

    return guarded_step


def _gated(
    func: Callable[..., Any], flags: Flags | None, gate: torch.Tensor | None
) -> Callable[..., Any]:
    """The forward-backward, followed (inside the graph) by the skip-gate update."""
    if flags is None or gate is None:
        return func

    def gated(**kwargs: Any) -> Any:
        out = func(**kwargs)
        flags.update_skip_gate_(gate)
        return out

    return gated


def kernel_time_ms(
    step: Callable[[list[dict]], None], data: list[list[dict]], iters: int
) -> tuple[float, float]:
    """Per-iteration sum of device-side event durations (kernels, memcpy, memset), and count."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(iters):
            step(data[i % len(data)])
        torch.cuda.synchronize()
    total_us, count = 0.0, 0
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            total_us += event.time_range.elapsed_us()
            count += 1
    return total_us / iters / 1000.0, count / iters


def host_profile(
    step: Callable[[list[dict]], None], data: list[list[dict]], iters: int, trace: str | None
) -> str:
    """Host-side view of ``iters`` iterations: CUDA runtime calls and ops by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(iters):
            step(data[i % len(data)])
        torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(trace)
    return str(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))


def time_variant(
    step: Callable[[list[dict]], None], data: list[list[dict]], warmup: int, iters: int
) -> list[float]:
    for i in range(warmup):
        step(data[i % len(data)])
    torch.cuda.synchronize()
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(iters)
    ]
    for i, (start, end) in enumerate(events):
        start.record()  # events around the replay, never inside the graph
        step(data[i % len(data)])
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def run_one(
    preset: str, variant: str, args: argparse.Namespace, data: list[list[dict]]
) -> dict[str, Any]:
    start = time.perf_counter()
    step, ctx = build_variant(variant, preset)
    times = time_variant(step, data, args.warmup, args.iters)
    cfg = preset_model_config(preset)
    median = statistics.median(times)
    flops = model_flops(cfg, PRESET_MICRO_BATCH_SIZE[preset] * NUM_MICROBATCHES)
    row: dict[str, Any] = {
        "preset": preset,
        "variant": variant,
        "median_ms": median,
        "p10_ms": _quantile(times, 0.1),
        "p90_ms": _quantile(times, 0.9),
        "tflops": flops / (median / 1000.0) / 1e12,
        "iters": len(times),
    }
    if args.host_profile and variant in args.host_profile.split(","):
        trace = f"{args.trace_dir}/trace_{preset}_{variant}.json" if args.trace_dir else None
        print(f"host profile {preset} {variant} ({args.profile_iters} iterations):")
        print(host_profile(step, data, args.profile_iters, trace), flush=True)
    if variant in args.gap_analysis.split(","):
        dump = f"{args.trace_dir}/nodes_{preset}_{variant}.tsv" if args.trace_dir else None
        gaps = gap_analysis(step, data, max(3, args.profile_iters), dump)
        print(format_gaps(preset, variant, gaps), flush=True)
        row["gaps"] = {k: v for k, v in gaps.items() if not k.startswith("by_")}
    if variant in PROFILED and args.profile_iters > 0:
        row["kernel_floor_ms"], row["kernels_per_iter"] = kernel_time_ms(
            step, data, args.profile_iters
        )
    row["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    row["reserved_gib"] = torch.cuda.memory_reserved() / 2**30
    if ctx is not None:
        ctx.teardown()
    del step
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    row["wall_s"] = time.perf_counter() - start
    return row


def summarize(rows: list[dict[str, Any]]) -> list[str]:
    by = {(r["preset"], r["variant"]): r for r in rows if "median_ms" in r}
    lines = [
        "| preset | variant | median ms | p10–p90 ms | speedup vs eager | TFLOP/s | kernel floor ms | floor/median |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "median_ms" not in r:
            lines.append(
                f"| {r['preset']} | {r['variant']} | {r.get('error', 'skipped')} | | | | | |"
            )
            continue
        eager = by.get((r["preset"], "eager"))
        speed = f"{eager['median_ms'] / r['median_ms']:.2f}x" if eager else "-"
        floor = r.get("kernel_floor_ms")
        floor_ms = "" if floor is None else f"{floor:.2f}"
        floor_ratio = "" if floor is None else f"{floor / r['median_ms']:.1%}"
        lines.append(
            f"| {r['preset']} | {r['variant']} | {r['median_ms']:.2f} "
            f"| {r['p10_ms']:.2f}–{r['p90_ms']:.2f} | {speed} | {r['tflops']:.1f} "
            f"| {floor_ms} | {floor_ratio} |"
        )
    for preset in dict.fromkeys(r["preset"] for r in rows):
        graph, val = by.get((preset, "graph")), by.get((preset, "graph_validation"))
        # Validation variants use fused AdamW (the gate needs it): compare with the same optimizer.
        graph = by.get((preset, "graph_fused_adamw")) or graph
        noread = by.get((preset, "graph_validation_noread"))
        sync = by.get((preset, "graph_validation_sync"))
        if graph and sync:
            lines.append(
                f"- {preset}: validation with the host read between the graphs "
                f"{sync['median_ms'] / graph['median_ms'] - 1:+.2%}"
            )
        pipelined = by.get((preset, "graph_validation_pipelined"))
        if graph and pipelined:
            lines.append(
                f"- {preset}: rerun-capable validation read while the next iteration runs "
                f"(pipelined) {pipelined['median_ms'] / graph['median_ms'] - 1:+.2%}"
            )
        lagged = by.get((preset, "graph_validation_lagged"))
        if graph and lagged:
            lines.append(
                f"- {preset}: validation read one iteration late (skip-and-count) "
                f"{lagged['median_ms'] / graph['median_ms'] - 1:+.2%}"
            )
        if graph and noread:
            lines.append(
                f"- {preset}: in-graph checks alone (no host read) "
                f"{noread['median_ms'] / graph['median_ms'] - 1:+.2%}"
            )
        gc_, ro = by.get((preset, "graph_compiled")), by.get((preset, "compile_reduce_overhead"))
        if graph and val:
            lines.append(
                f"- {preset}: in-graph validation overhead {val['median_ms'] / graph['median_ms'] - 1:+.2%} (target <= 1%)"
            )
        graph = by.get((preset, "graph"))
        if graph and graph.get("kernel_floor_ms"):
            lines.append(
                f"- {preset}: graph replay at {graph['kernel_floor_ms'] / graph['median_ms']:.1%} of kernel floor (target >= 95%)"
            )
        gcf = by.get((preset, "graph_compiled_fused_adamw"))
        rof = by.get((preset, "compile_reduce_overhead_fused_adamw"))
        if gcf and rof:
            lines.append(
                f"- {preset}: graph+compiled vs reduce-overhead, both fused AdamW "
                f"{rof['median_ms'] / gcf['median_ms']:.2f}x"
            )
        if gc_ and ro and gc_.get("kernel_floor_ms"):
            # What capture scope alone could give: reduce-overhead's time over the compiled
            # model's own kernel floor (both run the same Inductor kernels).
            lines.append(
                f"- {preset}: bound on graph+compiled vs reduce-overhead from capture alone "
                f"{ro['median_ms'] / gc_['kernel_floor_ms']:.2f}x (reduce-overhead median / "
                "graph+compiled kernel floor)"
            )
        if gc_ and ro:
            lines.append(
                f"- {preset}: graph+compiled vs reduce-overhead {ro['median_ms'] / gc_['median_ms']:.2f}x (target >= 1.1x)"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="tiny,small,gpt2-124m")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--profile-iters", type=int, default=3)
    parser.add_argument(
        "--budget-s", type=float, default=1e9, help="skip remaining variants after this"
    )
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--host-profile", default="", help="variants whose host-side profile table is printed"
    )
    parser.add_argument("--trace-dir", default=None, help="Chrome traces of --host-profile")
    parser.add_argument(
        "--gap-analysis", default="", help="variants whose device idle gaps are attributed"
    )
    args = parser.parse_args(argv)
    if args.iters < 20:
        raise ValueError(f"--iters must be >= 20, got {args.iters}")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    presets = args.presets.split(",")
    variants = args.variants.split(",")
    compiled = COMPILED
    # Cheap variants for every preset first, compiled ones last: compile time is what may run out.
    plan = [(p, v) for p in presets for v in variants if v not in compiled]
    plan += [(p, v) for p in presets for v in variants if v in compiled]
    data_by_preset = {preset: make_data(preset, 4) for preset in presets}
    for preset, variant in plan:
        if time.perf_counter() - t0 > args.budget_s:
            rows.append({"preset": preset, "variant": variant, "error": "skipped (time budget)"})
            continue
        if variant in compiled:
            torch._dynamo.reset()
        try:
            row = run_one(preset, variant, args, data_by_preset[preset])
        except Exception as err:  # keep going: one failing variant must not hide the others
            row = {
                "preset": preset,
                "variant": variant,
                "error": f"{type(err).__name__}: {err}"[:300],
            }
            gc.collect()
            torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"torch": torch.__version__, "rows": rows}, fh, indent=1)
    rows.sort(key=lambda r: (presets.index(r["preset"]), variants.index(r["variant"])))
    print("\n".join(summarize(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
