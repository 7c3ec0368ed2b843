"""The flag-kind helpers of `stalwart.cli.arg_types`: what each one makes a parser accept."""

from __future__ import annotations

import argparse
import enum

import pytest

from stalwart.cli.arg_types import OneOf, negated, switch, values


class _Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(exit_on_error=False)
    switch(p, "--fast", "go fast")
    negated(p, "--no-check-for-nan", "do not check")
    values(
        p,
        ("--colour", OneOf(_Colour, "NAME"), _Colour.BLUE, "a colour"),
        ("--mode", OneOf(("a", "b"), "MODE"), None, "a mode"),
        ("--lr", float, 0.5, "rate"),
        ("--steps", int, None, "steps"),
    )
    return p


def test_defaults() -> None:
    ns = _parser().parse_args([])
    assert vars(ns) == {
        "fast": False,
        "check_for_nan": True,
        "colour": "blue",
        "mode": None,
        "lr": 0.5,
        "steps": None,
    }


def test_given() -> None:
    argv = ["--fast", "--no-check-for-nan", "--colour", "red", "--mode", "b", "--steps", "3"]
    ns = _parser().parse_args(argv)
    assert (ns.fast, ns.check_for_nan, ns.colour, ns.mode, ns.steps) == (True, False, "red", "b", 3)


def test_an_enum_choice_takes_only_the_enum_values() -> None:
    with pytest.raises(argparse.ArgumentError, match="invalid choice: 'RED'"):
        _parser().parse_args(["--colour", "RED"])


def test_a_one_of_row_shows_its_metavar_and_refuses_other_words() -> None:
    p = _parser()
    mode = next(a for a in p._actions if a.dest == "mode")
    assert (mode.metavar, mode.choices, mode.type) == ("MODE", ("a", "b"), None)
    with pytest.raises(argparse.ArgumentError, match="invalid choice: 'c'"):
        p.parse_args(["--mode", "c"])
