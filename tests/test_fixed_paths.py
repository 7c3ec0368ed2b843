"""`FixedPath`: a table of an object's fixed file names reads like properties."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from stalwart.fixed_paths import FixedPath


@dataclasses.dataclass(frozen=True)
class _Frozen:
    root: Path
    manifest = FixedPath("root", "run.json")


class _Plain:
    stamp = FixedPath("directory", "inductor", "stamp")

    def __init__(self, directory: Path) -> None:
        self.directory = directory


def test_the_path_follows_the_root_of_each_instance(tmp_path: Path) -> None:
    plain = _Plain(tmp_path / "a")
    assert plain.stamp == tmp_path / "a" / "inductor" / "stamp"
    plain.directory = tmp_path / "b"
    assert plain.stamp == tmp_path / "b" / "inductor" / "stamp"
    assert _Frozen(tmp_path).manifest == tmp_path / "run.json"


def test_it_is_not_a_dataclass_field_and_cannot_be_set(tmp_path: Path) -> None:
    assert [f.name for f in dataclasses.fields(_Frozen)] == ["root"]
    assert _Frozen(tmp_path) == _Frozen(tmp_path)
    plain = _Plain(tmp_path)
    with pytest.raises(AttributeError, match="'directory' is fixed"):
        plain.stamp = tmp_path
    assert plain.stamp == tmp_path / "inductor" / "stamp"
    assert isinstance(_Plain.stamp, FixedPath)
