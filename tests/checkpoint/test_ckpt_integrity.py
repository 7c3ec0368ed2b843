"""One check for resume and ``checkpoints --verify``, and the checksum manifest (issue 29,
items 8 and 10): a flipped byte in any file is caught by ``--verify`` and by a verified load,
which falls back to the previous checkpoint."""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch
from ckpt_fixtures import assert_same, make_model, make_optimizer, snapshot, train_steps

from stalwart.checkpoint import CheckpointError, CheckpointManager, integrity, layout
from stalwart.cli.main import main

ITER_2 = layout.iteration_dir_name(2)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict]:
    """A save directory with checkpoints 1 and 2, and the model state of checkpoint 1."""
    root = tmp_path_factory.mktemp("integrity") / "save"
    model = make_model()
    opt = make_optimizer(model)
    manager = CheckpointManager(str(root))
    train_steps(model, opt, 2)
    manager.save(1, model, opt, {"iteration": 1}, {"rng": torch.get_rng_state()})
    first = snapshot(model, opt)
    train_steps(model, opt, 1, seed=5)
    manager.save(2, model, opt, {"iteration": 2}, {"rng": torch.get_rng_state()})
    manager.close()
    return root, first


@pytest.fixture
def save(saved, tmp_path: Path) -> Path:
    copy = tmp_path / "save"
    shutil.copytree(saved[0], copy, symlinks=True)
    return copy


def _files() -> list[str]:
    return [".metadata", "__0_0.distcp", "common.json", "rank_00000.json", "metadata.json",
            integrity.MANIFEST_FILENAME, layout.COMPLETE_MARKER]  # fmt: skip


def _flip(path: Path, count: int) -> None:
    data = bytearray(path.read_bytes())
    count = min(count, len(data))
    start = (len(data) - count) // 2
    for i in range(start, start + count):
        data[i] ^= 0x01 if count == 1 else 0xFF
    path.write_bytes(bytes(data))


def _load(save: Path, **kwargs) -> tuple[object, dict]:
    model = make_model(seed=9)
    opt = make_optimizer(model)
    loaded = CheckpointManager(str(save), **kwargs).load(model, opt)
    return loaded, snapshot(model, opt)


def test_the_manifest_lists_every_file_and_verify_passes(save: Path, capsys) -> None:
    manifest = json.loads((save / ITER_2 / integrity.MANIFEST_FILENAME).read_text())
    assert manifest["algorithm"] == "crc32"
    on_disk = {p.name for p in (save / ITER_2).iterdir()}
    assert set(manifest["files"]) == on_disk - {integrity.MANIFEST_FILENAME, "COMPLETE"}
    assert set(_files()) == on_disk  # the parametrisation below covers every file
    assert main(["checkpoints", str(save), "--verify"]) == 0
    captured = capsys.readouterr()
    assert "iter_0000002  complete, verified  " in captured.out and "warning" not in captured.err


@pytest.mark.parametrize("count", [1, 100])
@pytest.mark.parametrize("name", _files())
def test_a_flipped_byte_in_any_file_is_caught(
    saved, save: Path, name: str, count: int, capsys, caplog
) -> None:
    _flip(save / ITER_2 / name, count)
    assert main(["checkpoints", str(save), "--verify"]) == 1
    out = capsys.readouterr().out
    assert "iter_0000002  complete, BROKEN: " in out and "iter_0000001  complete, verified" in out
    with pytest.raises(CheckpointError, match=ITER_2):
        _load(save, verify_on_load=True)
    with caplog.at_level(logging.WARNING, logger="stalwart.checkpoint"):
        loaded, state = _load(save, verify_on_load=True, fallback=True)
    assert loaded is not None and loaded.iteration == 1  # the previous one, bitwise
    assert_same(saved[1], state)
    assert "falling back" in caplog.text or "trying an older one" in caplog.text


def _as_older_stalwart(path: Path) -> None:
    """What a checkpoint of a stalwart before the manifest looks like."""
    (path / integrity.MANIFEST_FILENAME).unlink()
    facts = json.loads((path / "metadata.json").read_text())
    (path / layout.COMPLETE_MARKER).write_text(json.dumps(facts, sort_keys=True) + "\n")


def test_an_older_checkpoint_without_a_manifest_loads_with_a_warning(save, capsys, caplog) -> None:
    _as_older_stalwart(save / ITER_2)
    assert main(["checkpoints", str(save), "--verify"]) == 0
    captured = capsys.readouterr()
    assert "iter_0000002  complete, verified (no checksums)" in captured.out
    assert "warning:" in captured.err and "not checked against checksums" in captured.err
    with caplog.at_level(logging.WARNING, logger="stalwart.checkpoint"):
        loaded, _ = _load(save, verify_on_load=True)
    assert loaded is not None and loaded.iteration == 2 and "no checksums.json" in caplog.text


def _damage(path: Path, how: str) -> None:
    if how == "world_size":
        facts = json.loads((path / "metadata.json").read_text())
        (path / "metadata.json").write_text(json.dumps({**facts, "world_size": "two"}))
    elif how == "common_list":
        (path / "common.json").write_text("[1, 2]\n")
    elif how == "rank_missing":
        (path / "rank_00000.json").unlink()
    elif how == "rank_garbage":
        (path / "rank_00000.json").write_bytes(b"\xff\xfe not json")
    elif how == "metadata_missing":
        (path / "metadata.json").unlink()


