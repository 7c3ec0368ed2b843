"""Local copies (``--non-persistent-ckpt-type local``) in one process, attacked: a truncated
shard, garbage metadata, a planted pickle (with a manifest and marker to match), symbolic links
and a second job on the same directory. Each bad copy is passed over with one warning and the
resume takes the newest complete copy left (here the persistent checkpoint); nothing read from a
local directory runs code, and nothing is written or deleted through a link."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_fixtures import assert_same, make_model, make_optimizer, snapshot, train_steps

from stalwart.checkpoint import CheckpointManager, integrity, layout
from stalwart.checkpoint.local import LocalCheckpoints
from stalwart.checkpoint.lock import LOCK_FILENAME, _process_identity

from hostile import hostile_pickle
from train_utils import TINY_FLAGS, run_cli

SHARD = Path("rank_00000") / "iter_0000004" / "shard_00000"


def _manager(root: Path) -> CheckpointManager:
    copies = LocalCheckpoints(str(root / "local"))
    manager = CheckpointManager(str(root / "save"), copies=copies)
    manager.check_writable()
    return manager


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """A persistent checkpoint of iteration 2 and a local copy of iteration 4; the states."""
    model, optimizer = make_model(), None
    optimizer = make_optimizer(model)
    manager = _manager(tmp_path)
    train_steps(model, optimizer, 2)
    manager.save(2, model, optimizer, {"it": 2}, {"rng": torch.arange(3)})
    at_2 = snapshot(model, optimizer)
    train_steps(model, optimizer, 2, seed=2)
    manager.save(4, model, optimizer, {"it": 4}, {"rng": torch.arange(4)}, non_persistent=True)
    manager.close()
    assert (tmp_path / "local" / SHARD / "shard.bin").is_file()
    return tmp_path, at_2, snapshot(model, optimizer)


def _resume(root: Path) -> tuple[Any, dict[str, Any]]:
    model = make_model(seed=9)
    optimizer = make_optimizer(model)
    train_steps(model, optimizer, 1, seed=9)  # state to be overwritten
    manager = _manager(root)
    try:
        loaded = manager.load(model, optimizer)
    finally:
        manager.close()
    return loaded, snapshot(model, optimizer)


def _resumes_from_persistent(root: Path, at_2: dict[str, Any], caplog, why: str) -> None:
    with caplog.at_level(logging.WARNING, logger="stalwart.checkpoint"):
        loaded, state = _resume(root)
    assert loaded.iteration == 2 and loaded.source is None and loaded.common == {"it": 2}
    assert_same(state, at_2)
    assert why in caplog.text, caplog.text


def _forge(shard: Path, payload: bytes) -> None:
    """An attacker who can write the directory rewrites the shard, its manifest and marker."""
    (shard / "shard.bin").write_bytes(payload)
    facts = json.loads((shard / layout.METADATA_FILENAME).read_text())
    integrity.write_manifest(str(shard))
    layout.write_marker(str(shard), facts, integrity.manifest_crc(str(shard)))


def test_the_local_copy_is_loaded_when_it_is_the_newest(saved) -> None:
    root, _, at_4 = saved
    loaded, state = _resume(root)
    assert loaded.iteration == 4 and loaded.source == "the local copy of iteration 4"
    assert loaded.non_persistent and loaded.common == {"it": 4}
    assert torch.equal(loaded.per_rank["rng"], torch.arange(4))
    assert_same(state, at_4)


def test_a_truncated_shard_is_passed_over(saved, caplog) -> None:
    root, at_2, _ = saved
    shard = root / "local" / SHARD / "shard.bin"
    shard.write_bytes(shard.read_bytes()[:100])
    _resumes_from_persistent(root, at_2, caplog, "shard.bin has 100 bytes")


def test_garbage_metadata_is_passed_over(saved, caplog) -> None:
    root, at_2, _ = saved
    (root / "local" / SHARD / layout.METADATA_FILENAME).write_bytes(b"\x00\xff{not json")
    _resumes_from_persistent(root, at_2, caplog, "unusable")


def test_a_planted_pickle_never_runs(saved, caplog) -> None:
    root, at_2, _ = saved
    marker = root / "pwned"
    _forge(root / "local" / SHARD, hostile_pickle(marker))
    _resumes_from_persistent(root, at_2, caplog, "not a stalwart shard")
    assert not marker.exists()


def test_a_flipped_byte_with_a_forged_manifest_is_caught_by_the_header(saved, caplog) -> None:
    """The manifest is no defence against a writer who forges it: the shard's own checks are."""
    root, at_2, _ = saved
    shard = root / "local" / SHARD
    raw = bytearray((shard / "shard.bin").read_bytes())
    raw[8:16] = (1 << 40).to_bytes(8, "little")  # a header length past the end
    _forge(shard, bytes(raw))
    _resumes_from_persistent(root, at_2, caplog, "past the end of the shard")


