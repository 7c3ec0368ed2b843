from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

import pytest
import torch
from ckpt_fixtures import assert_same, make_model, make_optimizer, snapshot, train_steps

from stalwart.checkpoint import (
    CheckpointError,
    CheckpointManager,
    iteration_dir_name,
    layout,
    read_tracker,
)


def _save(mgr: CheckpointManager, it: int, model, opt, **kw) -> None:
    mgr.save(
        it, model, opt, {"iteration": it, "consumed": 4 * it}, {"rng": torch.get_rng_state()}, **kw
    )


def _fresh():
    model = make_model(seed=123)  # different init than the saved one
    return model, make_optimizer(model)


def test_roundtrip_single_process(tmp_path) -> None:
    model = make_model()
    opt = make_optimizer(model)
    train_steps(model, opt, 2)
    mgr = CheckpointManager(str(tmp_path))
    mgr.check_writable()
    common = {"iteration": 5, "consumed_samples": 40, "sched": {"lr": 0.5}, "cfg": {"a": [1, 2]}}
    per_rank: dict[str, Any] = {"rng": torch.get_rng_state(), "data": {"pos": 7}}
    mgr.save(5, model, opt, common, per_rank)
    expected = snapshot(model, opt)

    assert (tmp_path / "latest_checkpointed_iteration.txt").read_bytes() == b"5\n"
    ckpt_dir = tmp_path / "iter_0000005"
    meta = json.loads((ckpt_dir / "metadata.json").read_text())
    assert meta["iteration"] == 5 and meta["world_size"] == 1 and meta["torch_version"]
    assert (ckpt_dir / "common.json").is_file() and (ckpt_dir / "rank_00000.json").is_file()
    assert mgr.latest_iteration() == 5

    model2, opt2 = _fresh()
    loaded = CheckpointManager(None, str(tmp_path)).load(model2, opt2)
    assert loaded is not None
    assert (loaded.iteration, loaded.path, loaded.saved_world_size) == (5, str(ckpt_dir), 1)
    assert loaded.common == common
    assert loaded.per_rank is not None and torch.equal(loaded.per_rank["rng"], per_rank["rng"])
    assert loaded.per_rank["data"] == {"pos": 7}
    assert_same(expected, snapshot(model2, opt2))
    # The optimizer keeps working after the load (state is attached to the right params).
    train_steps(model2, opt2, 1, seed=9)
    train_steps(model, opt, 1, seed=9)
    assert_same(snapshot(model, opt), snapshot(model2, opt2))


def test_load_without_checkpoint_and_no_load_optim(tmp_path) -> None:
    model, opt = _fresh()
    assert CheckpointManager(str(tmp_path)).load(model, opt) is None
    src = make_model()
    src_opt = make_optimizer(src)
    train_steps(src, src_opt, 2)
    _save(CheckpointManager(str(tmp_path)), 3, src, src_opt)
    loaded = CheckpointManager(str(tmp_path)).load(model, opt, load_optim=False)
    assert loaded is not None and loaded.iteration == 3
    assert_same(snapshot(src), snapshot(model))
    assert len(opt.state) == 0  # --no-load-optim: optimizer untouched


def _two_checkpoints(tmp_path):
    model = make_model()
    opt = make_optimizer(model)
    train_steps(model, opt, 2)
    mgr = CheckpointManager(str(tmp_path))
    _save(mgr, 1, model, opt)
    first = snapshot(model, opt)
    train_steps(model, opt, 1, seed=2)
    _save(mgr, 2, model, opt)
    return first, tmp_path / iteration_dir_name(2)


def _truncate_shard(path) -> None:
    shard = next(p for p in path.iterdir() if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:10])


@pytest.mark.parametrize("damage", ["truncate", "marker", "common", "dir"])
def test_corrupt_newest_raises_or_falls_back(tmp_path, damage: str) -> None:
    first, newest = _two_checkpoints(tmp_path)
    if damage == "truncate":
        _truncate_shard(newest)
    elif damage == "marker":
        (newest / layout.COMPLETE_MARKER).unlink()
    elif damage == "common":
        (newest / layout.COMMON_FILENAME).write_bytes(b"garbage")
    else:
        layout.remove_checkpoint_dir(str(newest), logging.getLogger())
    model, opt = _fresh()
    with pytest.raises(CheckpointError, match="iter_0000002"):
        CheckpointManager(str(tmp_path)).load(model, opt)
    model, opt = _fresh()
    loaded = CheckpointManager(str(tmp_path), fallback=True).load(model, opt)
    assert loaded is not None and loaded.iteration == 1
    assert_same(first, snapshot(model, opt))
    with pytest.raises(CheckpointError, match="iter_0000002"):
        CheckpointManager(str(tmp_path), fallback=True).load(model, opt, iteration=2)


