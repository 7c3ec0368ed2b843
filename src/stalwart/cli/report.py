"""``stalwart report <run-dir>``: write a self-contained HTML report of a run directory."""

from __future__ import annotations

import argparse
import os
import sys

from stalwart.cli.args import OneLineErrorParser
from stalwart.observability.report import write_report

EXIT_OK = 0
EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(
        prog="stalwart report",
        description="Render <run-dir>/report.html (interactive plotly charts when plotly is "
        "installed, else inline SVG; one file that opens offline) and PNGs from a run's artefacts.",
    )
    p.add_argument("run_dir", help="the run directory (metrics.jsonl, straggler.jsonl, ...)")
    p.add_argument(
        "--output", "-o", metavar="FILE", help="HTML path (default: <run-dir>/report.html)"
    )
    p.add_argument("--no-png", action="store_true", help="skip the matplotlib PNGs")
    p.add_argument(
        "--static",
        action="store_true",
        help="inline-SVG charts even when plotly is installed (smaller file, no JavaScript)",
    )
    p.add_argument(
        "--metrics-file", metavar="FILE", help="metrics JSONL (default: <run-dir>/metrics.jsonl)"
    )
    return p


def main_report(argv: list[str] | None = None) -> int:
    """Run the subcommand; returns 0 on success, 2 for a missing run directory or bad usage."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on bad usage; keep it a return code
        return int(exc.code) if isinstance(exc.code, int) else EXIT_USAGE
    from stalwart.config.paths import check_output_file

    try:  # before any work: a directory as --output left a 5 MB <output>.tmp behind
        if not args.run_dir.strip():  # Path("") is the working directory: a report of it
            raise ValueError("RUN_DIR is empty (it takes a run directory)")
        check_output_file("--output", args.output)
        if args.metrics_file is not None and not os.path.isfile(args.metrics_file):
            # Named explicitly: a report without its metrics is not the report asked for.
            raise ValueError(f"--metrics-file {args.metrics_file!r} is not a readable file")
    except ValueError as exc:
        print(f"stalwart report: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        path = write_report(
            args.run_dir,
            args.output,
            not args.no_png,
            args.metrics_file,
            interactive=False if args.static else None,
        )
    except OSError as exc:  # no such run directory, or the report cannot be written
        print(f"stalwart report: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(f"report written to {path}")
    return EXIT_OK
