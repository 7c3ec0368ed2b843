"""Checked argparse value types (every number a flag takes is finite and inside a sane range),
and one helper per kind of flag the ``stalwart`` parsers declare.

`OneLineErrorParser` registers `Int` and `Float` as the meaning of ``type=int`` and ``type=float``,
so every numeric flag (also flags added later, and values that come from a ``--config`` TOML file,
which are parsed by the same parser) gets these checks without naming them:

* ``type=float``: a finite number (``nan``, ``inf``, ``1e999`` are refused);
* ``type=int``: a base-10 integer in ``[0, 2**53]`` (``1e9``, ``1.5``, ``-1`` and 20-digit numbers
  are refused; every integer flag of ``stalwart train`` is a count, a size, an interval, an
  iteration or a rank, and 2**53 is the largest integer a float holds exactly).

Flags with a tighter range pass their own instance, e.g. ``type=Float(gt=0)``. A refused value
reads ``argument --lr: must be a finite number > 0, got 'inf'``: argparse adds the flag name.
Semantic ranges that depend on other flags stay in the configs' ``__post_init__``.

The kinds of flag: `switch` (off unless given), `negated` (``--no-x``: on unless given) and
`values` (rows of ``(flag, kind, default, help)``, where the kind is a type, or `OneOf` a few
words shown with a short metavar), so that a parser's flags read as a table and each kind is
declared one way.
"""

from __future__ import annotations

import argparse
import enum
import math
from collections.abc import Iterable
from typing import Any

from stalwart.config.checks import INT_MAX


def _describe(lower: str | None, upper: str | None) -> str:
    parts = [p for p in (lower, upper) if p]
    return " and ".join(parts)


class Int:
    """``type=`` for integer flags: base-10 digits only, ``minimum <= value <= maximum``."""

    __name__ = "int"  # argparse's "invalid <type> value" fallback reads it

    def __init__(self, minimum: int = 0, maximum: int = INT_MAX) -> None:
        self.minimum, self.maximum = minimum, maximum

    def __call__(self, text: str) -> int:
        allowed = (
            f"an integer >= {self.minimum}"
            if self.maximum == INT_MAX
            else f"an integer in [{self.minimum}, {self.maximum}]"
        )
        try:
            value = int(text.strip(), 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {allowed}, got {text!r}") from None
        if not self.minimum <= value <= self.maximum:
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}")
        return value

    def __repr__(self) -> str:
        return f"Int({self.minimum}, {self.maximum})"


class Float:
    """``type=`` for float flags: finite, and inside the given open/closed bounds."""

    __name__ = "float"

    def __init__(
        self,
        *,
        gt: float | None = None,
        ge: float | None = None,
        le: float | None = None,
    ) -> None:
        self.gt, self.ge, self.le = gt, ge, le

    @property
    def allowed(self) -> str:
        lower = f"> {self.gt:g}" if self.gt is not None else None
        lower = f">= {self.ge:g}" if self.ge is not None else lower
        upper = f"<= {self.le:g}" if self.le is not None else None
        bounds = _describe(lower, upper)
        return f"a finite number {bounds}" if bounds else "a finite number"

    def __call__(self, text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {self.allowed}, got {text!r}") from None
        ok = math.isfinite(value)
        ok = ok and (self.gt is None or value > self.gt) and (self.ge is None or value >= self.ge)
        ok = ok and (self.le is None or value <= self.le)
        if not ok:
            raise argparse.ArgumentTypeError(f"must be {self.allowed}, got {text!r}")
        return value

    def __repr__(self) -> str:
        return f"Float({self.allowed})"


def register_checked_types(parser: argparse.ArgumentParser) -> None:
    """Make ``type=int`` / ``type=float`` of ``parser`` (and its groups) mean `Int()` /
    `Float()`."""
    parser.register("type", int, Int())
    parser.register("type", float, Float())


class LogLevel:
    """``type=`` for ``--logging-level``: Megatron's integer (10 DEBUG ... 50 CRITICAL, any
    value in [0, 50]) or a level's name (``info``, ``WARNING``)."""

    __name__ = "log level"
    NAMES = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}

    def __call__(self, text: str) -> int:
        name = text.strip().lower()
        if name in self.NAMES:
            return self.NAMES[name]
        try:
            return Int(0, 50)(text)
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(
                f"expected an integer in [0, 50] or one of {', '.join(self.NAMES)}, got {text!r}"
            ) from None

    def __repr__(self) -> str:
        return "LogLevel()"


def switch(g: Any, flag: str, help: str) -> None:
    """A flag that is off unless given (``store_true``)."""
    g.add_argument(flag, action="store_true", help=help)


def negated(g: Any, flag: str, help: str) -> None:
    """``--no-x``: the setting ``x`` is on unless this flag is given (``store_false`` into
    ``x``)."""
    dest = flag.removeprefix("--no-").replace("-", "_")
    g.add_argument(flag, dest=dest, action="store_false", help=help)


class OneOf:
    """The kind of a `values` row whose flag takes one of ``choices``: ``flag METAVAR`` (the help
    lists the choices). ``choices`` may be an Enum class (the flag takes its values; a member as
    the row's default stands for its value), so that the flag offers exactly what the config's
    enum accepts."""

    def __init__(self, choices: Iterable[Any], metavar: str) -> None:
        if isinstance(choices, type) and issubclass(choices, enum.Enum):
            choices = [member.value for member in choices]
        self.choices, self.metavar = tuple(choices), metavar


def values(g: Any, *rows: tuple[str, Any, Any, str]) -> None:
    """One value flag per ``(flag, kind, default, help)`` row, ``kind`` a type or a `OneOf`; a
    None default reads "unset"."""
    for flag, kind, default, text in rows:
        if not isinstance(kind, OneOf):
            g.add_argument(flag, type=kind, default=default, help=text)
            continue
        default = default.value if isinstance(default, enum.Enum) else default
        g.add_argument(flag, default=default, choices=kind.choices, metavar=kind.metavar, help=text)
