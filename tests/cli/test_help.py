"""Help that helps: every flag of every command has a one-sentence help, its default and its
choices; ``stalwart --help`` lists the commands, ``--version`` prints the package version;
``stalwart train --help`` starts with example commands and stays readable."""

from __future__ import annotations

import argparse
import importlib
import re
from importlib import metadata

import pytest

from stalwart.cli.args import build_train_parser
from stalwart.cli.chaos import build_parser as build_chaos_parser
from stalwart.cli.checkpoints import (
    build_checkpoints_parser,
    build_convert_parser,
    build_export_parser,
)
from stalwart.cli.help_format import FlagHelpFormatter, is_plain_switch
from stalwart.cli.main import COMMANDS, ENTRY_POINTS, build_main_parser, main
from stalwart.cli.report import build_parser as build_report_parser

PARSERS = {
    "stalwart": build_main_parser,
    "train": build_train_parser,
    "report": build_report_parser,
    "chaos": build_chaos_parser,
    "checkpoints": build_checkpoints_parser,
    "checkpoints convert": build_convert_parser,
    "export": build_export_parser,
}
_NO_DEFAULT = (argparse._HelpAction, argparse._VersionAction)


def _shown(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The help of one flag as ``--help`` prints it, on one line."""
    formatter = FlagHelpFormatter(parser.prog, width=100)
    return " ".join(formatter._format_action(action).split())


def _visible(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.help is not argparse.SUPPRESS]


@pytest.mark.parametrize("name", list(PARSERS))
def test_every_option_of_every_command_has_help_default_and_choices(name: str) -> None:
    parser = PARSERS[name]()
    assert isinstance(parser.formatter_class, type)
    assert issubclass(parser.formatter_class, FlagHelpFormatter), name
    problems = []
    for action in _visible(parser):
        label = "/".join(action.option_strings) or action.dest
        text = (action.help or "").strip()
        shown = _shown(parser, action)
        if not text:
            problems.append(f"{label}: no help")
        needs_default = (
            action.option_strings
            and not isinstance(action, _NO_DEFAULT)
            and not is_plain_switch(action)
            and not action.required
        )
        if needs_default and "default" not in shown:
            problems.append(f"{label}: no default shown: {shown}")
        for choice in action.choices or ():
            if str(choice) not in shown:
                problems.append(f"{label}: choice {choice!r} not shown: {shown}")
    assert not problems, f"stalwart {name} --help:\n" + "\n".join(problems)


def test_defaults_shown_are_the_real_defaults() -> None:
    parser = build_train_parser()
    by_flag = {o: a for a in parser._actions for o in a.option_strings}
    assert "(default: 0.0003)" in _shown(parser, by_flag["--lr"])
    assert "(default: 1234)" in _shown(parser, by_flag["--seed"])
    assert "choices: constant, linear, cosine; default: cosine" in _shown(
        parser, by_flag["--lr-decay-style"]
    )
    assert "default: on" in _shown(parser, by_flag["--cuda-graph-speculative-launch"])
    assert "(default: 100)" in _shown(parser, by_flag["--train-iters"])
    # A flag whose default needs words says it, instead of "unset".
    assert "(default: the preset's)" in _shown(parser, by_flag["--num-layers"])


def test_top_level_help_lists_every_command_in_one_line(capsys) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: stalwart <command>")
    for command, text in COMMANDS.items():
        lines = [line for line in out.splitlines() if line.strip().startswith(command + " ")]
        assert lines and text in lines[0], (command, out)
    assert "--version" in out and "Exit codes:" in out


def test_every_listed_command_dispatches_to_its_entry_point() -> None:
    """A command in ``stalwart --help`` but not in the dispatch table would be "unknown"."""
    assert set(COMMANDS) == {"train", *ENTRY_POINTS}
    for module, function in ENTRY_POINTS.values():
        assert callable(getattr(importlib.import_module(module), function)), (module, function)


def test_version_comes_from_the_package_metadata(capsys) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"stalwart {metadata.version('stalwart')}\n"


def test_no_command_prints_help_and_exits_2(capsys) -> None:
    assert main([]) == 2
    assert "commands:" in capsys.readouterr().err


def test_unknown_command_is_one_line(capsys) -> None:
    assert main(["trian"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "unknown command 'trian'" in err and "train" in err


def test_train_help_starts_with_three_example_commands_and_stays_readable(
    capsys, monkeypatch
) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    head = "\n".join(lines[:12])
    examples = [line for line in lines[:12] if re.match(r"\s+(stalwart|torchrun) ", line)]
    assert len(examples) == 3, head
    assert lines[0].startswith("usage: stalwart train [flags]"), head  # not 150 flags
    assert max(len(line) for line in lines) <= 100
    options = sum(1 for a in _visible(build_train_parser()) if a.option_strings)
    assert options >= 140
    # Most flags take one line: the whole page is at most ~1.9 lines per flag with headers.
    assert len(lines) < 1.9 * options, len(lines)
    groups = re.findall(r"^(\S[^\n]*):$", out, flags=re.M)
    for title in ("reliability: rerun state machine", "reliability: hang detection",
                  "reliability: graceful exit", "reliability: in-process restart",
                  "reliability: fault injection", "observability: logging",
                  "observability: timers", "observability: straggler detection",
                  "observability: memory", "observability: energy", "observability: dumps",
                  "observability: profiler", "CUDA graphs", "model", "data", "training",
                  "optimizer", "checkpoints"):  # fmt: skip
        assert any(g.startswith(title) for g in groups), (title, groups)


def test_megatron_spellings_are_listed_with_ours(capsys) -> None:
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--enable-ft, --enable-ft-package" in out
    for flag in ("--save-dgrads-interval", "--save-tokens-per-expert-interval",
                 "--straggler-minmax-count", "--log-progress", "--inprocess-heartbeat-timeout",
                 "--inprocess-barrier-timeout", "--inprocess-monitor-thread-interval",
                 "--inprocess-empty-cuda-cache", "--override-opt-param-scheduler",
                 "--use-checkpoint-opt-param-scheduler"):  # fmt: skip
        assert flag in out, flag
    assert "--tensor-model-parallel-size" not in out  # refused flags are not advertised
