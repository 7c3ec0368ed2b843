"""Help output of the ``stalwart`` commands: every flag with its default and its choices.

`FlagHelpFormatter` is argparse's formatter with three changes, so that a flag's help is one
sentence and the rest is derived from the parser instead of written (and kept true) by hand:

* the default is appended to every flag's help that takes a value: ``(default: 100)``,
  ``unset`` for ``None``, unless the help already says ``(default: ...)`` in words; switches
  are off unless given (the description says so), ``--x/--no-x`` switches show ``on``/``off``;
* choices are appended when the flag has a short metavar (``--preset NAME``) instead of the
  ``{a,b,c}`` one that argparse would print;
* numeric flags get short metavars (``N`` for integers, ``X`` for other numbers), so the help
  starts in the same column on most lines.

Descriptions and epilogs are wrapped by paragraph; a paragraph with indented lines keeps its
line breaks (the example commands of ``stalwart train``, the command list of ``stalwart``).
"""

from __future__ import annotations

import argparse
import shutil
import textwrap
from typing import Any

from stalwart.cli.arg_types import Float, Int

# argparse >= 3.9 appends this to a BooleanOptionalAction's help; the formatter writes its own.
_BOOLEAN_OPTIONAL_SUFFIX = " (default: %(default)s)"
MAX_WIDTH = 100


def describe_default(action: argparse.Action) -> str:
    """The default of ``action`` as a user reads it (``on``/``off`` for switches)."""
    default = action.default
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        return "off" if is_plain_switch(action) else "unset"
    if isinstance(default, bool):
        return "on" if default else "off"
    if default is None:
        return "unset"
    if isinstance(default, list | tuple):
        return " ".join(str(v) for v in default) if default else "none"
    return str(default)


def is_plain_switch(action: argparse.Action) -> bool:
    """A ``store_true``/``store_false`` flag that is off unless given (no default to show)."""
    if type(action) is argparse._StoreTrueAction:
        return action.default is False
    return type(action) is argparse._StoreFalseAction and action.default is True


def _escape(text: str) -> str:
    return text.replace("%", "%%")  # argparse %-formats help strings


class FlagHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """One line of help per flag (wrapped to the terminal), with default and choices."""

    def __init__(
        self,
        prog: str,
        indent_increment: int = 2,
        max_help_position: int = 32,
        width: int | None = None,
    ) -> None:
        if width is None:
            width = min(shutil.get_terminal_size((MAX_WIDTH, 24)).columns, MAX_WIDTH) - 2
        super().__init__(prog, indent_increment, max_help_position, width)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = (action.help or "").replace(_BOOLEAN_OPTIONAL_SUFFIX, "")
        if not action.option_strings or isinstance(
            action, argparse._HelpAction | argparse._VersionAction
        ):
            return text
        choices = ""
        if action.choices is not None and action.metavar is not None:
            choices = _escape("choices: " + ", ".join(str(c) for c in action.choices))
        if "(default" in text:  # the default in words: the choices go in the same parentheses
            return text.replace("(default", f"({choices}; default", 1) if choices else text
        extra = [choices] if choices else []
        if not is_plain_switch(action) and not action.required:
            extra.append(_escape("default: " + describe_default(action)))
        return f"{text} ({'; '.join(extra)})" if extra else text

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        """Paragraphs are wrapped; a paragraph with indented lines (examples) is kept as is."""
        paragraphs = text.split("\n\n")
        out = [
            p
            if any(line.startswith(" ") for line in p.splitlines())
            else textwrap.fill(
                " ".join(p.split()), width, initial_indent=indent, subsequent_indent=indent
            )
            for p in paragraphs
        ]
        return "\n\n".join(out)

    def _get_default_metavar_for_optional(self, action: argparse.Action) -> str:
        kind: Any = action.type
        if kind is int or isinstance(kind, Int) or getattr(kind, "__name__", "") == "int":
            return "N"
        if kind is float or isinstance(kind, Float):
            return "X"
        return action.dest.upper()
