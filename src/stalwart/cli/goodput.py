"""``stalwart goodput RUN_DIR [--json]``: where a job's wall-clock time went, bucket by bucket.

Reads ``<run dir>/goodput.jsonl`` (written by the trainer or any loop driving
:class:`stalwart.observability.goodput.GoodputLedger`); a torn or hostile file is read as far as
it is valid, and the notes say what was skipped. Exit codes: 0, 2 (no such directory or ledger).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from stalwart.cli.args import OneLineErrorParser

EXIT_OK = 0
EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(
        prog="stalwart goodput",
        description="Print the goodput ledger of a run directory: seconds per bucket, sessions.",
    )
    p.add_argument("run_dir", help="the run directory (holds goodput.jsonl)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    return p


def main_goodput(argv: list[str]) -> int:
    """Run the subcommand; returns the exit code."""
    from stalwart.observability.goodput.reader import read_ledger
    from stalwart.observability.goodput.records import (
        GOODPUT_FILE,
        format_table,
        summarize,
    )

    try:
        ns = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help (0) or a bad flag (2, one line already printed)
        return int(exc.code) if isinstance(exc.code, int) else EXIT_USAGE
    run_dir = Path(ns.run_dir)
    if not ns.run_dir.strip():  # Path("") is the working directory
        sys.stderr.write("stalwart goodput: error: RUN_DIR is empty (it takes a run directory)\n")
        return EXIT_USAGE
    if not run_dir.is_dir():
        sys.stderr.write(f"stalwart goodput: error: RUN_DIR {run_dir} is not a directory\n")
        return EXIT_USAGE
    ledger = run_dir / GOODPUT_FILE
    if ledger.exists() and not ledger.is_file():  # a FIFO blocked the read forever
        sys.stderr.write(f"stalwart goodput: error: {ledger} is not a regular file\n")
        return EXIT_USAGE
    file = read_ledger(ledger)
    if not file.exists:
        sys.stderr.write(
            f"stalwart goodput: error: no {GOODPUT_FILE} in {run_dir} (the trainer writes it to "
            "--run-dir, else --save)\n"
        )
        return EXIT_USAGE
    summary = summarize(file)
    print(json.dumps(summary.to_json(), indent=2) if ns.json else format_table(summary))
    return EXIT_OK
