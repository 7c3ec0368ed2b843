"""The one atomic write: old or new content under the name, never a part, no temporary file left."""

from __future__ import annotations

import doctest
import os
import stat
from pathlib import Path

import pytest

from stalwart import atomic_file
from stalwart.atomic_file import Sync, write_atomic, write_bytes_atomic, write_text_atomic


def test_docstring_example_runs() -> None:
    assert doctest.testmod(atomic_file).failed == 0


@pytest.mark.parametrize("sync", list(Sync))
def test_the_new_content_replaces_the_old(tmp_path: Path, sync: Sync) -> None:
    path = tmp_path / "state.json"
    path.write_text("old")
    write_text_atomic(path, "new", sync=sync)
    assert path.read_text() == "new"
    assert os.listdir(tmp_path) == ["state.json"]


def test_a_failed_write_keeps_the_old_content_and_leaves_no_temporary_file(
    tmp_path: Path,
) -> None:
    path = tmp_path / "model.pt"
    path.write_bytes(b"old")

    def half(tmp: str) -> None:
        Path(tmp).write_bytes(b"ne")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_atomic(path, half)
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["model.pt"]


def test_the_mode_is_kept_by_a_writer_that_truncates(tmp_path: Path) -> None:
    path = tmp_path / "artifacts.bin"
    write_bytes_atomic(path, b"x", sync=Sync.FILE, mode=0o600)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    write_atomic(path, lambda tmp: Path(tmp).write_bytes(b"y"), mode=0o600)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_bytes() == b"y"


def test_a_missing_directory_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        write_text_atomic(tmp_path / "absent" / "f", "x")


def _replace_with_private_file(tmp: str) -> None:
    """What safetensors' save_file does: a new file of its own, 0600, renamed over the name."""
    new = tmp + ".lib"
    fd = os.open(new, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, b"weights")
    os.close(fd)
    os.replace(new, tmp)


@pytest.mark.parametrize(
    ("umask", "mode", "expected"),
    [(0o022, 0o666, 0o644), (0o077, 0o666, 0o600), (0o002, 0o666, 0o664), (0o022, 0o600, 0o600)],
)
def test_a_library_that_writes_its_own_file_still_leaves_the_umask_s_mode(
    tmp_path: Path, umask: int, mode: int, expected: int
) -> None:
    old = os.umask(umask)
    try:
        write_atomic(tmp_path / "model.safetensors", _replace_with_private_file, mode=mode)
    finally:
        os.umask(old)
    path = tmp_path / "model.safetensors"
    assert stat.S_IMODE(path.stat().st_mode) == expected and path.read_bytes() == b"weights"
    assert os.listdir(tmp_path) == ["model.safetensors"]


def test_a_writer_that_leaves_a_link_is_refused_and_nothing_is_left(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("x")

    def link(tmp: str) -> None:
        os.unlink(tmp)
        os.symlink(target, tmp)

    with pytest.raises(OSError, match="not a regular file"):
        write_atomic(tmp_path / "out", link)
    assert sorted(os.listdir(tmp_path)) == ["elsewhere"]
