"""``stalwart`` console script: ``stalwart train | launch | report | goodput | chaos | checkpoints |
export``.

Bad flags or values exit with code 2 and one line naming the flag; never a traceback.
``stalwart --help`` lists the commands, ``stalwart --version`` prints the installed version.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stalwart.config.run import RunConfig

# command -> one line (the order of `stalwart --help`)
COMMANDS = {
    "train": "train the reference GPT inside the reliability shell (--help lists every flag)",
    "launch": "torchrun that acts on the job's verdicts: relaunch, exclude a device, stop",
    "report": "write a run directory's self-contained HTML report (report.html)",
    "goodput": "print where a run's wall-clock time went, bucket by bucket (goodput.jsonl)",
    "chaos": "run the trainer under injected faults and check every recovery",
    "checkpoints": "list and verify the checkpoints of a --save directory (convert: old pickles)",
    "export": "write one checkpoint's model weights as a single file",
}


def version() -> str:
    """The installed package's version (package metadata), else ``stalwart.__version__``."""
    from importlib import metadata

    try:
        return metadata.version("stalwart")
    except metadata.PackageNotFoundError:  # running from a source tree that is not installed
        import stalwart

        return stalwart.__version__


def build_main_parser() -> argparse.ArgumentParser:
    """``stalwart --help`` / ``--version`` (commands are dispatched by name, each with its own
    parser: ``stalwart <command> --help``)."""
    from stalwart.cli.help_format import FlagHelpFormatter

    width = max(len(name) for name in COMMANDS) + 2
    commands = "\n".join(f"  {name:<{width}}{text}" for name, text in COMMANDS.items())
    p = argparse.ArgumentParser(
        prog="stalwart",
        usage="stalwart <command> [flags]     (stalwart <command> --help: its flags)",
        description="Reliability, observability and full-iteration CUDA graphs for PyTorch "
        f"training.\n\ncommands:\n{commands}",
        epilog="Exit codes: 0 done or a graceful exit, 2 bad input, 16 resume on other "
        "hardware,\n17 failed result validation, 130 interrupted (Ctrl-C).",
        formatter_class=FlagHelpFormatter,
        allow_abbrev=False,
        add_help=False,
    )
    p.add_argument("-h", "--help", action="help", help="show this help and exit")
    p.add_argument(
        "--version",
        action="version",
        version=f"stalwart {version()}",
        help="print the version and exit",
    )
    return p


def _setup_logging(rank: int, ns: argparse.Namespace) -> None:
    """The terminal's log records: ``--logging-level`` exactly (every rank, as Megatron);
    ``--verbose``: INFO on rank 0; by default warnings and, on rank 0, the notices
    (`stalwart.log_notice`: checkpoints saved and loaded), not the start-up's INFO lines."""
    from stalwart.log_notice import NoticeFormatter, WarningsAndNotices

    handler = logging.StreamHandler()
    form = f"[rank{rank}] %(levelname)s %(name)s: %(message)s"
    handler.setFormatter(logging.Formatter(form))
    if ns.logging_level is not None:
        level = ns.logging_level
    elif rank != 0:
        level = logging.WARNING
    else:
        level = logging.INFO
        if not ns.verbose:
            handler.addFilter(WarningsAndNotices())
            handler.setFormatter(NoticeFormatter(form))
    logging.basicConfig(level=level, handlers=[handler])


def _check_before_start(config: RunConfig) -> None:
    """What must hold before anything is allocated or written (``ValueError`` otherwise)."""
    from stalwart.config.memory_check import check_run_fits
    from stalwart.distributed.launch_env import env_int
    from stalwart.distributed.process_group import choose_device
    from stalwart.loop.naming import Names

    world = env_int("WORLD_SIZE", 1, minimum=1)
    device = choose_device(env_int("LOCAL_RANK", 0), config.training.use_cpu)
    local_world = env_int("LOCAL_WORLD_SIZE", world, minimum=1)
    check_run_fits(config, device, world_size=world, local_world_size=local_world)
    _check_output_paths(config)
    # The shell's rules (a missing tensorboard/wandb/pynvml, --profile on this device, ...): one
    # line before the first, so a refused start announces no run directory it never creates.
    config.shell.check(Names.CLI, device=device, world_size=world)


def _check_output_paths(config: RunConfig) -> None:
    """Directories and files the run will write: a file where a directory belongs (or the
    reverse) is one line now, not a traceback from the sink that opens it mid-run."""
    from stalwart.config.paths import check_files_in, check_output_dir, check_output_file
    from stalwart.observability.goodput.records import GOODPUT_FILE
    from stalwart.observability.progress_log import PROGRESS_FILE
    from stalwart.observability.run_dir import EVENTS_FILE, METRICS_FILE

    if config.checkpoint.save is not None and not config.checkpoint.save.strip():
        raise ValueError("--save is empty (it takes a directory)")
    for flag, value in (
        ("--run-dir", config.shell.run_dir),
        ("--tensorboard-dir", config.shell.sinks.tensorboard_dir),
        ("--wandb-save-dir", config.shell.sinks.wandb_save_dir),
        ("--dump-dir", config.shell.dumps.dump_dir),
        ("--profile-dir", config.shell.profiler.profile_dir),
    ):
        check_output_dir(flag, value)
    check_output_file("--metrics-file", config.shell.sinks.metrics_file)
    for flag, directory in (
        ("--run-dir", config.shell.run_dir),
        ("--save", config.checkpoint.save),
    ):
        # The files the run appends to there (a planted FIFO would block the first append).
        check_files_in(flag, directory, (PROGRESS_FILE, GOODPUT_FILE, METRICS_FILE, EVENTS_FILE))
    _check_cache_env(config)
    _check_compile_cache(config)


