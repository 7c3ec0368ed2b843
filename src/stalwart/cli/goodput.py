"""``stalwart goodput RUN_DIR [--json] [--project N,...]``: where a job's wall-clock time went,
bucket by bucket; with ``--project``, the effective training time ratio its measured recovery
gives at N GPUs (`stalwart.observability.goodput.ettr_report`).

Reads ``<run dir>/goodput.jsonl`` (written by the trainer or any loop driving
:class:`stalwart.observability.goodput.GoodputLedger`); a torn or hostile file is read as far as
it is valid, and the notes say what was skipped. Exit codes: 0, 2 (no such directory or ledger,
a bad flag value, or ``--project`` on a ledger with no recovery to measure).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from stalwart.cli.arg_types import Float
from stalwart.cli.args import OneLineErrorParser

if TYPE_CHECKING:
    from stalwart.observability.goodput.records import LedgerFile

EXIT_OK = 0
EXIT_USAGE = 2
MAX_GPUS = 10_000_000
MAX_SCALES = 16


def gpu_counts(text: str) -> list[int]:
    """``--project``: comma-separated GPU counts, each an integer in [1, 10,000,000]."""
    items = text.split(",")
    if len(items) > MAX_SCALES:
        raise argparse.ArgumentTypeError(f"at most {MAX_SCALES} GPU counts, got {len(items)}")
    counts = []
    for item in items:
        digits = item.strip().replace("_", "")
        if not digits.isdigit() or not 1 <= int(digits) <= MAX_GPUS:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated GPU counts, each an integer in [1, {MAX_GPUS:,}] "
                f"(e.g. 1024,16384,131072), got {text!r}"
            )
        counts.append(int(digits))
    return list(dict.fromkeys(counts))


def mttf_anchor(text: str) -> tuple[float, int]:
    """``--mttf HOURS@GPUS``: a measured mean time to failure and the GPU count it was measured
    at."""
    import math

    hours, _, gpus = text.partition("@")
    try:
        h, n = float(hours), int(gpus.strip(), 10)
    except ValueError:
        h, n = math.nan, 0
    if not (math.isfinite(h) and 0 < h <= 1e6 and 1 <= n <= MAX_GPUS):
        raise argparse.ArgumentTypeError(
            f"expected HOURS@GPUS, hours a number in (0, 1e6] and GPUs an integer in "
            f"[1, {MAX_GPUS:,}] (e.g. 7.9@1024), got {text!r}"
        )
    return h, n


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(
        prog="stalwart goodput",
        description="Print the goodput ledger of a run directory: seconds per bucket, sessions. "
        "With --project: the ETTR its measured recovery gives at N GPUs.",
    )
    p.add_argument("run_dir", help="the run directory (holds goodput.jsonl)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument(
        "--project",
        type=gpu_counts,
        metavar="N[,N...]",
        help="project the effective training time ratio to these GPU counts from the run's "
        "measured recovery per fault and its checkpoint interval (docs/goodput.md)",
    )
    p.add_argument(
        "--mttf",
        type=mttf_anchor,
        metavar="HOURS@GPUS",
        help="with --project: the failure model's anchor, MTTF inverse in the GPU count "
        "(default 0.23@131072, Meta's research clusters; their measured 1,024-GPU figure is "
        "7.9@1024)",
    )
    p.add_argument(
        "--checkpoint-interval",
        type=Float(gt=0, le=1e9),
        metavar="SECONDS",
        help="with --project: the checkpoint interval in seconds of training (default: measured "
        "from the ledger's saves)",
    )
    return p


def _ledger_file(run_dir_text: str) -> tuple[LedgerFile, str | None]:
    """The read ledger and None, or what was read and the one-line error."""
    from stalwart.observability.goodput.reader import read_ledger
    from stalwart.observability.goodput.records import GOODPUT_FILE, LedgerFile

    run_dir = Path(run_dir_text)
    if not run_dir_text.strip():  # Path("") is the working directory
        return LedgerFile(), "RUN_DIR is empty (it takes a run directory)"
    if not run_dir.is_dir():
        return LedgerFile(), f"RUN_DIR {run_dir} is not a directory"
    ledger = run_dir / GOODPUT_FILE
    if ledger.exists() and not ledger.is_file():  # a FIFO blocked the read forever
        return LedgerFile(), f"{ledger} is not a regular file"
    file = read_ledger(ledger)
    if not file.exists:
        return file, (
            f"no {GOODPUT_FILE} in {run_dir} (the trainer writes it to --run-dir, else --save)"
        )
    return file, None


def _projection(ns: argparse.Namespace, file: LedgerFile) -> str:
    """The ``--project`` output (``NothingToProject`` when there is nothing measured)."""
    from stalwart.observability.goodput.ettr import META_RESEARCH_CLUSTERS, FailureModel
    from stalwart.observability.goodput.ettr_report import format_projection, project_ledger

    model = META_RESEARCH_CLUSTERS
    if ns.mttf is not None:
        hours, gpus = ns.mttf
        model = FailureModel.anchored(hours, gpus, f"--mttf {hours:g}@{gpus}")
    projection = project_ledger(file, ns.project, model, ns.checkpoint_interval)
    if ns.json:
        return json.dumps(projection.to_json(), indent=2)
    return format_projection(projection)


def main_goodput(argv: list[str]) -> int:
    """Run the subcommand; returns the exit code."""
    from stalwart.observability.goodput.ettr_report import NothingToProject
    from stalwart.observability.goodput.records import format_table, summarize

    try:
        ns = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help (0) or a bad flag (2, one line already printed)
        return int(exc.code) if isinstance(exc.code, int) else EXIT_USAGE
    if ns.project is None and (ns.mttf is not None or ns.checkpoint_interval is not None):
        flag = "--mttf" if ns.mttf is not None else "--checkpoint-interval"
        sys.stderr.write(f"stalwart goodput: error: {flag} is a setting of --project N,...\n")
        return EXIT_USAGE
    file, problem = _ledger_file(ns.run_dir)
    if problem is not None:
        sys.stderr.write(f"stalwart goodput: error: {problem}\n")
        return EXIT_USAGE
    if ns.project is not None:
        try:
            print(_projection(ns, file))
        except NothingToProject as exc:
            sys.stderr.write(f"stalwart goodput: error: --project: {ns.run_dir}: ledger {exc}\n")
            return EXIT_USAGE
        return EXIT_OK
    summary = summarize(file)
    print(json.dumps(summary.to_json(), indent=2) if ns.json else format_table(summary))
    return EXIT_OK
