"""``docs/config-reference.md``: every ``stalwart train`` flag and every ``ShellConfig`` field,
generated from the parser and the config dataclasses (never written by hand).

Regenerate it with::

    PYTHONPATH=src python -m stalwart.cli.config_reference -o docs/config-reference.md

``tests/cli/test_config_reference.py`` regenerates it and fails when the committed page differs.

Which config field a flag sets follows the rule `stalwart.config.run.build_run_config` applies:
a flag's destination fills the field of the same name in each component config of `RunConfig`
(``_pick``), the model flags go through the renames of ``config.run`` and ``config.model``, and
the shell's run-wide values (``train_iters``, ``save_dir``, ``seq_length``) are their
component's. The few flags handled by code of their own are listed in `_SPECIAL`.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import re
import sys
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from stalwart.cli.arg_types import Float, Int, LogLevel
from stalwart.cli.args import build_train_parser
from stalwart.cli.help_format import describe_default
from stalwart.cli.megatron_flags import MegatronAlways, MegatronRefusal
from stalwart.config.model import _PASS_THROUGH as _ARCHITECTURE_FIELDS
from stalwart.config.run import _MODEL_FLAGS, _SHARED, DEMO_DEFAULTS, RunConfig
from stalwart.loop import Names, ShellConfig

COMMAND = "PYTHONPATH=src python -m stalwart.cli.config_reference -o docs/config-reference.md"

# Flags whose value is not a field of the same name (code of their own in config.run/model).
_SPECIAL = {
    "config": "none: the TOML file's keys are flags (see above)",
    "print_config": "none (prints the flags as TOML)",
    "demo": "the defaults of `--demo` (see above)",
    "progress_bar": "`ShellConfig.log.log_progress_bar`",
    "ft_timeouts": "`ShellConfig.ft.timeouts`",
    "disable_bias_linear": "`GPTConfig.add_bias_linear` (negated)",
    "group_query_attention": "`GPTConfig.num_query_groups` (1 without `--num-query-groups`)",
    "num_query_groups": "`GPTConfig.num_query_groups`",
    "max_position_embeddings": "none: checked against `GPTConfig.seq_length` (Megatron's flag)",
    "kv_channels": "none: checked against `GPTConfig.kv_channels` (Megatron's flag)",
    "attention_dropout": "none: checked against `GPTConfig.dropout` (Megatron's flag)",
    "make_vocab_size_divisible_by": "none: checked against `GPTConfig.vocab_size` (Megatron's)",
    "logging_level": "none: the process's `logging` level",
    "verbose": "none: the process's `logging` level (INFO)",
}
_BOOLEAN_OPTIONAL_SUFFIX = " (default: %(default)s)"
# Refused Megatron flags (migration-megatron.md lists them) and ``--help`` are not settings.
_NOT_LISTED = (MegatronRefusal, MegatronAlways, argparse._HelpAction)


def _component_fields() -> dict[str, list[str]]:
    """Destination name -> the fields it fills, as ``Class.field`` (``ShellConfig.<path>`` for
    the shell's, whose sub-configs a loop builds by those names)."""
    out: dict[str, list[str]] = {}
    hints = typing.get_type_hints(RunConfig)
    for f in dataclasses.fields(RunConfig):
        kind = hints[f.name]
        if kind is ShellConfig:
            for path in shell_paths():
                out.setdefault(path.rpartition(".")[2], []).append(f"ShellConfig.{path}")
        elif _is_config_class(kind) and f.name != "model":
            for g in dataclasses.fields(kind):
                if g.init:
                    out.setdefault(g.name, []).append(f"{kind.__name__}.{g.name}")
        elif f.init and not _is_config_class(kind) and f.compare:
            out.setdefault(f.name, []).append(f"RunConfig.{f.name}")
    for dest, field in {**_MODEL_FLAGS, **_ARCHITECTURE_FIELDS}.items():
        out.setdefault(dest, []).insert(0, f"GPTConfig.{field}")
    for shell_field, path in _SHARED.items():  # one value, held by the shell and its component
        name = path.split(".")[1]
        entry = f"ShellConfig.{shell_field}"
        if entry not in out.get(name, []):
            out.setdefault(name, []).append(entry)
    return out


def _is_config_class(kind: Any) -> typing.TypeGuard[type]:
    return isinstance(kind, type) and dataclasses.is_dataclass(kind)


def shell_paths() -> list[str]:
    """Every ``ShellConfig`` setting as a dotted path (``exit.save_interval``, ``train_iters``)."""
    config = ShellConfig(train_iters=1)
    paths: list[str] = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            paths += [f"{f.name}.{g.name}" for g in dataclasses.fields(value) if g.init]
        else:
            paths.append(f.name)
    return paths


def flag_settings() -> dict[str, str]:
    """Each ``stalwart train`` flag (its first spelling) -> the config fields it sets."""
    fields = _component_fields()
    out: dict[str, str] = {}
    for action in _flags(build_train_parser()):
        targets = fields.get(action.dest)
        if action.dest in _SPECIAL:
            out[action.option_strings[0]] = _SPECIAL[action.dest]
        elif targets:
            out[action.option_strings[0]] = ", ".join(f"`{t}`" for t in targets)
        else:
            raise ValueError(f"{action.option_strings[0]}: no config field of that name")
    return out


def _flags(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    for action in parser._actions:
        if action.option_strings and not isinstance(action, _NOT_LISTED):
            yield action


def _kind(action: argparse.Action) -> str:
    """What the flag takes, as a user reads it."""
    if isinstance(action, argparse.BooleanOptionalAction):
        return "switch (on; its `--no-` form: off)"
    if action.nargs == 0:
        return "switch"
    if action.choices is not None:
        kind = "one of " + ", ".join(f"`{c}`" for c in action.choices)
    else:
        kind = _type_name(action.type)
    if action.nargs in ("+", "*"):
        kind += ", one or more" if action.nargs == "+" else ", zero or more"
    elif isinstance(action.nargs, int):
        kind += f", {action.nargs} values"
    return kind


def _type_name(kind: Any) -> str:
    """``type=int``/``float`` are the parser's checked `Int()`/`Float()` (`arg_types`)."""
    if kind is int:
        kind = Int()
    if kind is float:
        kind = Float()
    if isinstance(kind, Int):
        upper = "" if kind.maximum == Int().maximum else f" and <= {kind.maximum}"
        return f"integer >= {kind.minimum}{upper}"
    if isinstance(kind, Float):
        return "number" + kind.allowed.removeprefix("a finite number")
    if isinstance(kind, LogLevel):
        return "level: 0-50 or a name"
    return "text" if kind is None or kind is str else getattr(kind, "__name__", "value")


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _help(action: argparse.Action) -> str:
    return _cell((action.help or "").replace(_BOOLEAN_OPTIONAL_SUFFIX, "").replace("%%", "%"))


def _flag_rows(group: Any, settings: dict[str, str]) -> list[str]:
    rows = []
    for action in group._group_actions:
        if not action.option_strings or isinstance(action, _NOT_LISTED):
            continue
        names = " ".join(f"`{o}`" for o in action.option_strings)
        default = describe_default(action)
        row = (names, _cell(_kind(action)), f"`{default}`", settings[action.option_strings[0]])
        rows.append("| " + " | ".join((*row, _help(action))) + " |")
    return rows


def train_flags_section() -> list[str]:
    """One table per argument group of ``stalwart train --help``, in its order."""
    parser, settings = build_train_parser(), flag_settings()
    lines = ["## `stalwart train` flags", ""]
    lines += [
        "One table per group of `stalwart train --help`, in its order. *Sets* is the config",
        "field the value ends in (`RunConfig`'s component, or the `ShellConfig` a loop builds);",
        "the TOML key of `--config` is the flag without its dashes (`save_interval = 500`; a",
        "switch under its positive name: `shuffle = false`), written under the group's table",
        "by `--print-config`. Megatron-LM flags stalwart does",
        "not implement are refused in one line (exit 2):",
        "[migration-megatron.md](migration-megatron.md) lists them.",
        "",
        "`--demo` sets, unless given: "
        + ", ".join(f"`--{k.replace('_', '-')} {v}`" for k, v in DEMO_DEFAULTS.items())
        + ".",
    ]
    header = ["| flag | takes | default | sets | help |", "|---|---|---|---|---|"]
    for group in parser._action_groups:
        rows = _flag_rows(group, settings)
        if not rows:
            continue
        table = getattr(group, "toml_table", None)
        title = group.title or ""
        suffix = f" (TOML `[{table}]`)" if table else ""
        lines += ["", f"### {title}{suffix}", "", *header, *rows]
    return lines


def _value(value: Any) -> str:
    if isinstance(value, enum.Enum):
        return value.name if not isinstance(value.value, str) else repr(value.value)
    if dataclasses.is_dataclass(value):
        return type(value).__name__ + "()"
    return repr(value)


def _hint(kind: Any) -> str:
    """A type annotation as written in the source, without module paths."""
    if isinstance(kind, type):
        return kind.__name__
    text = str(kind).replace("NoneType", "None")
    return re.sub(r"\b(?:[a-z_]\w*\.)+(?=[A-Za-z])", "", text)


def _shell_row(path: str, config: ShellConfig, flags: dict[str, argparse.Action]) -> str:
    section, _, name = path.rpartition(".")
    owner = getattr(config, section) if section else config
    hint = _hint(typing.get_type_hints(type(owner))[name])
    default = "required" if path == "train_iters" else _value(getattr(owner, name))
    flag = Names.CLI.spell(path)
    action = flags.get(flag)
    cli = f"`{flag}` (`{describe_default(action)}`)" if action else "none"
    return f"| `{path}` | `{_cell(hint)}` | `{_cell(default)}` | {cli} |"


def shell_section() -> list[str]:
    """Every ``ShellConfig`` field: type, default, and the flag of the CLI that sets it."""
    flags = {o: a for a in build_train_parser()._actions for o in a.option_strings}
    config = ShellConfig(train_iters=1)
    hints = typing.get_type_hints(ShellConfig)
    lines = ["## `ShellConfig` (your own loop, Lightning, the HF Trainer)", ""]
    lines += [
        "`stalwart.loop.ShellConfig` is what a hand-written loop builds (`config.build()`), and",
        "its fields are the keywords of both `StalwartCallback`s. A dotted path is a field of a",
        "sub-config: `exit.save_interval` is `ShellConfig(exit=ExitConfig(save_interval=...))`.",
        "Defaults are `ShellConfig`'s (a loop's); the flag's default, in parentheses, is the",
        "trainer's (unlike a loop's for the SIGTERM handler, the rerun machine, the log).",
        "",
        "| sub-config | class |",
        "|---|---|",
    ]
    for f in dataclasses.fields(config):
        kind = hints[f.name]
        if _is_config_class(kind):
            lines.append(f"| `{f.name}` | `{kind.__module__}.{kind.__name__}` |")
    lines += ["", "| field | type | default | flag (its default) |", "|---|---|---|---|"]
    lines += [_shell_row(path, config, flags) for path in shell_paths()]
    return lines


def run_config_section() -> list[str]:
    """``RunConfig``'s components: where the trainer's flags end, by class."""
    lines = ["## `RunConfig` (the trainer)", ""]
    lines += [
        "`stalwart.config.run.build_run_config` turns the flags into one frozen `RunConfig`;",
        "each component owns its dataclass and checks its own values (a bad value exits 2",
        "naming the flag), `check_combinations` the rules between components.",
        "",
        "| field | class |",
        "|---|---|",
    ]
    hints = typing.get_type_hints(RunConfig)
    for f in dataclasses.fields(RunConfig):
        kind = hints[f.name]
        if _is_config_class(kind):
            lines.append(f"| `{f.name}` | `{kind.__module__}.{kind.__name__}` |")
    return lines


def render() -> str:
    """The whole page (deterministic: the parser's and the dataclasses' order)."""
    lines = [
        "# Configuration reference",
        "",
        f"Generated by `{COMMAND}`",
        "from the parser and the config dataclasses: do not edit by hand (a test regenerates",
        "it and fails on a difference). The prose is in the [README](../README.md) and",
        "[the tutorial](tutorial.md); `stalwart train --help` prints the same flags.",
        "",
        *train_flags_section(),
        "",
        *shell_section(),
        "",
        *run_config_section(),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``-o FILE`` writes the page, else it goes to stdout."""
    parser = argparse.ArgumentParser(
        prog="python -m stalwart.cli.config_reference", description=__doc__.split("\n")[0]
    )
    parser.add_argument("-o", "--output", metavar="FILE", help="write here (default: stdout)")
    ns = parser.parse_args(argv)
    text = render()
    if ns.output:
        Path(ns.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