@pytest.mark.parametrize(
    "how", ["world_size", "common_list", "rank_missing", "rank_garbage", "metadata_missing"]
)
def test_verify_refuses_what_a_resume_refuses(save: Path, how: str, capsys) -> None:
    """Without checksums to catch it (an older checkpoint), verify still applies every check
    that loading applies: the two agree (item 8)."""
    _as_older_stalwart(save / ITER_2)
    _damage(save / ITER_2, how)
    with pytest.raises(CheckpointError, match=ITER_2):
        _load(save)
    assert main(["checkpoints", str(save), "--verify"]) == 1
    assert "iter_0000002  complete, BROKEN: " in capsys.readouterr().out


def test_listing_fails_when_the_tracked_checkpoint_is_incomplete(save: Path, capsys) -> None:
    (save / ITER_2 / layout.COMPLETE_MARKER).unlink()
    assert main(["checkpoints", str(save)]) == 1
    assert "iter_0000002  INCOMPLETE" in capsys.readouterr().out
    shutil.rmtree(save / ITER_2)
    assert main(["checkpoints", str(save)]) == 1
    assert "the tracked checkpoint iter_0000002 is missing" in capsys.readouterr().out


def _manifest_attack(path: Path, how: str) -> None:
    manifest = path / integrity.MANIFEST_FILENAME
    if how == "truncated":
        manifest.write_bytes(manifest.read_bytes()[:20])
    elif how == "huge":
        with manifest.open("r+b") as f:
            f.truncate(65 << 20)  # sparse: bigger than the 64 MiB bound
    elif how == "binary":
        manifest.write_bytes(bytes(range(256)))
    elif how == "deleted":
        manifest.unlink()
    elif how == "planted_file":
        (path / "extra.distcp").write_bytes(b"x")
    elif how == "escaping_entry":
        _rewrite_manifest(
            path, lambda files: {**files, "../iter_0000001/common.json": files["common.json"]}
        )
    elif how == "fifo":
        manifest.unlink()
        os.mkfifo(manifest)  # would hang a plain open()
    elif how == "marker_without_key":
        facts = json.loads((path / "metadata.json").read_text())
        layout.write_marker(str(path), facts)  # the manifest stays, the marker forgets it
    elif how == "planted_subdir":
        (path / "sub").mkdir()
        (path / "sub" / "x.json").write_text("{}")
    elif how == "linked_file":
        (path / "common.json").rename(path / "common.real")
        (path / "common.json").symlink_to(path / "common.real")


def _rewrite_manifest(path: Path, change) -> None:
    """An attacker who rewrites the manifest consistently, marker included."""
    manifest = path / integrity.MANIFEST_FILENAME
    body = json.loads(manifest.read_text())
    body["files"] = change(body["files"])
    manifest.write_text(json.dumps(body))
    facts = json.loads((path / "metadata.json").read_text())
    layout.write_marker(str(path), facts, integrity.manifest_crc(str(path)))


@pytest.mark.parametrize(
    "how",
    [
        "truncated",
        "huge",
        "binary",
        "deleted",
        "fifo",
        "marker_without_key",
        "planted_file",
        "planted_subdir",
        "escaping_entry",
        "linked_file",
    ],
)
def test_manifest_attacks_are_one_line_refusals(save: Path, how: str, capsys) -> None:
    _manifest_attack(save / ITER_2, how)
    assert main(["checkpoints", str(save), "--verify"]) == 1
    captured = capsys.readouterr()
    broken = [line for line in captured.out.splitlines() if "BROKEN" in line]
    assert len(broken) == 1 and "iter_0000002" in broken[0] and "Traceback" not in captured.err
    with pytest.raises(CheckpointError, match=ITER_2):
        _load(save, verify_on_load=True)


def test_async_checksums_run_off_the_training_thread(tmp_path: Path, monkeypatch) -> None:
    threads: list[str] = []
    write = integrity.write_manifest

    def recording(path: str) -> None:
        threads.append(threading.current_thread().name)
        write(path)

    monkeypatch.setattr(integrity, "write_manifest", recording)
    model = make_model()
    opt = make_optimizer(model)
    train_steps(model, opt, 1)
    manager = CheckpointManager(str(tmp_path), async_save=True)
    manager.save(1, model, opt, {}, {})
    manager.finalize()
    manager.close()
    assert threads and threading.main_thread().name not in threads
    assert (
        integrity.check_checkpoint(
            str(tmp_path / layout.iteration_dir_name(1)), checksums=True
        ).problem
        is None
    )


def test_checksums_off_writes_no_manifest(tmp_path: Path) -> None:
    model = make_model()
    opt = make_optimizer(model)
    manager = CheckpointManager(str(tmp_path), checksums=False)
    manager.save(1, model, opt, {}, {})
    manager.close()
    path = tmp_path / layout.iteration_dir_name(1)
    assert not (path / integrity.MANIFEST_FILENAME).exists()
    assert integrity.check_checkpoint(str(path), checksums=True).note is not None


def test_big_files_are_checked_block_by_block(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(integrity, "BLOCK_BYTES", 1024)  # the shard spans many blocks
    model = make_model()
    opt = make_optimizer(model)
    manager = CheckpointManager(str(tmp_path))
    manager.save(1, model, opt, {}, {})
    manager.close()
    path = tmp_path / layout.iteration_dir_name(1)
    shard = path / "__0_0.distcp"
    blocks = json.loads((path / integrity.MANIFEST_FILENAME).read_text())["files"][shard.name][1]
    assert blocks.count("-") + 1 == -(-shard.stat().st_size // 1024) > 2
    data = bytearray(shard.read_bytes())
    data[2 * 1024 + 5] ^= 0x01
    shard.write_bytes(bytes(data))
    problem = integrity.check_checkpoint(str(path), checksums=True).problem
    assert problem == "file __0_0.distcp does not match its checksum (CRC-32 of its 64 MiB block 2)"