def test_a_symlinked_shard_is_never_followed(saved, tmp_path_factory, caplog) -> None:
    root, at_2, _ = saved
    shard = root / "local" / SHARD
    elsewhere = tmp_path_factory.mktemp("elsewhere") / "shard"
    shard.rename(elsewhere)
    shard.symlink_to(elsewhere, target_is_directory=True)
    _resumes_from_persistent(root, at_2, caplog, "symbolic link")
    assert (elsewhere / "shard.bin").is_file()  # nothing deleted through it


def test_a_save_never_writes_through_a_planted_link(tmp_path: Path, caplog) -> None:
    model = make_model()
    manager = _manager(tmp_path)
    target = tmp_path / "target"
    target.mkdir()
    (tmp_path / "local" / "rank_00000" / "iter_0000006").symlink_to(target)
    with caplog.at_level(logging.WARNING, logger="stalwart.checkpoint"):
        manager.save(6, model, None, {"it": 6}, {}, non_persistent=True)
        manager.finalize()
    manager.close()
    assert list(target.iterdir()) == []
    assert "local checkpoint of iteration 6 failed on rank 0" in caplog.text
    assert "symbolic link" in caplog.text


def test_a_symlinked_rank_directory_is_refused_at_start(tmp_path: Path) -> None:
    (tmp_path / "local").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "local" / "rank_00000").symlink_to(tmp_path / "other")
    with pytest.raises(ValueError, match=r"--non-persistent-local-ckpt-dir: .*symbolic link"):
        _manager(tmp_path)


def test_a_second_job_on_the_same_local_directory_is_refused(tmp_path: Path) -> None:
    """A live job's lock (another process of this host, heartbeat fresh) on the node's local
    directory: ``stalwart train`` stops with exit 2 and one line naming the flag."""
    local = tmp_path / "local"
    local.mkdir()
    holder = subprocess.Popen(["sleep", "60"])
    try:
        record = {
            "host": socket.gethostname(),
            "pid": holder.pid,
            **_process_identity(),
            "job": None,
            "token": "other-job",
            "since": time.time(),
            "heartbeat": time.time(),
        }
        (local / LOCK_FILENAME).write_text(json.dumps(record))
        proc = run_cli(
            [
                "train",
                *TINY_FLAGS,
                "--train-iters",
                "2",
                "--save",
                str(tmp_path / "save"),
                "--non-persistent-save-interval",
                "1",
                "--non-persistent-ckpt-type",
                "local",
                "--non-persistent-local-ckpt-dir",
                str(local),
            ]
        )
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    error = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(error) == 1 and "--non-persistent-local-ckpt-dir" in error[0], proc.stderr
    assert "in use by another job" in error[0] and "Traceback" not in proc.stderr
    assert not (tmp_path / "save" / "iter_0000001").exists()
    assert os.path.exists(local / LOCK_FILENAME)  # theirs, left alone


def test_another_jobs_copies_are_neither_loaded_nor_deleted(saved, caplog) -> None:
    """A second job (another --save) on the same local directory after the first ended: it
    starts from scratch, and its retention leaves the first job's copy alone."""
    root, _, _ = saved
    model = make_model(seed=3)
    copies = LocalCheckpoints(str(root / "local"), job=str(root / "other-save"))
    manager = CheckpointManager(str(root / "other-save"), copies=copies)
    manager.check_writable()
    with caplog.at_level(logging.WARNING, logger="stalwart.checkpoint"):
        assert manager.load(model, None) is None
    assert "belong to another job" in caplog.text
    manager.save(6, model, None, {"it": 6}, {}, non_persistent=True)
    manager.save(8, model, None, {"it": 8}, {}, non_persistent=True)
    manager.close()
    theirs = root / "local" / "rank_00000"
    assert (theirs / "iter_0000004" / "shard_00000" / "shard.bin").is_file()
    assert not (theirs / "iter_0000006").exists() and (theirs / "iter_0000008").is_dir()