def _check_compile_cache(config: RunConfig) -> None:
    """``--compile``'s cache holds code the run executes: it must be the user's own directory
    and not writable by its group or others (`stalwart.compile.check_cache_dir`)."""
    location = config.compile_cache_location()
    if location is not None:
        from stalwart.compile import check_cache_dir

        check_cache_dir(*location)


def _check_cache_env(config: RunConfig) -> None:
    """``$STALWART_CACHE`` (the embedded corpus's cache) must name a usable directory when the
    run reads the corpus: a file there made every start rebuild the corpus without a word. The
    cache's own rule (an unwritable cache is skipped) stays for failures at run time."""
    import os

    from stalwart.config.paths import check_output_dir

    value = os.environ.get("STALWART_CACHE")
    if config.data.data_path is None and value:
        check_output_dir("environment variable STALWART_CACHE", value)


def _check_runs_dir_env() -> None:
    """``$STALWART_RUNS_DIR`` (where default run directories go) must be a usable directory."""
    import os

    from stalwart.cli.run_start import RUNS_DIR_ENV
    from stalwart.config.paths import check_output_dir

    if os.environ.get(RUNS_DIR_ENV):
        check_output_dir(f"environment variable {RUNS_DIR_ENV}", os.environ[RUNS_DIR_ENV])


def main_train(argv: list[str]) -> int:
    """``stalwart train``: parse, validate, train; returns the process exit code.

    Every check of user input (flags, ``--config``, environment, will-it-fit) runs here, before
    anything is allocated or written; a failure is one line on stderr and exit code 2.
    """
    import os

    from stalwart.cli.args import parse_train_args
    from stalwart.cli.run_start import start_lines, with_default_run_dir
    from stalwart.config.run import build_run_config
    from stalwart.distributed.launch_env import check_launch_env, env_int

    try:
        ns = parse_train_args(argv)
    except SystemExit as exc:  # argparse already printed its one line (or --help)
        return exc.code if isinstance(exc.code, int) else 2
    try:
        check_launch_env()
        if ns.verbose and ns.logging_level is not None:
            raise ValueError("--verbose and --logging-level set the same thing: give one")
        config = build_run_config(ns, argv)
        if not ns.print_config:
            _check_runs_dir_env()
            config = with_default_run_dir(config, os.environ)  # none given: runs/<time>
            _check_before_start(config)
    except ValueError as exc:
        sys.stderr.write(f"stalwart train: error: {exc}\n")
        return 2
    if ns.print_config:
        return _print_config(ns)
    if env_int("RANK", 0) == 0:  # the first lines: where the run writes, defaults unlike Megatron's
        print(start_lines(config), flush=True)
    _setup_logging(env_int("RANK", 0), ns)
    from stalwart.cli.train import run_from_cli

    return run_from_cli(config, demo=bool(ns.demo))


def _print_config(ns: argparse.Namespace) -> int:
    """``--print-config``: the resolved flags as the TOML that ``--config`` reads."""
    from stalwart.cli.args import build_train_parser
    from stalwart.cli.config_print import config_toml

    header = (
        f"stalwart train flags (stalwart {version()}), written by --print-config.\n"
        "Run them with: stalwart train --config THIS_FILE (flags on the command line win).\n"
        "Unset flags are comments: the preset or another flag decides (stalwart train --help)."
    )
    try:
        text = config_toml(build_train_parser(), ns, header)
    except ValueError as exc:
        sys.stderr.write(f"stalwart train: error: {exc}\n")
        return 2
    sys.stdout.write(text)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``stalwart`` console script and ``python -m stalwart``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        build_main_parser().print_help(sys.stderr)
        return 2
    if args[0] in ("-h", "--help", "--version"):
        try:
            build_main_parser().parse_args(args[:1])
        except SystemExit as exc:  # argparse's way to end --help and --version
            return exc.code if isinstance(exc.code, int) else 0
    try:
        return _dispatch(args[0], args[1:])
    except KeyboardInterrupt:  # Ctrl-C outside the trainer's handler: one line, the shell's 130
        sys.stderr.write("stalwart: interrupted\n")
        return 130


# command -> (module, function) of its entry point, imported only when the command runs:
# `stalwart report` does not pay for the trainer's imports, nor `stalwart --help` for any.
ENTRY_POINTS = {
    "launch": ("stalwart.cli.launch", "main_launch"),
    "report": ("stalwart.cli.report", "main_report"),
    "goodput": ("stalwart.cli.goodput", "main_goodput"),
    "chaos": ("stalwart.cli.chaos", "main_chaos"),
    "checkpoints": ("stalwart.cli.checkpoints", "main_checkpoints"),
    "export": ("stalwart.cli.checkpoints", "main_export"),
}


def _dispatch(command: str, rest: list[str]) -> int:
    if command == "train":
        return main_train(rest)
    if command in ENTRY_POINTS:
        module, function = ENTRY_POINTS[command]
        entry: Callable[[list[str]], int] = getattr(importlib.import_module(module), function)
        return entry(rest)
    sys.stderr.write(
        f"stalwart: error: unknown command {command!r}; allowed: {', '.join(COMMANDS)} "
        "(stalwart --help)\n"
    )
    return 2
