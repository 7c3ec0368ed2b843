"""``stalwart`` console script: ``stalwart train | report | goodput | chaos | checkpoints | export``.

Bad flags or values exit with code 2 and one line naming the flag; never a traceback.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

USAGE = "usage: stalwart {train,report,goodput,chaos,checkpoints,export} [flags]  (stalwart <command> --help)"


def _setup_logging() -> None:
    rank = os.environ.get("RANK", "0")
    level = logging.INFO if rank == "0" else logging.WARNING
    logging.basicConfig(level=level, format=f"[rank{rank}] %(levelname)s %(name)s: %(message)s")


def main_train(argv: list[str]) -> int:
    """``stalwart train``: parse, validate, train; returns the process exit code."""
    from stalwart.cli.args import parse_train_args
    from stalwart.config.run import build_run_config

    ns = parse_train_args(argv)
    try:
        config = build_run_config(ns, argv)
    except ValueError as exc:
        sys.stderr.write(f"stalwart train: error: {exc}\n")
        return 2
    if ns.print_config:
        print(config.to_json())
        return 0
    _setup_logging()
    from stalwart.cli.train import run_from_cli

    return run_from_cli(config, demo=bool(ns.demo))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``stalwart`` console script and ``python -m stalwart``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "train":
        return main_train(rest)
    if command == "report":
        from stalwart.cli.report import main_report

        return main_report(rest)
    if command == "goodput":
        from stalwart.cli.goodput import main_goodput

        return main_goodput(rest)
    if command == "chaos":
        from stalwart.cli.chaos import main_chaos

        return main_chaos(rest)
    if command == "checkpoints":
        from stalwart.cli.checkpoints import main_checkpoints

        return main_checkpoints(rest)
    if command == "export":
        from stalwart.cli.checkpoints import main_export

        return main_export(rest)
    sys.stderr.write(
        f"stalwart: error: unknown command {command!r}; "
        "allowed: train, report, goodput, chaos, checkpoints, export\n"
    )
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
