"""``--config run.toml``: flag values from a TOML file, checked exactly as on the command line.

What ``--print-config`` writes is what this reads (`stalwart.cli.config_print`). Every key names
a flag (``train_iters``, ``train-iters``) or its destination (``moe_capacity_factor``); tables
only group keys (``[optimizer] lr = 1e-3`` means ``--lr 1e-3``). Each value is turned into the
argv tokens the CLI would get and parsed by the same parser, so types, ranges, choices and
``nargs`` are the CLI's.

Switches (``store_true``, ``store_false``, ``--x/--no-x``) take a TOML boolean only, and one
rule spells them: **the key is the setting's positive name and the value is what the setting
ends as**. ``shuffle = false`` is ``--no-shuffle``, ``load_optim = false`` is
``--no-load-optim``, ``bf16 = true`` is ``--bf16``, ``swiglu = false`` turns SwiGLU off even
under a llama-* preset. ``--print-config`` writes this spelling. The flag's own negated
spelling is accepted too and means the same: ``no_shuffle = true`` is ``shuffle = false``
(``no_load_optim = true`` is ``load_optim = false``); giving both is refused.

Megatron flags that stalwart does not implement are refused as keys as on the command line
(`stalwart.cli.megatron_flags`). The values become parser defaults (the command line still
wins). Any problem is a ``ValueError`` naming the file, the key and what is allowed; the CLI
prints it as one line, exit code 2.
"""

from __future__ import annotations

import argparse
import datetime
import os
import tomllib
from collections.abc import Callable
from typing import Any

from stalwart.cli.megatron_flags import MegatronRefusal, refusal_message

CONFIG_HELP = (
    "TOML of flag values as --print-config writes it: keys are flags (- or _), tables group "
    "them; a switch is positive name = true/false (shuffle = false is --no-shuffle; "
    "no_shuffle = true works too); the command line wins (default: none)"
)
BOOLEAN_ACTIONS = (
    argparse._StoreTrueAction,
    argparse._StoreFalseAction,
    argparse.BooleanOptionalAction,
)
_SCALARS = (str, int, float)
_MAX_BYTES = 16 << 20  # a config file is a few hundred bytes; anything huge is a wrong path


class _KeyError(Exception):
    """A key's value is not what its flag takes (message without the file/key prefix)."""


def read_toml(path: str) -> dict[str, Any]:
    """The parsed file; ValueError naming ``--config`` and the file when it cannot be read."""
    if not path.strip():
        raise ValueError("--config is empty (it takes a TOML file)")
    if os.path.exists(path) and not os.path.isfile(path):
        raise ValueError(f"--config: {path} is not a regular file")  # a FIFO would block
    try:
        if os.path.getsize(path) > _MAX_BYTES:
            raise ValueError(f"--config: {path} is larger than {_MAX_BYTES >> 20} MiB")
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ValueError(f"--config: file not found: {path}") from None
    except RecursionError:  # tomllib recurses into nested arrays and inline tables
        raise ValueError(f"--config: cannot read {path}: values nested too deeply") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(f"--config: cannot read {path}: {reason}") from None


_MAX_TABLE_DEPTH = 8  # tables only group keys; deeper is not a config file


def _flatten(data: dict[str, Any], path: str, depth: int = 0) -> list[tuple[str, Any]]:
    if depth > _MAX_TABLE_DEPTH:
        raise ValueError(f"--config {path}: tables nested deeper than {_MAX_TABLE_DEPTH} levels")
    items: list[tuple[str, Any]] = []
    for key, value in data.items():
        if isinstance(value, dict):
            items.extend(_flatten(value, path, depth + 1))
        else:
            items.append((key, value))
    return items


def positive_name(action: argparse.Action) -> str:
    """The key a switch is written under: its destination, or ``x`` for a ``--no-x`` flag that
    stores True (``--no-load-optim`` -> ``load_optim``)."""
    long = next(o for o in action.option_strings if o.startswith("--"))
    if isinstance(action, argparse._StoreTrueAction) and long.startswith("--no-"):
        return long[5:].replace("-", "_")
    return action.dest


