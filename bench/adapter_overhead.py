"""Benchmark: what stalwart's framework adapters cost per step, side by side with the plain
framework in one process.

Variants (a tiny Hugging Face ``LlamaForCausalLM`` sized by ``--hidden`` / ``--layers``, the same
data and optimizer for all):

* ``hf``: ``transformers.Trainer``; ``hf+stalwart``: ``StalwartTrainer`` + ``StalwartCallback``
  (the rerun state machine's guarded step, default checks);
* ``lightning``: a plain ``LightningModule`` (automatic optimization); ``lightning+stalwart``:
  the same as a ``GuardedModule`` with ``StalwartCallback``.

Each window is one ``train()`` / ``fit()`` of ``--warmup`` + ``--iters`` steps; its figure is the
wall time per step of the last ``--iters`` steps (from a callback's step-end timestamps: set-up,
the first steps and the end are not in it). Windows take turns, the order rotating every round,
so the ratio of each round's windows cancels the drift of a shared machine; reported: the median
ms per step with p10-p90, and the median (p10-p90) of the per-round ratios to the plain run.

``--baseline-src DIR`` adds the adapters of another source tree (``DIR/stalwart``) as variants
``hf+stalwart@base`` and ``lightning+stalwart@base`` in the same rounds and process, and prints
this tree's per-round ratio to them (a change against what it replaced, side by side).
``--ops`` counts what a step dispatches instead of timing it: the aten ops (top level, and with
their children) and on CUDA the kernel launches per timed step, per variant, and by op name where
a guarded variant adds some; each costs host time, which is what a small model's step is made of.

    PYTHONPATH=src python3 bench/adapter_overhead.py                        # CPU, ~2 min
    PYTHONPATH=src python3 bench/adapter_overhead.py --profile hf+stalwart  # cProfile, top 25
    PYTHONPATH=src python3 bench/adapter_overhead.py --device cuda --hidden 512 --layers 4
    git archive 69214fc src | tar -x -C /tmp/base                           # a baseline tree
    PYTHONPATH=src python3 bench/adapter_overhead.py --device cuda --hidden 512 --layers 4 \
        --baseline-src /tmp/base/src
    PYTHONPATH=src python3 bench/adapter_overhead.py --hidden 16 --layers 1 --batch 1 --seq 8 \
        --ops                                # host-bound on CPU: what the adapters dispatch
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

from bench_utils import percentile
from source_versions import SourceVersion

VOCAB, ROWS = 512, 4096
CLOCK = time.perf_counter  # --clock cpu: time.thread_time (this thread's CPU time)
PROFILER: Any = None  # --profile / --ops: enabled over the timed steps (cProfile, OpCounter)
FRAMEWORKS = {"hf": ("hf", "hf+stalwart"), "lightning": ("lightning", "lightning+stalwart")}


def _model(args: argparse.Namespace) -> Any:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=args.seq,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).to(args.device)


def _rows(seq: int) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, VOCAB, (ROWS, seq), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row, "labels": row} for row in ids]


class OpCounter:
    """``torch.profiler`` over the timed steps (``enable``/``disable`` as ``cProfile``): the
    aten ops a step dispatches, and on CUDA the kernel launches (each costs host time)."""

    def __init__(self, device: str) -> None:
        from torch.profiler import ProfilerActivity, profile

        cuda = device.startswith("cuda")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self.profile = profile(activities=activities)
        self.running = False

    def enable(self) -> None:
        self.profile.__enter__()
        self.running = True

    def disable(self) -> None:
        if self.running:
            self.profile.__exit__(None, None, None)
            self.running = False

    def per_step(self, steps: int) -> dict[str, Any]:
        events = self.profile.events()
        aten = [e for e in events if e.name.startswith("aten::")]
        top = [
            e for e in aten if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")
        ]
        by_name: dict[str, float] = {}
        for e in top:
            by_name[e.name] = by_name.get(e.name, 0.0) + 1.0 / steps
        launches = sum(1 for e in events if e.name.startswith(("cudaLaunchKernel", "cuLaunch")))
        return {"top": len(top) / steps, "all": len(aten) / steps,
                "launches": launches / steps, "by_name": by_name}  # fmt: skip


def _count_ops(variants: list[Any], args: argparse.Namespace) -> None:
    """--ops: per variant, the aten ops (top level: what Python dispatched; all: with their
    children) and CUDA kernel launches per timed step, and where the adapters add some."""
    global PROFILER
    counted = {}
    for v in variants:
        with v.version.active():
            v.run()  # warm
            PROFILER = OpCounter(args.device)
            v.run()
            PROFILER.disable()
            counted[v.name] = PROFILER.per_step(args.iters)
            PROFILER = cProfile.Profile()  # and the Python function calls a step makes
            v.run()
            PROFILER.disable()
            counted[v.name]["calls"] = pstats.Stats(PROFILER).total_calls / args.iters
        PROFILER = None
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "ops": counted}, f)
    print("variant                   aten ops/step: top level, all  kernel launches  Python calls")
    for name, c in counted.items():
        print(
            f"{name:25s} {c['top']:8.1f} {c['all']:8.1f}  {c['launches']:14.1f}  {c['calls']:12.1f}"
        )
    for name, c in counted.items():
        base = counted.get(name.split("+")[0])
        if name.endswith("@base"):
            continue
        if base is None or base is c:
            continue
        keys = set(c["by_name"]) | set(base["by_name"])
        diff = {k: c["by_name"].get(k, 0.0) - base["by_name"].get(k, 0.0) for k in keys}
        shown = sorted((k for k in diff if abs(diff[k]) >= 0.05), key=lambda k: -abs(diff[k]))
        print(f"{name} - {name.split('+')[0]}, top-level ops per step: "
              + ", ".join(f"{k.removeprefix('aten::')} {diff[k]:+.1f}" for k in shown))  # fmt: skip


def _break_down(variants: list[Any], args: argparse.Namespace) -> None:
    """--breakdown: per guarded variant, the thread time of the guarded step's parts and the
    adapter's hooks per timed step (bench/step_breakdown.py), median over --rounds windows."""
    global PROFILER
    from step_breakdown import Breakdown

    rows: dict[str, dict[str, list[float]]] = {}
    for r in range(args.rounds):
        for v in variants[r % len(variants) :] + variants[: r % len(variants)]:
            with v.version.active():
                PROFILER = Breakdown()
                if "+stalwart" in v.name:
                    v.__dict__.setdefault("breakdown", PROFILER).instrument()
                    PROFILER = v.breakdown
                    PROFILER.ns.clear()
                v.run()
                PROFILER.disable()
            row = rows.setdefault(v.name, {})
            row.setdefault("whole step", []).append(_ms_per_step(v, args) * 1e3)
            for label, us in PROFILER.per_step_us(args.iters).items():
                row.setdefault(label, []).append(us)
    PROFILER = None
    for name, row in rows.items():
        print(f"{name}: median of {args.rounds} windows, us per step (thread time; p10-p90)")
        for label, values in row.items():
            print(f"  {label:50s} {statistics.median(values):9.1f} "
                  f"({percentile(values, 0.1):.1f}-{percentile(values, 0.9):.1f})")  # fmt: skip


