"""``--config run.toml``: flag values from a TOML file, checked exactly as on the command line.

Every key names a flag (``train_iters``, ``train-iters``) or its destination (``shuffle`` for
``--no-shuffle``); tables only group keys (``[optimizer] lr = 1e-3`` means ``--lr 1e-3``). Each
value is turned into the argv tokens the CLI would get and parsed by the same parser, so types,
ranges, choices and ``nargs`` are the CLI's:

* a boolean flag (``store_true``, ``store_false``, ``--x/--no-x``) takes a TOML boolean only;
  ``no-shuffle = true`` and ``shuffle = false`` both mean ``--no-shuffle``;
* any other flag takes a string or a number (a number is written as the CLI would see it, so
  ``train_iters = 1.5`` is refused by the integer type), or a list where the flag takes several
  values.

The values become parser defaults (the command line still wins). Any problem is a ``ValueError``
naming the file, the key and what is allowed; the CLI prints it as one line, exit code 2.
"""

from __future__ import annotations

import argparse
import datetime
import os
import tomllib
from collections.abc import Callable
from typing import Any

_BOOLEAN_ACTIONS = (
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
    if os.path.exists(path) and not os.path.isfile(path):
        raise ValueError(f"--config: {path} is not a regular file")  # a FIFO would block
    try:
        if os.path.getsize(path) > _MAX_BYTES:
            raise ValueError(f"--config: {path} is larger than {_MAX_BYTES >> 20} MiB")
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ValueError(f"--config: file not found: {path}") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(f"--config: cannot read {path}: {reason}") from None


def _flatten(data: dict[str, Any]) -> list[tuple[str, Any]]:
    items: list[tuple[str, Any]] = []
    for key, value in data.items():
        if isinstance(value, dict):
            items.extend(_flatten(value))
        else:
            items.append((key, value))
    return items


def _option_index(parser: argparse.ArgumentParser) -> dict[str, tuple[argparse.Action, str]]:
    """``name -> (action, option string)`` for every flag spelling and every destination."""
    index: dict[str, tuple[argparse.Action, str]] = {}
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", "config"):
            continue
        for option in action.option_strings:
            if option.startswith("--"):
                index[option[2:].replace("-", "_")] = (action, option)
        index.setdefault(action.dest, (action, ""))
    return index


def _toml_repr(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else repr(value)


def _boolean_tokens(action: argparse.Action, option: str, value: object) -> list[str]:
    if not isinstance(value, bool):
        flag = option or action.option_strings[-1]
        raise _KeyError(f"{flag} is a switch: it takes true or false, got {_toml_repr(value)}")
    if isinstance(action, argparse.BooleanOptionalAction):
        positive = next(o for o in action.option_strings if not o.startswith("--no-"))
        negated = option.startswith("--no-")
        on = value != negated
        return [positive if on else f"--no-{positive[2:]}"]
    flag = option or action.option_strings[-1]
    if option:  # the flag's own spelling: true means "give the flag"
        return [flag] if value else []
    # The destination's spelling: the value it should end with (store_false: false = give it).
    gives = value if isinstance(action, argparse._StoreTrueAction) else not value
    return [flag] if gives else []


def _token(flag: str, value: object) -> str:
    if isinstance(value, bool) or not isinstance(value, _SCALARS):
        kind = "a list" if isinstance(value, list) else _toml_repr(value)
        raise _KeyError(f"{flag} takes a string or a number, got {kind}")
    return repr(value) if isinstance(value, float) else str(value)


def _value_tokens(action: argparse.Action, value: object) -> list[str]:
    flag = next(o for o in action.option_strings if o.startswith("--"))
    many = action.nargs not in (None, "?")
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
    seen: dict[str, str] = {}
    for key, value in _flatten(data):
        name = key.replace("-", "_")
        if name not in index:
            raise ValueError(f"--config {path}: unknown key {key!r} (keys are flag names)")
        action, option = index[name]
        if action.dest in seen:
            raise ValueError(
                f"--config {path}: key {key!r} sets the same flag as {seen[action.dest]!r}"
            )
        seen[action.dest] = key
        try:
            if isinstance(action, _BOOLEAN_ACTIONS):
                tokens = _boolean_tokens(action, option, value)
            else:
                tokens = _value_tokens(action, value)
            parsed = parser.parse_args(tokens)
        except (_KeyError, ValueError) as exc:
            raise ValueError(f"--config {path}: key {key!r}: {exc}") from None
        defaults[action.dest] = getattr(parsed, action.dest)
    return defaults