def test_retention_keeps_last_n_and_removes_stale_tmp(tmp_path) -> None:
    model = make_model()
    opt = make_optimizer(model)
    train_steps(model, opt, 1)
    mgr = CheckpointManager(str(tmp_path), keep_last=2)
    stale = tmp_path / layout.tmp_dir_name(99, "crashed")
    stale.mkdir()
    for it in (1, 2, 3, 4):
        _save(mgr, it, model, opt)
    assert layout.list_complete_checkpoints(str(tmp_path)) == [3, 4]
    assert not stale.exists()
    assert sorted(os.listdir(tmp_path)) == [
        ".stalwart.lock",  # held by this manager until close()
        "iter_0000003",
        "iter_0000004",
        "latest_checkpointed_iteration.txt",
    ]
    _save(mgr, 4, model, opt)  # re-saving an iteration replaces it
    assert layout.list_complete_checkpoints(str(tmp_path)) == [3, 4]
    mgr.close()
    assert not (tmp_path / ".stalwart.lock").exists()
    with pytest.raises(ValueError, match="--ckpt-keep-last"):
        CheckpointManager(str(tmp_path), keep_last=0)


def test_not_writable_save_dir_is_a_clear_error(tmp_path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("x")  # a directory below a regular file can never be created (even as root)
    mgr = CheckpointManager(str(blocker / "ckpt"))
    with pytest.raises(ValueError, match="--save"):
        mgr.check_writable()
    with pytest.raises(ValueError, match="--save"):
        CheckpointManager(None).save(1, make_model(), None, {}, {})


def test_async_save_commits_only_at_finalize(tmp_path) -> None:
    model = make_model()
    opt = make_optimizer(model)
    train_steps(model, opt, 2)
    mgr = CheckpointManager(str(tmp_path), async_save=True)
    _save(mgr, 3, model, opt)
    expected = snapshot(model, opt)
    assert read_tracker(str(tmp_path)) is None  # not committed yet
    train_steps(model, opt, 1, seed=5)  # mutate params while the write may still run
    committed = None
    for _ in range(500):
        committed = mgr.maybe_finalize()
        if committed is not None:
            break
        time.sleep(0.01)
    assert committed == 3
    assert read_tracker(str(tmp_path)) == 3
    assert mgr.maybe_finalize() is None
    _save(mgr, 4, model, opt)
    expected4 = snapshot(model, opt)
    mgr.close()  # finalizes the in-flight save
    assert read_tracker(str(tmp_path)) == 4
    model2, opt2 = _fresh()
    loaded = CheckpointManager(str(tmp_path)).load(model2, opt2, iteration=3)
    assert loaded is not None and loaded.common["consumed"] == 12
    assert_same(expected, snapshot(model2, opt2))
    CheckpointManager(str(tmp_path)).load(model2, opt2)
    assert_same(expected4, snapshot(model2, opt2))


def test_close_abort_discards_in_flight_save(tmp_path) -> None:
    model = make_model()
    mgr = CheckpointManager(str(tmp_path), async_save=True)
    _save(mgr, 1, model, None)
    mgr.finalize()
    _save(mgr, 2, model, None)
    mgr.close(abort=True)
    assert read_tracker(str(tmp_path)) == 1
    with pytest.raises(CheckpointError, match="close"):
        _save(mgr, 3, model, None)


def test_non_persistent_newer_than_persistent_is_picked(tmp_path) -> None:
    save, np_dir = tmp_path / "save", tmp_path / "np"
    model = make_model()
    opt = make_optimizer(model)
    train_steps(model, opt, 1)
    mgr = CheckpointManager(str(save), non_persistent_dir=str(np_dir), keep_last=5)
    _save(mgr, 2, model, opt)
    for it in (3, 4):
        train_steps(model, opt, 1, seed=it)
        _save(mgr, it, model, opt, non_persistent=True)
    expected = snapshot(model, opt)
    assert read_tracker(str(save)) == 2 and read_tracker(str(np_dir)) == 4
    assert layout.list_complete_checkpoints(str(np_dir)) == [4]  # only the newest is kept
    assert layout.list_complete_checkpoints(str(save)) == [2]
    assert mgr.latest_iteration() == 4
    model2, opt2 = _fresh()
    loaded = CheckpointManager(str(save), non_persistent_dir=str(np_dir)).load(model2, opt2)
    assert loaded is not None and loaded.iteration == 4 and loaded.non_persistent
    assert_same(expected, snapshot(model2, opt2))
    # A newer persistent save wins again; default non-persistent dir lives under --save.
    _save(mgr, 5, model, opt)
    assert mgr.latest_iteration() == 5
    default_np = CheckpointManager(str(save))
    _save(default_np, 6, model, opt, non_persistent=True)
    assert read_tracker(str(save / "non_persistent")) == 6
    assert read_tracker(str(save)) == 5