def _stamp(stamps: list[float], args: argparse.Namespace) -> None:
    """A step's end: its timestamp; a profiler runs over the timed steps only (not the set-up,
    the warm-up or the run's end, where the adapters save)."""
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    stamps.append(CLOCK())
    if PROFILER is not None and len(stamps) == args.warmup:
        PROFILER.enable()
    elif PROFILER is not None and len(stamps) == args.warmup + args.iters:
        PROFILER.disable()


class HfVariant:
    def __init__(self, name: str, args: argparse.Namespace, out: str) -> None:
        import transformers

        from stalwart.integrations.hf import StalwartCallback, StalwartTrainer

        stamps = self.stamps = []

        class Stamp(transformers.TrainerCallback):  # type: ignore[misc]
            def on_step_end(self, *a: Any, **k: Any) -> None:
                _stamp(stamps, args)

        self.name = name
        guarded = "+stalwart" in name
        targs = transformers.TrainingArguments(
            os.path.join(out, name), max_steps=args.warmup + args.iters,
            per_device_train_batch_size=args.batch, learning_rate=1e-4, save_strategy="no",
            report_to=[], use_cpu=args.device == "cpu", logging_strategy="no",
            disable_tqdm=True, dataloader_num_workers=0,
        )  # fmt: skip
        callbacks: list[Any] = [Stamp()]
        if guarded:
            callbacks.insert(0, StalwartCallback(goodput=False))
        cls = StalwartTrainer if guarded else transformers.Trainer
        self.trainer = cls(model=_model(args), args=targs, train_dataset=_rows(args.seq),
                           callbacks=callbacks)  # fmt: skip

    def run(self) -> None:
        self.stamps.clear()
        self.trainer.train()


