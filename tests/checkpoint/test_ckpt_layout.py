from __future__ import annotations

import os

import pytest

from stalwart.checkpoint import (
    TRACKER_FILENAME,
    CheckpointError,
    iteration_dir_name,
    layout,
    list_complete_checkpoints,
    read_tracker,
    write_tracker_atomic,
)


def test_iteration_dir_name_is_megatron_padded() -> None:
    assert iteration_dir_name(10) == "iter_0000010"
    assert iteration_dir_name(0) == "iter_0000000"
    assert iteration_dir_name(123456789) == "iter_123456789"
    assert layout.parse_iteration_dir_name("iter_0000010") == 10
    assert layout.parse_iteration_dir_name("iter_0000010.tmp-x") is None
    with pytest.raises(ValueError):
        iteration_dir_name(-1)


def test_tracker_is_exactly_the_integer_and_newline(tmp_path) -> None:
    assert read_tracker(str(tmp_path)) is None
    write_tracker_atomic(str(tmp_path), 10)
    with open(tmp_path / TRACKER_FILENAME, "rb") as f:
        assert f.read() == b"10\n"
    assert read_tracker(str(tmp_path)) == 10
    write_tracker_atomic(str(tmp_path), 20)
    assert read_tracker(str(tmp_path)) == 20
    assert sorted(os.listdir(tmp_path)) == [TRACKER_FILENAME]  # no tmp file left behind


@pytest.mark.parametrize("content", ["", "abc\n", "release\n", "-3\n", "1.5"])
def test_tracker_garbage_is_a_clear_error(tmp_path, content: str) -> None:
    (tmp_path / TRACKER_FILENAME).write_text(content)
    with pytest.raises(CheckpointError, match=TRACKER_FILENAME):
        read_tracker(str(tmp_path))


def test_list_complete_checkpoints_ignores_partial_and_tmp(tmp_path) -> None:
    assert list_complete_checkpoints(str(tmp_path / "missing")) == []
    for it in (3, 1, 20):
        d = tmp_path / iteration_dir_name(it)
        d.mkdir()
        layout.write_marker(str(d), {"iteration": it})
    (tmp_path / iteration_dir_name(30)).mkdir()  # no marker: incomplete
    tmp = tmp_path / layout.tmp_dir_name(40, "tok")
    tmp.mkdir()
    layout.write_marker(str(tmp), {})
    assert list_complete_checkpoints(str(tmp_path)) == [1, 3, 20]
    assert layout.list_tmp_dirs(str(tmp_path)) == [str(tmp)]


def test_select_for_deletion_keeps_newest_and_protected() -> None:
    assert layout.select_for_deletion([1, 2, 3, 4], 2, protected=4) == [1, 2]
    assert layout.select_for_deletion([1, 2, 3, 4], 2, protected=1) == [2]
    assert layout.select_for_deletion([5], 3, protected=None) == []
    with pytest.raises(ValueError, match="--ckpt-keep-last"):
        layout.select_for_deletion([1], 0, protected=None)
