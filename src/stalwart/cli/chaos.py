"""``stalwart chaos``: train a small job under a seeded schedule of faults, compare with the
fault-free run, print the table, write ``--json`` and the chaos section of the run report.

Exit codes: 0 every fault behaved as documented, 1 at least one did not, 2 bad flags.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

from stalwart.cli.arg_types import OneOf, switch, values
from stalwart.cli.args import OneLineErrorParser

EXIT_PASSED = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
SCHEDULE_ITERATIONS = 72000  # 9-40 ms an iteration on 2 shared cores: 11+ min, a fault every 2+ min
SCHEDULE_SAVE_INTERVAL = 300


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(
        prog="stalwart chaos",
        description="Run the reference trainer under injected faults and check every recovery.",
    )
    _add_job_flags(p)
    _add_schedule_flags(p)
    _add_run_flags(p)
    return p


def _add_job_flags(p: argparse.ArgumentParser) -> None:
    """Which faults, and the job they hit."""
    from stalwart.chaos.schedule import ChaosFault

    kinds = ", ".join(k.value for k in ChaosFault)
    p.add_argument(
        "--faults", default="all", metavar="LIST", help=f"comma-separated: all | {kinds}"
    )
    p.add_argument("--seed", type=int, default=0, help="seeds the fault schedule and the job")
    p.add_argument(
        "--iterations",
        type=int,
        help="training iterations of the job (default: 12; "
        f"--fault-schedule: {SCHEDULE_ITERATIONS})",
    )
    p.add_argument(
        "--save-interval",
        type=int,
        help="checkpoint every N iterations (default: 3; "
        f"--fault-schedule: {SCHEDULE_SAVE_INTERVAL})",
    )


def _add_schedule_flags(p: argparse.ArgumentParser) -> None:
    """``--fault-schedule``: one long job under ``stalwart launch``, and its options."""
    switch(
        p,
        "--fault-schedule",
        "instead of one job per fault: one long job under stalwart launch on 2 ranks, a "
        "fault every iterations/6 (hang, SIGKILL, transient NaN, SIGTERM, a persistent device "
        "fault excluded), its goodput and final weights against the fault-free job",
    )
    _schedule_options(p)


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    """Where and how the jobs run, and where their results go."""
    values(
        p,
        ("--nproc-per-node", int, 2, "ranks (torchrun workers)"),
        (
            "--device",
            OneOf(("cpu", "auto"), "WHERE"),
            "cpu",
            "cpu: gloo, bitwise checks hold; auto: NCCL on GPUs",
        ),
    )
    p.add_argument(
        "--json", metavar="FILE", help="write the result {passed, faults} here (default: none)"
    )
    p.add_argument(
        "--work-dir", metavar="DIR", help="where the runs go (default: a new temporary directory)"
    )
    p.add_argument(
        "--timeout", type=float, help="seconds per launch (default: 300; --fault-schedule: 3600)"
    )
    p.add_argument(
        "--jobs", type=int, default=1, help="scenarios run at once (they are independent jobs)"
    )
    switch(p, "--no-report", "skip the HTML run report")


def _schedule_options(p: argparse.ArgumentParser) -> None:
    """The options only ``--fault-schedule`` takes (`_schedule_only` refuses them elsewhere)."""
    switch(
        p,
        "--fork-workers",
        "--fault-schedule: its stalwart launch forks the workers "
        "(a relaunch skips the interpreter start and imports)",
    )
    values(
        p,
        (
            "--non-persistent-save-interval",
            int,
            0,
            "--fault-schedule: the job also saves a "
            "non-persistent checkpoint every N iterations (default: 0 = none)",
        ),
        (
            "--non-persistent-ckpt-type",
            OneOf(("global", "local"), "TYPE"),
            "global",
            "--fault-schedule: where those go: global (<save>/non_persistent) or local (a "
            "directory per fake node, replicated to the other)",
        ),
        (
            "--rerun-transient-policy",
            OneOf(("exit", "continue"), "POLICY"),
            "exit",
            "--fault-schedule: the job's policy for a transient verdict: exit (17, restart: "
            "Megatron's) or continue (the rerun's result applied: one replay, no restart)",
        ),
    )


def _use_cpu(device: str) -> bool:
    """``--device`` (argparse allows only cpu and auto): auto is the GPUs when there are any."""
    if device == "cpu":
        return True
    import torch

    return not torch.cuda.is_available()


def _work_dir(value: str | None) -> Path:
    if value is None:
        return Path(tempfile.mkdtemp(prefix="stalwart-chaos-"))
    from stalwart.config.paths import check_output_dir

    check_output_dir("--work-dir", value)  # a file there was a traceback
    path = Path(value)
    if path.exists() and any(path.iterdir()):
        raise ValueError(f"--work-dir: {value} exists and is not empty")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _check_run(timeout: float, ns: argparse.Namespace) -> Path:
    """The checks both modes share: ``timeout`` (the mode's default when unset), ``--json``
    and ``--work-dir``; returns the work directory (created)."""
    from stalwart.config.paths import check_output_file

    if not 0 < timeout < math.inf:  # NaN too
        raise ValueError(f"--timeout: must be > 0, got {timeout}")
    # --json is written after the whole run: a directory there was a traceback then.
    check_output_file("--json", ns.json)
    return _work_dir(ns.work_dir)


def _schedule_only(ns: argparse.Namespace) -> str | None:
    """The first flag given that only the fault schedule takes, or None."""
    for flag, given in (
        ("--fork-workers", ns.fork_workers),
        ("--non-persistent-save-interval", ns.non_persistent_save_interval),
        ("--non-persistent-ckpt-type", ns.non_persistent_ckpt_type != "global"),
        ("--rerun-transient-policy", ns.rerun_transient_policy != "exit"),
    ):
        if given:
            return flag
    return None


def main_chaos(argv: list[str]) -> int:
    """Parse, run the campaign, report; returns the exit code."""
    from stalwart.chaos.campaign import CampaignConfig, format_table, run_campaign
    from stalwart.chaos.schedule import parse_faults, validate_shape

    try:
        ns = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help (0) or a bad flag (2, one line already printed)
        return int(exc.code) if isinstance(exc.code, int) else EXIT_USAGE
    if ns.fault_schedule:
        return _main_schedule(ns)
    misplaced = _schedule_only(ns)
    if misplaced is not None:
        sys.stderr.write(f"stalwart chaos: error: {misplaced} goes with --fault-schedule\n")
        return EXIT_USAGE
    ns.iterations = 12 if ns.iterations is None else ns.iterations
    ns.save_interval = 3 if ns.save_interval is None else ns.save_interval
    ns.timeout = 300.0 if ns.timeout is None else ns.timeout
    try:
        if not ns.faults.strip():  # an unset shell variable: not a request for every fault
            raise ValueError("--faults is empty; allowed: all or a comma-separated list")
        faults = parse_faults(ns.faults)
        validate_shape(ns.iterations, ns.save_interval, ns.nproc_per_node)
        use_cpu = _use_cpu(ns.device)
        if not 1 <= ns.jobs <= 64:
            raise ValueError(f"--jobs: must be between 1 and 64, got {ns.jobs}")
        work = _check_run(ns.timeout, ns)
    except ValueError as exc:
        sys.stderr.write(f"stalwart chaos: error: {exc}\n")
        return EXIT_USAGE
    config = CampaignConfig(
        work_dir=work,
        faults=faults,
        seed=ns.seed,
        iterations=ns.iterations,
        save_interval=ns.save_interval,
        nproc=ns.nproc_per_node,
        use_cpu=use_cpu,
        timeout=ns.timeout,
        jobs=ns.jobs,
    )
    print(f"chaos: work directory {work}", flush=True)
    outcome = run_campaign(config, lambda line: print(line, flush=True))
    print(format_table(outcome))
    data = outcome.to_json()
    if ns.json:
        Path(ns.json).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.json).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        print(f"chaos: results written to {ns.json}")
    if outcome.reference_dir.is_dir():
        (outcome.reference_dir / "chaos.json").write_text(json.dumps(data, indent=2) + "\n")
        if not ns.no_report:
            from stalwart.report import write_report

            path = write_report(str(outcome.reference_dir), None, False, None)
            print(f"chaos: report written to {path}")
    return EXIT_PASSED if outcome.passed else EXIT_FAILED


def _main_schedule(ns: argparse.Namespace) -> int:
    """``--fault-schedule``: the long job under ``stalwart launch``
    (stalwart.chaos.fault_schedule)."""
    from stalwart.chaos.fault_schedule import (
        ScheduleConfig,
        check_shape,
        format_result,
        run_schedule,
        write_json,
    )

    iterations = SCHEDULE_ITERATIONS if ns.iterations is None else ns.iterations
    save_interval = SCHEDULE_SAVE_INTERVAL if ns.save_interval is None else ns.save_interval
    timeout = 3600.0 if ns.timeout is None else ns.timeout
    try:
        check_shape(iterations, save_interval)
        if ns.faults != "all" or ns.nproc_per_node != 2 or ns.device != "cpu":
            raise ValueError(
                "--fault-schedule runs its own faults on 2 CPU ranks: leave --faults, "
                "--nproc-per-node and --device unset"
            )
        if ns.non_persistent_ckpt_type != "global" and not ns.non_persistent_save_interval:
            raise ValueError(
                f"--non-persistent-ckpt-type {ns.non_persistent_ckpt_type} needs "
                "--non-persistent-save-interval"
            )
        work = _check_run(timeout, ns)
    except ValueError as exc:
        sys.stderr.write(f"stalwart chaos: error: {exc}\n")
        return EXIT_USAGE
    config = ScheduleConfig(
        work,
        iterations,
        save_interval,
        seed=ns.seed,
        timeout=timeout,
        fork_workers=ns.fork_workers,
        non_persistent_interval=ns.non_persistent_save_interval,
        non_persistent_type=ns.non_persistent_ckpt_type,
        transient_policy=ns.rerun_transient_policy,
    )
    print(f"chaos: work directory {work}", flush=True)
    result = run_schedule(config, lambda line: print(line, flush=True))
    print(format_result(result))
    if ns.json:
        write_json(result, ns.json)
        print(f"chaos: results written to {ns.json}")
    return EXIT_PASSED if result.passed else EXIT_FAILED
