"""Symbolic links planted under ``--save``: clean-up and retention never delete through one
(issue 29, item 1). The planted links point at another run's checkpoint, whose files survive."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from ckpt_fixtures import make_model, make_optimizer, train_steps

from stalwart.checkpoint import CheckpointError, CheckpointManager, layout


def _other_run(tmp_path: Path) -> Path:
    """Another run's save directory with a complete checkpoint of iteration 1."""
    other = tmp_path / "other"
    model = make_model()
    opt = make_optimizer(model)
    train_steps(model, opt, 1)
    manager = CheckpointManager(str(other))
    manager.save(1, model, opt, {"run": "other"}, {})
    manager.close()
    return other / layout.iteration_dir_name(1)


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_retention_and_leftovers_never_delete_through_a_link(tmp_path: Path, caplog) -> None:
    target = _other_run(tmp_path)
    before = _files(target)
    save = tmp_path / "save"
    save.mkdir()
    (save / layout.iteration_dir_name(1)).symlink_to(target)  # looks like our oldest checkpoint
    (save / layout.tmp_dir_name(4, "crashed")).symlink_to(target)  # looks like a crashed save
    model = make_model()
    opt = make_optimizer(model)
    manager = CheckpointManager(str(save), keep_last=1)
    manager.check_writable()
    with caplog.at_level(logging.WARNING, logger="stalwart.checkpoint"):
        for iteration in (2, 3):
            train_steps(model, opt, 1)
            manager.save(iteration, model, opt, {}, {})
    manager.close()
    assert _files(target) == before  # COMPLETE, shards, state files: all still there, unchanged
    assert (save / layout.iteration_dir_name(1)).is_symlink()  # the links are left alone too
    assert (save / layout.tmp_dir_name(4, "crashed")).is_symlink()
    assert layout.list_complete_checkpoints(str(save)) == [1, 3]  # retention removed ours only
    warnings = [r.getMessage() for r in caplog.records if "symbolic link" in r.getMessage()]
    assert warnings and all(str(target) not in w for w in warnings)  # names the link only


@pytest.mark.parametrize("planted", ["tracker", "non_persistent"])
def test_a_linked_tracker_or_non_persistent_dir_is_refused(tmp_path: Path, planted: str) -> None:
    target = _other_run(tmp_path)
    tracker = target.parent / layout.TRACKER_FILENAME
    save = tmp_path / "save"
    save.mkdir()
    if planted == "tracker":
        (save / layout.TRACKER_FILENAME).symlink_to(tracker)
    else:
        (save / layout.NON_PERSISTENT_SUBDIR).symlink_to(target.parent)
    before = tracker.read_bytes(), _files(target)
    manager = CheckpointManager(str(save))
    with pytest.raises(ValueError, match="is a symbolic link") as refused:
        manager.check_writable()
    assert "\n" not in str(refused.value) and "1\n" not in str(refused.value)
    manager.close()
    model = make_model()
    opt = make_optimizer(model)
    unchecked = CheckpointManager(str(save))  # a loop that skips check_writable
    with pytest.raises(CheckpointError, match="is a symbolic link"):
        unchecked.save(1, model, opt, {}, {}, non_persistent=planted == "non_persistent")
    unchecked.close()
    assert (tracker.read_bytes(), _files(target)) == before


def test_remove_own_tree_leaves_links_alone(tmp_path: Path) -> None:
    from stalwart.regular_file import remove_own_tree

    target = tmp_path / "target"
    target.mkdir()
    (target / "COMPLETE").write_text("x")
    link = tmp_path / "link"
    link.symlink_to(target)
    assert "symbolic link" in (remove_own_tree(str(link), first="COMPLETE") or "")
    assert (target / "COMPLETE").exists() and link.is_symlink()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "COMPLETE").symlink_to(target / "COMPLETE")  # a link inside: removed as a link
    (mine / "sub").symlink_to(target)
    assert remove_own_tree(str(mine), first="COMPLETE") is None
    assert not os.path.lexists(mine) and (target / "COMPLETE").exists()
