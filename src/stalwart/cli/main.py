"""``stalwart`` console script: ``stalwart train | report | goodput | chaos | checkpoints | export``.

Bad flags or values exit with code 2 and one line naming the flag; never a traceback.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stalwart.config.run import RunConfig

USAGE = "usage: stalwart {train,report,goodput,chaos,checkpoints,export} [flags]  (stalwart <command> --help)"


def _setup_logging(rank: int) -> None:
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(level=level, format=f"[rank{rank}] %(levelname)s %(name)s: %(message)s")


def _check_before_start(config: RunConfig) -> None:
    """What must hold before anything is allocated or written (``ValueError`` otherwise)."""
    from stalwart.config.memory_check import check_run_fits
    from stalwart.distributed.launch_env import env_int
    from stalwart.distributed.process_group import choose_device

    world = env_int("WORLD_SIZE", 1, minimum=1)
    device = choose_device(env_int("LOCAL_RANK", 0), config.training.use_cpu)
    local_world = env_int("LOCAL_WORLD_SIZE", world, minimum=1)
    check_run_fits(config, device, world_size=world, local_world_size=local_world)


def main_train(argv: list[str]) -> int:
    """``stalwart train``: parse, validate, train; returns the process exit code.

    Every check of user input (flags, ``--config``, environment, will-it-fit) runs here, before
    anything is allocated or written; a failure is one line on stderr and exit code 2.
    """
    from stalwart.cli.args import parse_train_args
    from stalwart.config.run import build_run_config
    from stalwart.distributed.launch_env import check_launch_env, env_int

    try:
        ns = parse_train_args(argv)
    except SystemExit as exc:  # argparse already printed its one line (or --help)
        return exc.code if isinstance(exc.code, int) else 2
    try:
        check_launch_env()
        config = build_run_config(ns, argv)
        if not ns.print_config:
            _check_before_start(config)
    except ValueError as exc:
        sys.stderr.write(f"stalwart train: error: {exc}\n")
        return 2
    if ns.print_config:
        print(config.to_json())
        return 0
    _setup_logging(env_int("RANK", 0))
    from stalwart.cli.train import run_from_cli

    return run_from_cli(config, demo=bool(ns.demo))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``stalwart`` console script and ``python -m stalwart``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    try:
        return _dispatch(args[0], args[1:])
    except KeyboardInterrupt:  # Ctrl-C outside the trainer's handler: one line, the shell's 130
        sys.stderr.write("stalwart: interrupted\n")
        return 130


def _dispatch(command: str, rest: list[str]) -> int:
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
