"""Benchmark: a relaunch after a fault with ``--compile``, cold cache against warm cache.

Each repeat runs one job that compiles, saves at ``--save-interval`` and dies of an injected
exception at ``--fault-iteration`` (the cache is written after its first iteration). Its run
directory is then copied twice, and the same relaunch runs from each copy, in alternating
order:

* ``cold``: the copy without ``compile_cache/`` (a relaunch on a node that never compiled this
  model, or before warm restarts existed): Inductor compiles everything again;
* ``warm``: the copy with it: Dynamo traces, AOTAutograd and Inductor load from the cache.

Measured from the relaunch's goodput ledger (``goodput.jsonl``, its last session): the
launcher start to the end of its last ``compile`` span (compile, CUDA graph capture and the
cache write), i.e. to the start of the first productive iteration; and the ``compile`` bucket's
seconds by source (cold compile, warm cache load, capture, cache write). Median and spread of
``--repeats``.

    PYTHONPATH=src .venv/bin/python bench/warm_restart.py --repeats 3 [--json out.json]
    # on a GPU: --gpu, and the trainer's flags after --, e.g.
    # -- --preset gpt2-124m --bf16 --cuda-graph-impl full_iteration --optimizer-cuda-graph
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from stalwart.observability.goodput.reader import read_ledger  # noqa: E402
from stalwart.observability.goodput.records import (  # noqa: E402
    Bucket,
    Marker,
    RecordKind,
    Span,
)

CPU_MODEL = ["--preset", "tiny", "--micro-batch-size", "4", "--use-cpu"]
COMMON = ["--compile", "--log-interval", "1", "--no-progress-bar", "--seed", "3",
          "--eval-interval", "0", "--lr", "1e-3", "--lr-warmup-iters", "1"]  # fmt: skip


def _train(run_dir: Path, args: argparse.Namespace, *extra: str) -> int:
    model = args.trainer_flags or CPU_MODEL
    cmd = [sys.executable, "-m", "stalwart", "train", *model, *COMMON, "--save", str(run_dir),
           "--train-iters", str(args.train_iters), "--save-interval", str(args.save_interval),
           *extra]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "PYTHONUNBUFFERED": "1"}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    out = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
    if args.verbose:
        sys.stdout.write(out.stdout[-2000:] + out.stderr[-2000:])
    return out.returncode


def last_session(run_dir: Path) -> dict[str, Any]:
    """The relaunch's figures from its ledger: launcher start -> end of its last compile span."""
    records = read_ledger(run_dir / "goodput.jsonl").records
    sessions = [r for r in records if isinstance(r, Marker) and r.kind is RecordKind.SESSION]
    session = sessions[-1]
    mine = [r for r in records if isinstance(r, Span) and r.session == session.session]
    compiles = [s for s in mine if s.bucket is Bucket.COMPILE]
    start = float(session.get("launcher_start", session.t))
    sources: dict[str, float] = {}
    for span in compiles:
        key = span.source.value if span.source is not None else "unattributed"
        sources[key] = sources.get(key, 0.0) + span.seconds
    before_steps = (Bucket.STARTUP, Bucket.RESTART, Bucket.HANG)  # a relaunch's start-up: restart
    first_step = min((s.t0 for s in mine if s.bucket not in before_steps), default=start)
    return {
        "to_first_productive_s": max(s.t1 for s in compiles) - start if compiles else None,
        "startup_s": first_step - start,
        "compile_s": sum(sources.values()),
        "compile_sources": sources,
    }


def run_once(args: argparse.Namespace, order: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    base = Path(tempfile.mkdtemp(prefix="stalwart-warm-"))
    try:
        first = base / "first"
        rc = _train(first, args, "--inject-fault", "exception",
                    "--inject-fault-iteration", str(args.fault_iteration))  # fmt: skip
        if not (first / "compile_cache").is_dir():
            raise RuntimeError(f"the faulted job (rc={rc}) left no compile cache")
        no_cache = shutil.ignore_patterns("compile_cache")
        copies = {
            "cold": shutil.copytree(first, base / "cold", ignore=no_cache),
            "warm": shutil.copytree(first, base / "warm"),
        }
        results = {}
        for variant in order:
            rc = _train(Path(copies[variant]), args)
            if rc != 0:
                raise RuntimeError(f"{variant} relaunch exited {rc}")
            results[variant] = last_session(Path(copies[variant]))
        return results
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _spread(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}"


def summary_table(runs: dict[str, list[dict[str, Any]]]) -> str:
    lines = ["| relaunch | to first productive iteration (median s) | spread | runs (s) | "
             "compile bucket (median s) | where the compile time went (last run) |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for variant, rs in runs.items():
        ready = [r["to_first_productive_s"] for r in rs]
        comp = [r["compile_s"] for r in rs]
        where = ", ".join(f"{k} {v:.2f}" for k, v in rs[-1]["compile_sources"].items())
        lines.append(f"| {variant} | {statistics.median(ready):.2f} | {_spread(ready)} | "
                     f"{', '.join(f'{x:.2f}' for x in ready)} | {statistics.median(comp):.2f} | "
                     f"{where} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, trainer = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])  # fmt: skip
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--train-iters", type=int, default=6)
    p.add_argument("--save-interval", type=int, default=2)
    p.add_argument("--fault-iteration", type=int, default=3)
    p.add_argument("--gpu", action="store_true", help="the trainer's flags after -- (no --use-cpu)")
    p.add_argument("--json", help="write all runs and the summary here")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(own)
    args.trainer_flags = trainer if (trainer or args.gpu) else None
    if args.gpu and not trainer:
        p.error("--gpu takes the trainer's model flags after --")
    runs: dict[str, list[dict[str, Any]]] = {"cold": [], "warm": []}
    started = time.monotonic()
    for i in range(args.repeats):
        order = ("cold", "warm") if i % 2 == 0 else ("warm", "cold")  # load drift hits both
        for variant, result in run_once(args, order).items():
            runs[variant].append(result)
            print(f"run {i + 1} {variant}: to first productive iteration "
                  f"{result['to_first_productive_s']:.2f}s (compile {result['compile_s']:.2f}s: "
                  f"{result['compile_sources']}, startup {result['startup_s']:.2f}s)", flush=True)  # fmt: skip
    print()
    print(summary_table(runs))
    med = {v: statistics.median(r["to_first_productive_s"] for r in rs) for v, rs in runs.items()}
    print(f"\nwarm / cold = {med['warm'] / med['cold']:.1%}; bench wall {time.monotonic() - started:.0f} s")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs, "median_s": med, "argv": argv}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
