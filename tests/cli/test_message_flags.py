"""Every ``--flag`` a message of stalwart names is a flag that exists (issue 30: messages named
--attention-dropout while refusing it, and --loss-scale, which stalwart has no flag for).

The messages are the string literals of ``src/stalwart`` (docstrings excluded: they may cite
Megatron); every ``--x`` in them must be a flag one of stalwart's parsers accepts, a flag of
torchrun that stalwart passes, one of sbatch that stalwart launch advises, or a placeholder of the config-file help. A Megatron flag that
stalwart refuses may be named only by its own refusal (``cli/megatron_flags.py``,
``cli/megatron_flags_tail.py``).
"""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

import stalwart
from stalwart.cli import megatron_flags
from stalwart.cli.args import build_train_parser
from stalwart.cli.megatron_flags import MegatronRefusal

REFUSAL_MODULES = ("cli/megatron_flags.py", "cli/megatron_flags_tail.py")
# Megatron's switches whose effect holds are accepted (a refusal subclass that stores nothing).
ALWAYS_ACTION = getattr(megatron_flags, "MegatronAlways", ())

SRC = Path(stalwart.__file__).parent
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*(?![\w-])")
TORCHRUN = {
    "--nproc-per-node",
    "--standalone",
    "--max-restarts",
    "--monitor-interval",
    "--rdzv-endpoint",
    "--rdzv-id",
    "--log-dir",
}  # stalwart launch passes these through
SBATCH = {"--exclude", "--requeue"}  # what stalwart launch tells a SLURM user to submit with
PLACEHOLDERS = {"--x", "--no-x", "--no"}  # "--no-x" in the config-file and help texts
# GraphSettings' messages that only a caller building it by hand can see (none: it checks only
# what a path can set; Megatron's other graph flags are refused where they are given).
GRAPH_SETTINGS_ONLY: set[str] = set()


def _options(parser: argparse.ArgumentParser) -> tuple[set[str], set[str]]:
    accepted: set[str] = set()
    refused: set[str] = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                a, r = _options(sub)
                accepted |= a
                refused |= r
            continue
        refusal = isinstance(action, MegatronRefusal) and not isinstance(action, ALWAYS_ACTION)
        (refused if refusal else accepted).update(action.option_strings)
    return accepted, refused


def _all_parsers() -> list[argparse.ArgumentParser]:
    from stalwart.cli import chaos, checkpoints, goodput, launch, main, report
    from stalwart.reliability.hang import monitor

    return [
        build_train_parser(),
        main.build_main_parser(),
        report.build_parser(),
        goodput.build_parser(),
        chaos.build_parser(),
        checkpoints.build_checkpoints_parser(),
        checkpoints.build_convert_parser(),
        checkpoints.build_export_parser(),
        monitor.build_parser(),
        launch.build_parser(),
    ]


def _message_flags() -> dict[str, list[str]]:
    """flag -> ["file:line", ...] for every --flag in a non-docstring string literal."""
    found: dict[str, list[str]] = {}
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if id(node) in docstrings:
                    continue
                where = f"{path.relative_to(SRC)}:{node.lineno}"
                for flag in FLAG.findall(node.value):
                    found.setdefault(flag, []).append(where)
    return found


def test_every_flag_a_message_names_exists() -> None:
    accepted: set[str] = set()
    refused: set[str] = set()
    for parser in _all_parsers():
        a, r = _options(parser)
        accepted |= a
        refused |= r
    known = accepted | TORCHRUN | SBATCH | PLACEHOLDERS
    bad = []
    for flag, places in _message_flags().items():
        if flag in known:
            continue
        for where in places:
            if flag in refused and where.startswith(REFUSAL_MODULES):
                continue  # the refusal names its own flag
            if flag in GRAPH_SETTINGS_ONLY and where.startswith("graphs/checks.py"):
                continue
            kind = "refused by stalwart train" if flag in refused else "no such flag"
            bad.append(f"{where}: {flag} ({kind})")
    assert not bad, "\n".join(bad)


def test_the_scan_sees_messages() -> None:
    flags = _message_flags()
    assert "--save" in flags and "--hidden-dropout" in flags  # the scan is not vacuous
