"""``stalwart report <run-dir>``: write a self-contained HTML report of a run directory;
``stalwart report <run-a> <run-b> ...``: one page comparing the runs (overlaid curves)."""

from __future__ import annotations

import argparse
import os
import sys

from stalwart.cli.arg_types import switch
from stalwart.cli.args import OneLineErrorParser
from stalwart.report import write_comparison, write_report

EXIT_OK = 0
EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(
        prog="stalwart report",
        description="Render <run-dir>/report.html (interactive plotly charts when plotly is "
        "installed, else inline SVG; one file that opens offline) and PNGs from a run's artefacts.",
    )
    p.add_argument(
        "run_dirs",
        nargs="+",
        metavar="RUN_DIR",
        help="the run directory (metrics.jsonl, straggler.jsonl, ...); two or more: a "
        "comparison of the runs",
    )
    p.add_argument(
        "--output",
        "-o",
        metavar="FILE",
        help="HTML path (default: <run-dir>/report.html; for a comparison ./compare.html)",
    )
    switch(p, "--no-png", "skip the matplotlib PNGs")
    switch(
        p,
        "--static",
        "inline-SVG charts even when plotly is installed (smaller file, no JavaScript)",
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

    compare = len(args.run_dirs) > 1
    try:  # before any work: a directory as --output left a 5 MB <output>.tmp behind
        if any(not d.strip() for d in args.run_dirs):  # Path("") is the working directory
            raise ValueError("RUN_DIR is empty (it takes a run directory)")
        if compare and (args.metrics_file is not None or args.no_png):
            flag = "--metrics-file" if args.metrics_file is not None else "--no-png"
            raise ValueError(f"{flag} applies to one run's report, not to a comparison of runs")
        check_output_file("--output", args.output)
        if args.metrics_file is not None and not os.path.isfile(args.metrics_file):
            # Named explicitly: a report without its metrics is not the report asked for.
            raise ValueError(f"--metrics-file {args.metrics_file!r} is not a readable file")
    except ValueError as exc:
        print(f"stalwart report: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        if compare:
            out = args.output or "compare.html"
            path = write_comparison(args.run_dirs, out, interactive=False if args.static else None)
            print(f"comparison of {len(args.run_dirs)} runs written to {path}")
            return EXIT_OK
        path = write_report(
            args.run_dirs[0],
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