class LightningVariant:
    def __init__(self, name: str, args: argparse.Namespace, out: str) -> None:
        import lightning.pytorch as L

        from stalwart.integrations.lightning import GuardedModule

        stamps = self.stamps = []

        class Stamp(L.Callback):  # type: ignore[misc]
            def on_train_batch_end(self, *a: Any, **k: Any) -> None:
                _stamp(stamps, args)

        class Body(L.LightningModule):  # type: ignore[misc]
            def __init__(self) -> None:
                super().__init__()
                self.model = _model(args)

            def forward_step(self, batch: Any) -> torch.Tensor:
                return self.model(**batch).loss  # type: ignore[no-any-return]

            def configure_optimizers(self) -> Any:
                # --lightning-fused: the gated step (stalwart.integrations.lightning's recipe);
                # without it the guarded step reads the checks before a host-decided step.
                return torch.optim.AdamW(self.parameters(), lr=1e-4, fused=args.lightning_fused)

        class Plain(Body):
            def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
                return self.forward_step(batch)

        class Guarded(GuardedModule, Body):
            forward_step = Body.forward_step

        self.name, self.args, self.out = name, args, os.path.join(out, name)
        self.guarded = "+stalwart" in name
        self.module = Guarded() if self.guarded else Plain()
        self.stamp = Stamp()
        self.loader = torch.utils.data.DataLoader(_rows(args.seq), batch_size=args.batch)
        self.trainer: Any = None

    def run(self) -> None:
        import lightning.pytorch as L

        from stalwart.integrations.lightning import StalwartCallback

        self.stamps.clear()
        callbacks = [self.stamp] + ([StalwartCallback(goodput=False)] if self.guarded else [])
        accelerator = "gpu" if self.args.device.startswith("cuda") else "cpu"
        self.trainer = L.Trainer(
            max_steps=self.args.warmup + self.args.iters, accelerator=accelerator, devices=1,
            callbacks=callbacks, enable_checkpointing=False, logger=False,
            enable_progress_bar=False, enable_model_summary=False, default_root_dir=self.out,
        )  # fmt: skip
        self.trainer.fit(self.module, self.loader)


