"""Every path names a shell setting its own way (``stalwart.loop.Names``): the CLI's spelling of
each ``ShellConfig`` field is a flag of ``stalwart train`` (or, for a field with no flag, its
config's field), the others the config or callback keyword the user wrote."""

from __future__ import annotations

import dataclasses
import re
import typing

import pytest

from stalwart.cli.args import build_train_parser
from stalwart.loop import Names, ShellConfig


def _paths() -> list[str]:
    config = ShellConfig(train_iters=1)
    out: list[str] = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            out += [f"{f.name}.{g.name}" for g in dataclasses.fields(value)]
        else:
            out.append(f.name)
    return out


def test_every_cli_spelling_is_a_flag_or_the_fields_own_name() -> None:
    flags = {o for a in build_train_parser()._actions for o in a.option_strings}
    wrong = []
    for path in _paths():
        spelled = Names.CLI.spell(path)
        if spelled.startswith("--"):
            if spelled not in flags:
                wrong.append((path, spelled))
        elif not re.fullmatch(r"[A-Z][A-Za-z]+Config\.[a-z_]+", spelled):
            wrong.append((path, spelled))
    assert not wrong, wrong


@pytest.mark.parametrize("names", [Names.LOOP, Names.LIGHTNING, Names.HF])
def test_outside_the_cli_no_setting_is_spelled_as_a_flag(names: Names) -> None:
    spelled = {path: names.spell(path) for path in _paths()}
    assert not [s for s in spelled.values() if "--" in s], spelled
    assert spelled["exit.save_interval"] in (
        "ShellConfig.exit.save_interval",
        "StalwartCallback(exit=ExitConfig(save_interval=...))",
    )


def test_the_docstring_examples_run() -> None:
    import doctest

    from stalwart.loop import iterations, naming

    for module in (naming, iterations):
        failed, tried = doctest.testmod(module)
        assert tried and not failed, module.__name__


def test_the_section_classes_are_shell_configs() -> None:
    """naming's table of ``ShellConfig.<section>`` classes is the config's own (naming cannot
    read it off ShellConfig: shell_config imports naming)."""
    from stalwart.loop import naming

    hints = typing.get_type_hints(ShellConfig)
    sections = {
        f.name: hints[f.name].__name__
        for f in dataclasses.fields(ShellConfig)
        if dataclasses.is_dataclass(hints[f.name])
    }
    assert dict(naming.SECTION_CLASSES) == sections
