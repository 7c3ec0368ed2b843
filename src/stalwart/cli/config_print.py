"""``--print-config``: the flags of a run as the TOML file that ``--config`` reads.

Round trip: ``stalwart train ... --print-config > run.toml`` then ``stalwart train --config
run.toml --print-config`` prints the same bytes, and the run it describes is the same run. Every
flag is written, one per line, under the TOML table of its group (``[optimizer]``,
``[reliability.rerun]``, ...): flags with a value as ``key = value``, unset flags (``None``: the
preset or another flag decides) as a comment, so the file lists every setting there is. Keys
are destination names; switches follow `stalwart.cli.config_file`'s rule (positive name, the
value the setting ends as: ``shuffle = false``, ``load_optim = false``).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator

from stalwart.cli.config_file import BOOLEAN_ACTIONS, positive_name
from stalwart.cli.megatron_flags import MegatronRefusal

_NOT_SETTINGS = ("help", "config", "print_config")


def _toml_string(text: str, flag: str) -> str:
    """A TOML basic string (control characters escaped); refuses text that is not UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(
            f"--print-config: the value of {flag} is not UTF-8 text, which TOML cannot hold"
        ) from None
    out = []
    for ch in text:
        if ch in ('"', "\\"):
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def toml_value(value: object, flag: str) -> str:
    """One value in TOML (``bool`` before ``int``: a bool is an int in Python)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)  # shortest round-tripping form; finite (the checked flag types)
    if isinstance(value, str):
        return _toml_string(value, flag)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v, flag) for v in value) + "]"
    raise ValueError(f"--print-config: {flag} holds {value!r}, which has no TOML form")


def _is_setting(action: argparse.Action) -> bool:
    return (
        bool(action.option_strings)
        and action.dest not in _NOT_SETTINGS
        and not isinstance(action, MegatronRefusal)
    )


def _line(action: argparse.Action, ns: argparse.Namespace) -> str:
    value = getattr(ns, action.dest, action.default)
    flag = action.option_strings[0]
    if isinstance(action, BOOLEAN_ACTIONS):
        key = positive_name(action)
        if value is None:
            return f"# {key}: unset"
        on = bool(value) if key == action.dest else not value
        return f"{key} = {toml_value(on, flag)}"
    if value is None:
        return f"# {action.dest}: unset"
    return f"{action.dest} = {toml_value(value, flag)}"


def _sections(parser: argparse.ArgumentParser) -> Iterator[tuple[str | None, str, list]]:
    """(table, title, actions) per argument group, the untabled group first."""
    groups = sorted(parser._action_groups, key=lambda g: getattr(g, "toml_table", "") != "")
    for g in groups:
        actions = [a for a in g._group_actions if _is_setting(a)]
        if actions:
            yield getattr(g, "toml_table", None), g.title or "", actions


def config_toml(parser: argparse.ArgumentParser, ns: argparse.Namespace, header: str) -> str:
    """The TOML text of the flags in ``ns`` (parsed by ``parser``), starting with ``header``
    (comment lines). Deterministic: the parser's group and flag order."""
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    for table, title, actions in _sections(parser):
        if table is not None:
            lines += ["", f"[{table}]" + (f"  # {title}" if title != table else "")]
        lines += [_line(a, ns) for a in actions]
    return "\n".join(lines) + "\n"
