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
cache write), i.e. to the start of the first productive iteration (without any ``compile``
span, as with ``TORCH_CACHING_PRECOMPILE=1``, to the end of its first iteration); and the ``compile`` bucket's
seconds by source (cold compile, warm cache load, capture, cache write). Median and spread of
``--repeats``.

``--launch``: two more rows, the same faulted job run under ``stalwart launch --max-restarts 1``,
which relaunches it itself (round 1 resumes with the warm cache), its workers exec'd by torchrun
or forked from the launcher (``--fork-workers``); timed from the fault (the end of the failed
session's last span in the ledger), so the launcher's reaction and the relaunch's whole start
are in the figure.

``--phases``: each relaunch runs under ``bench/startup_phases.py`` (wall-clock timers around
the start-up's parts: the imports, the process group, each builder of the trainer, the compile
cache's open and load, the checkpoint load, the first iteration), and a table of every phase's
median wall and CPU seconds follows, cold against warm.

    PYTHONPATH=src .venv/bin/python bench/warm_restart.py --repeats 3 [--phases] [--json out.json]
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

WARM_ENV = "warm+env"  # the warm relaunch with --warm-env's variables
# --launch: the job under `stalwart launch`, relaunched by it (measured from the fault).
LAUNCH_VARIANTS = {
    "launch: exec, from the fault": False,
    "launch --fork-workers, from the fault": True,
}
CPU_MODEL = ["--preset", "tiny", "--micro-batch-size", "4", "--use-cpu"]
COMMON = ["--compile", "--log-interval", "1", "--no-progress-bar", "--seed", "3",
          "--eval-interval", "0", "--lr", "1e-3", "--lr-warmup-iters", "1"]  # fmt: skip


def _train(
    run_dir: Path,
    args: argparse.Namespace,
    *extra: str,
    phases: Path | None = None,
    profile: Path | None = None,
    env_extra: dict[str, str] | None = None,
) -> int:
    """``stalwart train`` in a fresh process (under the phase timers when ``phases``, and
    cProfile when ``profile``)."""
    model = args.trainer_flags or CPU_MODEL
    entry = ["-m", "stalwart"]
    if phases is not None:
        entry = [str(REPO / "bench" / "startup_phases.py"), "--out", str(phases)]
        entry += ["--profile", str(profile), "--"] if profile is not None else ["--"]
    cmd = [sys.executable, *entry, "train", *model, *COMMON, "--save", str(run_dir),
           "--train-iters", str(args.train_iters), "--save-interval", str(args.save_interval),
           *extra]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "PYTHONUNBUFFERED": "1"}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    env.update(env_extra or {})
    env["STALWART_BENCH_LAUNCH"] = repr(time.time())  # the phase timers' origin
    out = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
    if args.verbose:
        sys.stdout.write(out.stdout[-2000:] + out.stderr[-2000:])
    return out.returncode


def last_session(run_dir: Path, from_fault: bool = False) -> dict[str, Any]:
    """The relaunch's figures from its ledger: launcher start (``from_fault``: the end of the
    previous session's last span, i.e. the fault) -> end of its last compile span."""
    records = read_ledger(run_dir / "goodput.jsonl").records
    sessions = [r for r in records if isinstance(r, Marker) and r.kind is RecordKind.SESSION]
    session = sessions[-1]
    mine = [r for r in records if isinstance(r, Span) and r.session == session.session]
    compiles = [s for s in mine if s.bucket is Bucket.COMPILE]
    start = float(session.get("launcher_start", session.t))
    if from_fault:
        before = sessions[-2].session
        start = max(r.t1 for r in records if isinstance(r, Span) and r.session == before)
    sources: dict[str, float] = {}
    for span in compiles:
        key = span.source.value if span.source is not None else "unattributed"
        sources[key] = sources.get(key, 0.0) + span.seconds
    before_steps = (Bucket.STARTUP, Bucket.RESTART, Bucket.HANG)  # a relaunch's start-up: restart
    steps = sorted((s for s in mine if s.bucket not in before_steps), key=lambda s: s.t0)
    first_step = steps[0].t0 if steps else start
    # Nothing booked as compile (Dynamo loaded precompiled frames: TORCH_CACHING_PRECOMPILE=1):
    # the first iteration is where the compiled code was loaded; its end is the mark.
    work = [s for s in steps if s.bucket is Bucket.PRODUCTIVE]
    first = [s.t1 for s in work if s.iteration == work[0].iteration] if work else []
    ready = max(s.t1 for s in compiles) if compiles else max(first, default=None)
    return {
        "to_first_productive_s": ready - start if ready is not None else None,
        "startup_s": first_step - start,
        "compile_s": sum(sources.values()),
        "compile_sources": sources,
    }


def run_launch(args: argparse.Namespace, fork: bool) -> dict[str, Any]:
    """The faulted job under ``stalwart launch`` (its relaunch forked from the launcher when
    ``fork``): round 0 compiles and dies at ``--fault-iteration``, round 1 resumes with the
    warm cache; its figures from the fault."""
    run_dir = Path(tempfile.mkdtemp(prefix="stalwart-warm-launch-"))
    try:
        model = args.trainer_flags or CPU_MODEL
        entry = ["-m", "stalwart"]
        phases = run_dir / "phases-{rank}-{round}.json"
        if fork and args.profile:  # the forked restart under the phase timers and cProfile
            profile = Path(args.profile) / "fork-{rank}-{round}.prof.txt"
            entry = [str(REPO / "bench" / "startup_phases.py"), "--out", str(phases),
                     "--profile", str(profile), "--"]  # fmt: skip
        cmd = [sys.executable, *entry, "launch", "--nproc-per-node", "1",
               "--max-restarts", "1", *(["--fork-workers"] if fork else []), "--", *model, *COMMON,
               "--save", str(run_dir), "--train-iters", str(args.train_iters),
               "--save-interval", str(args.save_interval), "--inject-fault", "exception",
               "--inject-fault-iteration", str(args.fault_iteration)]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "PYTHONUNBUFFERED": "1"}
        env.pop("TORCHINDUCTOR_CACHE_DIR", None)
        out = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
        if args.verbose or out.returncode != 0:
            sys.stdout.write(out.stdout[-2000:] + out.stderr[-3000:])
        if out.returncode != 0:
            raise RuntimeError(f"stalwart launch (fork={fork}) exited {out.returncode}")
        result = last_session(run_dir, from_fault=True)
        timed = Path(str(phases).format(rank=0, round=1))
        if timed.is_file():
            result["phases"] = json.loads(timed.read_text())["spans"]
        return result
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def run_once(args: argparse.Namespace, order: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    if all(variant in LAUNCH_VARIANTS for variant in order):  # no fresh-process relaunch
        return {variant: run_launch(args, fork=LAUNCH_VARIANTS[variant]) for variant in order}
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
        if args.warm_env:
            copies[WARM_ENV] = shutil.copytree(first, base / "warm-env")
        results = {}
        for variant in order:
            if variant in LAUNCH_VARIANTS:
                results[variant] = run_launch(args, fork=LAUNCH_VARIANTS[variant])
                continue
            phases = base / f"{variant}.phases.json" if args.phases else None
            env = args.warm_env if variant == WARM_ENV else None
            # cProfile slows a cold compile several times over: the warm relaunches only.
            warm = variant != "cold"
            profile = Path(args.profile) / f"{variant}.prof.txt" if args.profile and warm else None
            rc = _train(Path(copies[variant]), args, phases=phases, profile=profile, env_extra=env)
            if rc != 0:
                raise RuntimeError(f"{variant} relaunch exited {rc}")
            results[variant] = last_session(Path(copies[variant]))
            if phases is not None:
                results[variant]["phases"] = json.loads(phases.read_text())["spans"]
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


def phase_table(runs: dict[str, list[dict[str, Any]]]) -> str:
    """Median wall and CPU seconds of every start-up phase, per variant (``--phases``)."""
    order: list[str] = []
    per: dict[tuple[str, str], list[tuple[float, float | None]]] = {}
    for variant, rs in runs.items():
        for r in rs:
            totals: dict[str, list[Any]] = {}
            for span in sorted(r.get("phases", []), key=lambda x: x["start"]):
                label = span["phase"]
                if label not in order:
                    order.append(label)
                t = totals.setdefault(label, [0.0, None])
                t[0] += span["end"] - span["start"]
                if "cpu" in span:  # not for the interpreter's own start
                    t[1] = (t[1] or 0.0) + span["cpu"]
            for label, (wall, cpu) in totals.items():
                per.setdefault((variant, label), []).append((wall, cpu))
    variants = list(runs)
    head = " | ".join(f"{v} wall s | {v} CPU s" for v in variants)
    lines = [f"| phase (median of runs; indented: inside the one above) | {head} |",
             "|---|" + "---|" * (2 * len(variants))]  # fmt: skip
    for label in order:
        cells = []
        for v in variants:
            xs = per.get((v, label), [])
            walls, cpus = [w for w, _ in xs], [c for _, c in xs if c is not None]
            cells += [f"{statistics.median(walls):.2f}" if walls else "-",
                      f"{statistics.median(cpus):.2f}" if cpus else "-"]  # fmt: skip
        lines.append(f"| {label.replace(' ', '&nbsp;', len(label) - len(label.lstrip()))} | "
                     + " | ".join(cells) + " |")  # fmt: skip
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
    p.add_argument("--phases", action="store_true", help="time each start-up phase (a table)")
    p.add_argument("--launch", action="store_true",
                   help="two more: the job relaunched by `stalwart launch`, without and with "
                   "--fork-workers, each timed from the fault")  # fmt: skip
    p.add_argument("--fork-only", action="store_true",
                   help="only the job relaunched by `stalwart launch --fork-workers`")  # fmt: skip
    p.add_argument(
        "--profile", help="a folder: a cProfile of each warm relaunch (implies --phases)"
    )
    p.add_argument(
        "--warm-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a third relaunch, warm, with this environment variable (repeatable)",
    )
    args = p.parse_args(own)
    args.phases = args.phases or bool(args.profile)
    args.trainer_flags = trainer if (trainer or args.gpu) else None
    if args.gpu and not trainer:
        p.error("--gpu takes the trainer's model flags after --")
    if any("=" not in kv for kv in args.warm_env):
        p.error("--warm-env takes NAME=VALUE")
    args.warm_env = dict(kv.split("=", 1) for kv in args.warm_env)
    runs: dict[str, list[dict[str, Any]]] = {"cold": [], "warm": []}
    if args.warm_env:
        runs[WARM_ENV] = []
    if args.launch:
        runs.update({variant: [] for variant in LAUNCH_VARIANTS})
    if args.fork_only:  # only the relaunch forked by `stalwart launch` (a short device call)
        runs = {variant: [] for variant, fork in LAUNCH_VARIANTS.items() if fork}
    started = time.monotonic()
    for i in range(args.repeats):
        order = tuple(runs) if i % 2 == 0 else tuple(reversed(runs))  # load drift hits all
        for variant, result in run_once(args, order).items():
            runs[variant].append(result)
            print(f"run {i + 1} {variant}: to first productive iteration "
                  f"{result['to_first_productive_s']:.2f}s (compile {result['compile_s']:.2f}s: "
                  f"{result['compile_sources']}, startup {result['startup_s']:.2f}s)", flush=True)  # fmt: skip
    print()
    print(summary_table(runs))
    med = {v: statistics.median(r["to_first_productive_s"] for r in rs) for v, rs in runs.items()}
    if "cold" in med:
        print(f"\nwarm / cold = {med['warm'] / med['cold']:.1%}")
    print(f"bench wall {time.monotonic() - started:.0f} s")
    if args.phases:
        print("\nStart-up phases of the relaunch (bench/startup_phases.py; from the launch):\n")
        print(phase_table(runs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs, "median_s": med, "argv": argv}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