def _option_index(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """``name -> action`` for every flag spelling, every destination and every switch's
    positive name."""
    index: dict[str, argparse.Action] = {}
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", "config"):
            continue
        for option in action.option_strings:
            if option.startswith("--"):
                index[option[2:].replace("-", "_")] = action
        if action.dest != argparse.SUPPRESS:
            index.setdefault(action.dest, action)
        if isinstance(action, BOOLEAN_ACTIONS):
            index.setdefault(positive_name(action), action)
    return index


def _toml_repr(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else repr(value)


def _flag_for(action: argparse.Action, name: str) -> str:
    """The flag a key names (its own spelling when it is one), for messages."""
    spelled = "--" + name.replace("_", "-")
    return spelled if spelled in action.option_strings else action.option_strings[-1]


def switch_value(action: argparse.Action, name: str, value: object) -> bool:
    """The destination's value for the key ``name = value`` of a switch (see the module
    docstring): ``value``, inverted when ``name`` negates the destination."""
    if not isinstance(value, bool):
        flag = _flag_for(action, name)
        raise _KeyError(f"{flag} is a switch: it takes true or false, got {_toml_repr(value)}")
    negated = name == f"no_{action.dest}" or action.dest == f"no_{name}"
    return value != negated


def _token(flag: str, value: object) -> str:
    if isinstance(value, bool) or not isinstance(value, _SCALARS):
        kind = "a list" if isinstance(value, list) else _toml_repr(value)
        raise _KeyError(f"{flag} takes a string or a number, got {kind}")
    return repr(value) if isinstance(value, float) else str(value)


def _value_tokens(action: argparse.Action, value: object) -> list[str]:
    flag = next(o for o in action.option_strings if o.startswith("--"))
    many = action.nargs not in (None, "?")
    if isinstance(value, list) and isinstance(action, argparse._AppendAction) and not many:
        # A repeatable flag (--inductor-config K=V ...): one occurrence per item, as
        # --print-config writes the list.
        return [f"{flag}={_token(flag, v)}" for v in value]
    if isinstance(value, list):
        if not many:
            raise _KeyError(f"{flag} takes one value, not a list")
        return [flag, *(_token(flag, v) for v in value)]
    if isinstance(value, datetime.date | datetime.time):
        raise _KeyError(f"{flag} takes a string or a number, got the TOML date/time {value}")
    # ``--flag=value`` keeps a value that starts with "-" a value, as on the command line.
    return [flag, _token(flag, value)] if many else [f"{flag}={_token(flag, value)}"]


def toml_defaults(
    path: str,
    parser_factory: Callable[[], argparse.ArgumentParser],
) -> dict[str, Any]:
    """Parser defaults (``dest -> value``) from the TOML file at ``path``.

    ``parser_factory`` builds the parser whose flags the file sets; its ``error`` must raise
    (``OneLineErrorParser(raise_errors=True)``): each key is parsed on its own so that the error
    names it.
    """
    data = read_toml(path)
    parser = parser_factory()
    index = _option_index(parser)
    defaults: dict[str, Any] = {}
    seen: dict[str, str] = {}  # destination (or refused flag) -> the key that set it
    for key, value in _flatten(data, path):
        name = key.replace("-", "_")
        if name not in index:
            raise ValueError(f"--config {path}: unknown key {key!r} (keys are flag names)")
        action = index[name]
        ident = action.dest if action.dest != argparse.SUPPRESS else action.option_strings[0]
        if ident in seen:
            raise ValueError(f"--config {path}: key {key!r} sets the same flag as {seen[ident]!r}")
        seen[ident] = key
        try:
            if isinstance(action, MegatronRefusal):
                _check_refused(action, value)
            elif isinstance(action, BOOLEAN_ACTIONS):
                defaults[action.dest] = switch_value(action, name, value)
            else:
                parsed = parser.parse_args(_value_tokens(action, value))
                defaults[action.dest] = getattr(parsed, action.dest)
        except (_KeyError, ValueError) as exc:
            raise ValueError(f"--config {path}: key {key!r}: {exc}") from None
    return defaults


def _check_refused(action: MegatronRefusal, value: object) -> None:
    """A Megatron flag stalwart does not implement: fine when off (false, or an accepted
    value such as a parallel size of 1), else the refusal."""
    u = action.unsupported
    if action.holds and isinstance(value, bool):
        return  # a Megatron switch whose effect holds anyway (true or false: the same run)
    if value is False or (u.takes_value and _toml_repr(value).strip("'") in u.accepted):
        return
    raise _KeyError(refusal_message(u.flag, u.reason))
