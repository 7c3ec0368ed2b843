"""Where a ``stalwart train`` process spends its start-up: wall time per phase, to the end of its
first iteration.

Runs ``python -m stalwart <args>`` in this process with wall-clock timers wrapped around the
start-up's parts (the imports, the process group, each builder of the trainer, the checkpoint
load, the first iteration), and writes their spans to ``--out`` (JSON). Nothing else changes:
the timers read ``time.perf_counter`` around the same calls (no sync, no extra work), and the
run's exit code is this process's. A part that does not exist in this version (the trainer
being refactored) is left out and listed under ``missing``.

    PYTHONPATH=src python bench/startup_phases.py --out phases.json -- train --preset tiny ...

``bench/warm_restart.py --phases`` runs its relaunches through this and prints the table.
``STALWART_BENCH_LAUNCH`` (a ``time.time()`` taken by the caller just before it started this
process) gives the interpreter's own start-up as the first phase.

With ``launch --fork-workers`` after ``--``, the launcher runs untimed and each worker it forks
for a restart (round 1 on) is timed from its fork instead ({rank} and {round} in the paths).
"""

from __future__ import annotations

import argparse
import atexit
import functools
import importlib
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

# (label, "module:attribute.path"): every call is timed; nesting is by time.
TARGETS = [
    ("cli: parse flags, build and check the config", "stalwart.cli.args:parse_train_args"),
    ("cli: parse flags, build and check the config", "stalwart.config.run:build_run_config"),
    ("process group", "stalwart.cli.train:init_distributed"),
    ("trainer build (all)", "stalwart.train.trainer:Trainer._build"),
    ("  checkpoint manager (--save probed, locked)", "stalwart.config.training:CheckpointConfig.build"),
    ("  data: datasets and batch schedule", "stalwart.train.build:resolve_config"),
    ("  memory estimate", "stalwart.train.build:memory_estimate"),
    ("  shell: ledger, watchdog, rerun machine, timers, sinks, probes, log", "stalwart.loop.shell_config:ShellConfig.build"),
    ("  compile cache: open (Inductor import, artifacts load)", "stalwart.compile.cache:CompileCache.open"),
    ("    compile cache: trust check (the path, every entry)", "stalwart.compile.cache:check_cache_dir"),
    ("    compile cache: load artifacts.bin", "stalwart.compile.cache:CompileCache._load"),
    ("  model: build, DDP, torch.compile wrapper", "stalwart.train.build:build_model"),
    ("    model: DDP/FSDP2 wrapper", "stalwart.train.build:wrap_model"),
    ("    model: torch.compile wrapper", "torch.nn.modules.module:Module.compile"),
    ("    DDP bucket layout (3+ ranks: one backward)", "stalwart.train.build:settle_bucket_layout"),
    ("  optimizer", "stalwart.train.build:build_optimizer"),
    ("  sampler", "stalwart.train.build:build_sampler"),
    ("  flop count", "stalwart.train.trainer:num_floating_point_operations"),
    ("  guarded step (plan, graphs)", "stalwart.train.trainer:Trainer._build_step"),
    ("checkpoint load (--load)", "stalwart.train.trainer:Trainer.load"),
    ("first iteration (warm compile, capture)", "stalwart.train.trainer:Trainer._run_iteration"),
    ("compile cache: save artifacts", "stalwart.compile.cache:CompileCache.save"),
    ("CUDA initialisation (inside the phase that first used CUDA)", "torch.cuda:_lazy_init"),
]  # fmt: skip

FIRST_ONLY = {"stalwart.train.trainer:Trainer._run_iteration",
              "stalwart.compile.cache:CompileCache.save", "torch.cuda:_lazy_init"}  # fmt: skip


