"""docs/config-reference.md is what `stalwart.cli.config_reference` generates now, and the
config field it names for each flag is the one the flag sets."""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing
from pathlib import Path
from typing import Any

import pytest

from stalwart.cli import config_reference
from stalwart.cli.args import build_train_parser, parse_train_args
from stalwart.config.run import RunConfig, build_run_config
from stalwart.loop import Names

PAGE = Path(__file__).resolve().parents[2] / "docs" / "config-reference.md"


def test_the_committed_page_is_the_generated_one() -> None:
    generated = config_reference.render()
    assert PAGE.read_text() == generated, (
        "docs/config-reference.md is out of date; regenerate it: " + config_reference.COMMAND
    )


def test_every_shell_setting_with_a_flag_is_named_for_that_flag() -> None:
    """`Names.CLI` (what refusals print) and the page agree on which flag sets which field."""
    settings = config_reference.flag_settings()
    flags = {
        o: a.option_strings[0] for a in build_train_parser()._actions for o in a.option_strings
    }
    checked = 0
    for path in config_reference.shell_paths():
        flag = Names.CLI.spell(path)
        if flag.startswith("--"):
            assert f"`ShellConfig.{path}`" in settings[flags[flag]], (path, flag)
            checked += 1
    assert checked > 60


def _class_paths() -> dict[str, str]:
    """``GPTConfig`` -> ``model``, ``ShellConfig`` -> ``shell``, ...: where each class sits."""
    hints = typing.get_type_hints(RunConfig)
    out = {"RunConfig": ""}
    for f in dataclasses.fields(RunConfig):
        if dataclasses.is_dataclass(hints[f.name]):
            out[hints[f.name].__name__] = f.name
    return out


def _read(config: RunConfig, name: str) -> Any:
    cls, _, path = name.partition(".")
    value: Any = config
    for part in [p for p in (_class_paths()[cls], *path.split(".")) if p]:
        value = getattr(value, part)
    return value


def _probe(action: argparse.Action) -> tuple[list[str], Any] | None:
    """The flag given with a value unlike its default, and the value the field should hold."""
    flag = action.option_strings[0]
    if type(action) is argparse._StoreTrueAction:
        return [flag], True
    if type(action) is argparse._StoreFalseAction:
        return [flag], False
    if action.type is int and action.nargs is None and isinstance(action.default, int):
        return [flag, str(action.default + 1)], action.default + 1
    return None


def test_flags_set_the_field_the_page_names(tmp_path: Path) -> None:
    """Every switch and integer flag, given alone (with ``--save``), ends in the field(s) the
    page names; a flag whose value another flag must accompany is skipped (refused alone)."""
    settings = config_reference.flag_settings()
    checked, wrong = 0, []
    for action in build_train_parser()._actions:
        setting = settings.get(action.option_strings[0] if action.option_strings else "", "")
        names = re.findall(r"`([A-Z]\w+Config\.[\w.]+)`", setting)
        probe = _probe(action)
        if not names or probe is None or "(negated)" in setting:
            continue
        argv, expected = [*probe[0], "--save", str(tmp_path / "run")], probe[1]
        try:
            config = build_run_config(parse_train_args(argv, raise_errors=True), argv)
        except ValueError:
            continue  # needs another flag (e.g. --num-experts), refused in one line
        checked += 1
        wrong += [(argv, n, _read(config, n)) for n in names if _read(config, n) != expected]
    assert not wrong, wrong
    assert checked > 40, checked


@pytest.mark.parametrize("argv", [[], ["-o", "PAGE"]])
def test_the_command_prints_or_writes_the_page(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "page.md"
    assert config_reference.main([str(out) if a == "PAGE" else a for a in argv]) == 0
    text = out.read_text() if argv else capsys.readouterr().out
    assert text == PAGE.read_text()