def _ms_per_step(variant: Any, args: argparse.Namespace) -> float:
    stamps = variant.stamps[args.warmup - 1 :]
    assert len(stamps) == args.iters + 1, (variant.name, len(variant.stamps))
    return (stamps[-1] - stamps[0]) * 1e3 / args.iters


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--frameworks", default="hf,lightning")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64, help="tokens per sample")
    parser.add_argument("--iters", type=int, default=40, help="timed steps per window")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per window")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--profile", default=None, help="cProfile one window of this variant")
    parser.add_argument("--sort", default="tottime", help="--profile: pstats sort key")
    parser.add_argument("--top", type=int, default=30, help="--profile: rows")
    parser.add_argument("--callers", default=None, help="--profile: callers of matching rows")
    parser.add_argument("--dump", default=None, help="--profile: write the pstats file")
    parser.add_argument("--ops", action="store_true",
                        help="count the aten ops and kernel launches per step, per variant")  # fmt: skip
    parser.add_argument("--threads", type=int, default=1, help="torch's CPU threads")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: the main thread's CPU time (a shared CPU machine; with "
                        "--threads 1 every op runs on it)")  # fmt: skip
    parser.add_argument("--breakdown", action="store_true",
                        help="the thread time of the guarded step's parts and the adapters' "
                        "hooks per step (bench/step_breakdown.py); use with --clock cpu")  # fmt: skip
    parser.add_argument("--lightning-fused", action="store_true",
                        help="the Lightning variants' AdamW fused (the guarded step then gates "
                        "it on the device); default: torch's default AdamW, as the README's "
                        "recipe, which the guarded step steps after its read")  # fmt: skip
    parser.add_argument("--baseline-src", default=None,
                        help="another stalwart source tree (its src/): its adapters run as "
                        "variants NAME@base in the same rounds")  # fmt: skip
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    global CLOCK
    CLOCK = time.thread_time if args.clock == "cpu" else time.perf_counter
    import logging

    logging.disable(logging.WARNING)  # the frameworks' and the shell's lines, not the figures
    out = tempfile.mkdtemp(prefix="adapter_overhead_")
    names = [n for f in args.frameworks.split(",") for n in FRAMEWORKS[f]]
    versions = {"": SourceVersion(None, "")}
    if args.baseline_src:  # the adapters of another source tree, as variants "...@base"
        versions["@base"] = SourceVersion(args.baseline_src, "@base")
        names += [n + "@base" for n in names if "+stalwart" in n]
    variants = []
    for n in names:
        version = versions["@base" if n.endswith("@base") else ""]
        with version.active():
            variant = (HfVariant if n.startswith("hf") else LightningVariant)(n, args, out)
        variant.version = version
        variants.append(variant)
    if args.ops:
        _count_ops(variants, args)
        return
    if args.breakdown:
        _break_down(variants, args)
        return
    if args.profile:
        global PROFILER
        (variant,) = [v for v in variants if v.name == args.profile]
        with variant.version.active():
            variant.run()  # warm
            PROFILER = cProfile.Profile()
            variant.run()
            PROFILER.disable()
        if args.dump:
            PROFILER.dump_stats(args.dump)
        stats = pstats.Stats(PROFILER, stream=sys.stdout).sort_stats(args.sort)
        stats.print_stats(args.top)
        if args.callers:
            stats.print_callers(args.callers)
        return
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        for v in variants[r % len(variants) :] + variants[: r % len(variants)]:
            with v.version.active():
                v.run()
            times[v.name].append(_ms_per_step(v, args))
    rows = []
    for name in names:
        base = name.split("+")[0]
        ratios = [a / b for a, b in zip(times[name], times[base], strict=True)]
        rows.append({
            "variant": name, "median_ms": statistics.median(times[name]),
            "p10_ms": percentile(times[name], 0.1), "p90_ms": percentile(times[name], 0.9),
            "ratio": statistics.median(ratios), "ratio_p10": percentile(ratios, 0.1),
            "ratio_p90": percentile(ratios, 0.9),
        })  # fmt: skip
        print(f"{name:25s} {rows[-1]['median_ms']:7.2f} ms ({rows[-1]['p10_ms']:.2f}-"
              f"{rows[-1]['p90_ms']:.2f})  x{rows[-1]['ratio']:.3f} ({rows[-1]['ratio_p10']:.3f}-"
              f"{rows[-1]['ratio_p90']:.3f})")  # fmt: skip
    for name in names:
        if name.endswith("@base"):  # this tree against the baseline tree, round by round
            now = [a / b for a, b in zip(times[name[:-5]], times[name], strict=True)]
            print(f"{name[:-5]} / {name}: x{statistics.median(now):.3f} "
                  f"({percentile(now, 0.1):.3f}-{percentile(now, 0.9):.3f})")  # fmt: skip
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "rows": rows}, f)


if __name__ == "__main__":
    main()
