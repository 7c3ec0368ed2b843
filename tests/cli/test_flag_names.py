"""Every ``--flag`` that a message in src/ names is a flag the user can actually pass.

The scan reads every string literal of the package (f-string parts included, docstrings left
out): error messages, help texts, hints. A flag counts as real when the parser of the command it
belongs to has it: ``stalwart train`` everywhere, plus the subcommand's own parser for its files,
plus torchrun's flags (messages tell how to relaunch). Messages about settings that are not
flags name the field instead (``FaultToleranceConfig.safety_factor``).
"""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

from stalwart.cli.args import build_train_parser

SRC = Path(__file__).resolve().parents[2] / "src" / "stalwart"
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*(?![\w-])")
# The hang monitor is its own process with its own flags (its worker side writes them).
MONITOR_FILES = {"reliability/hang/monitor.py", "reliability/hang/monitor_client.py"}
TORCHRUN = {"--max-restarts", "--standalone", "--monitor-interval", "--nproc-per-node", "--nnodes",
            "--rdzv-endpoint", "--rdzv-id", "--log-dir"}  # fmt: skip
# sbatch's flags, in the lines that tell how to move a job off a node (stalwart launch).
SLURM = {"--exclude", "--requeue"}
# graphs/checks.py encodes Megatron's CUDA-graph compatibility rules over `GraphSettings`, whose
# fields carry Megatron's flag names; these are the ones `stalwart train` does not expose, so the
# rules naming them can only fire for a GraphSettings built by hand (or named in its docstring).
MEGATRON_GRAPH_RULES = {"--attention-dropout"}


def _options(parser: argparse.ArgumentParser) -> set[str]:
    """Option strings of a parser built at run time (``--no-x`` of ``--x/--no-x`` included)."""
    return {o for action in parser._actions for o in action.option_strings}


# `stalwart.cli.arg_types`' helpers that declare a flag (its name a positional argument).
FLAG_HELPERS = {"switch", "negated", "values"}


def _declared(path: Path) -> set[str]:
    """Option strings of the ``add_argument`` and flag-helper calls in ``path`` (a subcommand's
    parser); `values` rows are tuples whose first item is the flag."""
    options = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Call):
            continue
        name = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
        if name != "add_argument" and name not in FLAG_HELPERS:
            continue
        args = [r.elts[0] if isinstance(r, ast.Tuple) else r for r in node.args]
        options |= {
            a.value for a in args if isinstance(a, ast.Constant) and str(a.value)[:2] == "--"
        }
    return options


def _subcommand_options(path: Path) -> set[str]:
    rel = path.relative_to(SRC).as_posix()
    owner = {
        "chaos/": "cli/chaos.py",
        "report/": "cli/report.py",
        "checkpoint/": "cli/checkpoints.py",  # "run: stalwart checkpoints convert --trust-pickle"
        "compile/cache_trust.py": "cli/checkpoints.py",  # "stalwart checkpoints --verify would fail"
        "distributed/launch": "cli/launch.py",
        "observability/goodput/ettr_report": "cli/goodput.py",  # stalwart goodput --project
    }
    if rel == "chaos/fault_schedule.py":  # a chaos scenario whose jobs run under stalwart launch
        return _declared(SRC / "cli/chaos.py") | _declared(SRC / "cli/launch.py")
    for prefix, cli_file in owner.items():
        if rel.startswith(prefix):
            return _declared(SRC / cli_file)
    if rel in MONITOR_FILES:  # the monitor process's own flags, written by its worker side
        return _declared(SRC / "reliability/hang/monitor.py")
    if rel.startswith("cli/"):
        return _declared(path)
    if rel == "graphs/checks.py":
        return MEGATRON_GRAPH_RULES
    return set()


def _docstring_ids(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def mentioned_flags(path: Path) -> dict[str, int]:
    """``flag -> first line`` for every flag in a non-docstring string literal of ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = _docstring_ids(tree)
    found: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) in docstrings:
                continue
            for flag in FLAG.findall(node.value):
                found.setdefault(flag, node.lineno)
    return found


def test_every_flag_a_message_names_exists() -> None:
    train = _options(build_train_parser())
    unknown = []
    for path in sorted(SRC.rglob("*.py")):
        allowed = train | TORCHRUN | SLURM | _subcommand_options(path)
        for flag, line in mentioned_flags(path).items():
            if flag not in allowed:
                unknown.append(f"{path.relative_to(SRC)}:{line}: {flag}")
    assert not unknown, "messages name flags that do not exist:\n" + "\n".join(unknown)


def test_the_megatron_rule_list_is_not_stale() -> None:
    named = set(mentioned_flags(SRC / "graphs" / "checks.py"))
    assert named >= MEGATRON_GRAPH_RULES - _options(build_train_parser())


def test_the_scan_sees_messages() -> None:
    """The scan itself works: it finds flags in an f-string raise and skips docstrings."""
    found = mentioned_flags(SRC / "config" / "training.py")
    assert "--lr-decay-style" in found and "--bf16" in found