class Recorder:
    """The spans of the timed calls (``(label, start, end)``, seconds since ``origin``)."""

    def __init__(self, origin: float) -> None:
        self.origin = origin
        self.spans: list[dict[str, Any]] = []
        self.missing: list[str] = []
        self.seen: set[str] = set()

    def span(self, label: str, start: float, end: float, cpu: float | None = None) -> None:
        row = {"phase": label, "start": start - self.origin, "end": end - self.origin}
        if cpu is not None:
            row["cpu"] = cpu  # this process's CPU seconds (every thread) during the span
        self.spans.append(row)

    def wrap(self, label: str, target: str) -> None:
        module_name, _, path = target.partition(":")
        try:
            owner: Any = importlib.import_module(module_name)
            *parents, name = path.split(".")
            for part in parents:
                owner = getattr(owner, part)
            original = getattr(owner, name)
        except (ImportError, AttributeError):
            self.missing.append(target)
            return
        setattr(owner, name, self._timed(label, target, original))

    def _timed(self, label: str, target: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if target in FIRST_ONLY and target in self.seen:
                return fn(*args, **kwargs)
            self.seen.add(target)
            start, cpu = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.span(label, start, time.perf_counter(), time.process_time() - cpu)

        return timed


def _dump(rec: Recorder, out: str, profiler: Any, profile: str | None) -> None:
    rec.span("process end (exit handlers not included)", time.perf_counter(), time.perf_counter())
    with open(out, "w") as f:
        json.dump({"spans": rec.spans, "missing": rec.missing}, f)
    if profiler is None or profile is None:
        return
    import io
    import pstats

    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("cumulative").print_stats(80)
    stats.sort_stats("tottime").print_stats(40)
    with open(profile, "w") as f:
        f.write(text.getvalue())


def time_forked_restarts(out: str, profile: str | None) -> None:
    """Wrap the function ``stalwart launch --fork-workers`` forks its workers into: a worker of
    a restart round runs under the phase timers (and cProfile), from its fork; it ends in
    ``os._exit`` (no exit handlers), so it writes its files itself."""
    import stalwart.cli.launch as launch

    original = launch.forked_worker

    def worker(*argv: str) -> None:
        round_ = os.environ.get("STALWART_LAUNCH_ROUND", "0")
        if round_ == "0":
            return original(*argv)
        rec = Recorder(time.perf_counter())
        for label, target in TARGETS:
            rec.wrap(label, target)
        where = {"rank": os.environ.get("RANK", "0"), "round": round_}
        profiler = None
        if profile is not None:
            import cProfile

            profiler = cProfile.Profile()
        try:
            if profiler is None:
                return original(*argv)
            return profiler.runcall(original, *argv)
        finally:
            _dump(rec, out.format(**where), profiler, profile and profile.format(**where))

    launch.forked_worker = worker


def main() -> int:
    argv = sys.argv[1:]
    own, rest = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])  # fmt: skip
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="the JSON file ({rank}: RANK of the environment)")
    p.add_argument("--profile", help="also a cProfile of the run after the imports (text, top 80)")
    args = p.parse_args(own)
    if rest[:1] == ["launch"]:
        import stalwart.__main__ as launcher

        time_forked_restarts(args.out, args.profile)
        sys.argv = ["stalwart", *rest]
        return launcher.run()
    args.out = args.out.replace("{rank}", os.environ.get("RANK", "0"))
    # perf_counter and time.time() differ by a constant: the launch time maps onto perf_counter.
    offset = time.time() - time.perf_counter()
    launched = float(os.environ.get("STALWART_BENCH_LAUNCH", time.time())) - offset
    rec = Recorder(launched)
    rec.span("interpreter start (python, site, this harness)", launched, time.perf_counter())
    start, cpu = time.perf_counter(), time.process_time()
    import torch  # noqa: F401  (the import's own time: every trainer process pays it)

    rec.span("import torch", start, time.perf_counter(), time.process_time() - cpu)
    start, cpu = time.perf_counter(), time.process_time()
    import stalwart.__main__ as entry
    import stalwart.train.trainer  # noqa: F401

    rec.span("import stalwart (cli, trainer and their imports)", start, time.perf_counter(),
             time.process_time() - cpu)  # fmt: skip
    for label, target in TARGETS:
        rec.wrap(label, target)

    sys.argv = ["stalwart", *rest]
    if not args.profile:
        atexit.register(_dump, rec, args.out, None, None)
        return entry.run()
    import cProfile

    profiler = cProfile.Profile()
    atexit.register(_dump, rec, args.out, profiler, args.profile)
    return profiler.runcall(entry.run)


if __name__ == "__main__":
    raise SystemExit(main())
