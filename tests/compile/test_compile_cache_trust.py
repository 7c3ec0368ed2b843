"""The compile cache is code the run executes: attacks on it, each refused in one line
(`stalwart.compile.cache_trust`, `stalwart.compile.cache`).

Another user's moves are played by a child process running as uid 4242 where the test runs as
root (skipped otherwise); entries of another user are made with ``os.chown``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from stalwart.compile.cache import (
    ARTIFACTS_FILE,
    INDUCTOR_DIR,
    CompileCache,
    check_cache_dir,
)

OTHER_UID = 4242
FLAG = "--compile-cache-dir"
needs_root = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0, reason="plays another user: needs root"
)


@pytest.fixture
def shared_base() -> Iterator[Path]:
    """A directory every user can enter (pytest's tmp_path is private to this user), so that
    another user's process can reach what the test lays out below it."""
    base = Path(tempfile.mkdtemp(prefix="stalwart-cache-trust-"))
    base.chmod(0o755)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _swap_as_other_user(cache: Path) -> subprocess.CompletedProcess[str]:
    """Another user (uid/gid 4242) renames ``cache`` away and puts a cache of theirs in its
    place, with a generated module planted below ``inductor/``."""
    script = 'mv "$1" "$1.moved" && mkdir -p "$1/inductor" && echo "import os" > "$1/inductor/x.py"'
    return subprocess.run(
        ["/bin/sh", "-c", script, "sh", str(cache)],
        user=OTHER_UID,
        group=OTHER_UID,
        extra_groups=[],
        capture_output=True,
        text=True,
        timeout=60,
    )


@needs_root
def test_a_parent_others_can_write_is_refused_because_they_can_swap_the_cache(
    shared_base: Path,
) -> None:
    """Under a parent directory that every user may write (no sticky bit), another user
    really can rename the checked cache away and put theirs in its place: refused before use.
    With the sticky bit (as /tmp) they cannot rename what is ours: accepted."""
    parent = shared_base / "team"
    parent.mkdir()
    parent.chmod(0o777)
    cache = parent / "cc"
    with pytest.raises(ValueError) as info:
        check_cache_dir(FLAG, cache)
    message = str(info.value)
    assert message.startswith(f"{FLAG} '{cache}': '{parent}' is writable by every user without")
    assert "rename the cache away" in message and "\n" not in message
    # The attack the refusal prevents, played for real on the refused layout.
    cache.mkdir(mode=0o700)
    (cache / INDUCTOR_DIR).mkdir(mode=0o700)
    swapped = _swap_as_other_user(cache)
    assert swapped.returncode == 0, swapped.stderr
    assert (cache / INDUCTOR_DIR / "x.py").stat().st_uid == OTHER_UID
    with pytest.raises(ValueError, match="owned by uid 4242"):
        CompileCache(cache, flag=FLAG)  # and the planted cache is refused as it is now
    shutil.rmtree(cache)
    shutil.rmtree(parent / "cc.moved")

    parent.chmod(0o1777)  # sticky: only an entry's owner may rename or remove it
    check_cache_dir(FLAG, cache)
    cache.mkdir(mode=0o700)
    blocked = _swap_as_other_user(cache)
    assert blocked.returncode != 0 and "not permitted" in blocked.stderr, blocked.stderr
    assert cache.stat().st_uid == os.getuid()  # still ours
    check_cache_dir(FLAG, cache)


def test_a_group_writable_parent_and_a_run_dir_made_under_umask_002_are_refused(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    run.chmod(0o775)  # a run directory made under umask 002 on team storage
    with pytest.raises(
        ValueError, match=r"'[^']*/run' is writable by its group without the sticky"
    ):
        check_cache_dir("--run-dir's compile cache", run / "compile_cache")
    old = os.umask(0o002)
    try:  # the run directory does not exist yet: it would be created group-writable
        with pytest.raises(
            ValueError, match=r"would be created writable by its group \(umask 0002\)"
        ):
            check_cache_dir(FLAG, tmp_path / "new_run" / "compile_cache")
        check_cache_dir(FLAG, tmp_path / "cc")  # the cache itself is created 0700: fine
    finally:
        os.umask(old)
    check_cache_dir(FLAG, tmp_path / "new_run" / "compile_cache")  # under umask 022


@needs_root
def test_a_parent_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    (theirs / "mine").mkdir(parents=True, mode=0o755)
    theirs.chmod(0o755)
    os.chown(theirs, OTHER_UID, OTHER_UID)  # they may rename "mine" away at any time
    with pytest.raises(ValueError, match=r"'[^']*/theirs' is owned by uid 4242, who can replace"):
        check_cache_dir(FLAG, theirs / "mine" / "cc")


def _cache_with_entries(root: Path) -> Path:
    (root / INDUCTOR_DIR / "fxgraph" / "ab").mkdir(parents=True, mode=0o700)
    root.chmod(0o700)
    (root / INDUCTOR_DIR / "fxgraph" / "ab" / "entry").write_bytes(b"graph")
    (root / INDUCTOR_DIR / "ab").mkdir(mode=0o700)
    (root / INDUCTOR_DIR / "ab" / "cabcdef.py").write_text("x = 1\n")
    check_cache_dir(FLAG, root)  # all this user's: fine
    return root


@needs_root
def test_generated_modules_of_another_user_below_inductor_are_refused(tmp_path: Path) -> None:
    cache = _cache_with_entries(tmp_path / "cc")
    module = cache / INDUCTOR_DIR / "ab" / "cabcdef.py"
    os.chown(module, OTHER_UID, OTHER_UID)
    with pytest.raises(ValueError, match=r"inductor/ab/cabcdef.py is owned by uid 4242"):
        check_cache_dir(FLAG, cache)
    os.chown(module, 0, 0)
    os.chown(cache / INDUCTOR_DIR / "fxgraph", OTHER_UID, OTHER_UID)  # a directory of theirs
    with pytest.raises(ValueError, match=r"inductor/fxgraph is owned by uid 4242"):
        CompileCache(cache, flag=FLAG)


def test_a_symlinked_subdirectory_is_refused(tmp_path: Path) -> None:
    cache = _cache_with_entries(tmp_path / "cc")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.rmtree(cache / INDUCTOR_DIR / "fxgraph")
    (cache / INDUCTOR_DIR / "fxgraph").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(ValueError, match=r"^--compile-cache-dir .*inductor/fxgraph is a symbolic"):
        check_cache_dir(FLAG, cache)
    (cache / INDUCTOR_DIR / "fxgraph").unlink()
    os.mkfifo(cache / INDUCTOR_DIR / "ab" / "fifo")  # would hang a read
    with pytest.raises(ValueError, match=r"inductor/ab/fifo is neither a directory nor a regular"):
        check_cache_dir(FLAG, cache)


def test_entries_others_can_reach_and_write_are_refused_unreachable_ones_are_not(
    tmp_path: Path,
) -> None:
    cache = _cache_with_entries(tmp_path / "cc")
    sub = cache / INDUCTOR_DIR / "ab"
    sub.chmod(0o775)  # Inductor's own directories under umask 002
    check_cache_dir(FLAG, cache)  # the cache is 0700: nobody else can get there
    cache.chmod(0o755)
    with pytest.raises(ValueError, match=r"inductor/ab is writable by its group \(mode 775"):
        check_cache_dir(FLAG, cache)
    sub.chmod(0o755)
    old = os.umask(0o002)
    try:  # what torch writes there from now on would be group-writable
        with pytest.raises(ValueError, match=r"others can enter it \(mode 755\) and the umask"):
            check_cache_dir(FLAG, cache)
    finally:
        os.umask(old)


@needs_root
def test_a_swap_between_the_check_and_the_use_is_caught_when_the_cache_opens(
    tmp_path: Path,
) -> None:
    """The cache is judged again right before its first load and compile: a directory put in
    place after the start-up check (here by root, playing the one who could) is refused then,
    and torch is never pointed at it."""
    cache_dir = tmp_path / "cc"
    cache = CompileCache(cache_dir, flag=FLAG)  # the start-up check passes: nothing there yet
    planted = tmp_path / "planted"
    (planted / INDUCTOR_DIR).mkdir(parents=True, mode=0o700)
    planted.chmod(0o700)
    (planted / INDUCTOR_DIR / "cplanted.py").write_text("import os\n")
    for path in (planted, planted / INDUCTOR_DIR, planted / INDUCTOR_DIR / "cplanted.py"):
        os.chown(path, OTHER_UID, OTHER_UID)
    os.rename(planted, cache_dir)
    with pytest.raises(ValueError, match=r"^--compile-cache-dir .*: it is owned by uid 4242"):
        cache.open()
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") != str(cache.inductor_dir)
    assert cache._stack is None  # not open


def test_a_cache_made_after_the_check_with_a_linked_subdirectory_is_caught_at_open(
    tmp_path: Path,
) -> None:
    cache_dir = tmp_path / "cc"
    cache = CompileCache(cache_dir, flag=FLAG)
    (cache_dir / INDUCTOR_DIR).mkdir(parents=True, mode=0o700)
    cache_dir.chmod(0o700)
    (cache_dir / INDUCTOR_DIR / "triton").symlink_to(tmp_path, target_is_directory=True)
    with pytest.raises(ValueError, match="inductor/triton is a symbolic link"):
        cache.open()


def test_a_cache_inside_a_checkpoint_directory_is_refused(tmp_path: Path) -> None:
    save = tmp_path / "other_run"
    (save / "iter_0000010").mkdir(parents=True)
    with pytest.raises(ValueError) as info:
        check_cache_dir(FLAG, save / "iter_0000010" / "cc")
    message = str(info.value)
    assert f"inside the checkpoint directory '{save / 'iter_0000010'}'" in message
    assert "stalwart checkpoints --verify" in message
    for inside in ("iter_0000010", "iter_0000020.tmp-abc/x", "iter_0000030/a/b"):
        with pytest.raises(ValueError, match="inside the checkpoint directory"):
            check_cache_dir(FLAG, save / inside)
    link = tmp_path / "latest"
    link.symlink_to(save / "iter_0000010")  # reached through a link: the real path counts
    with pytest.raises(ValueError, match="inside the checkpoint directory"):
        check_cache_dir(FLAG, link / "cc")
    check_cache_dir(FLAG, save / "compile_cache")  # beside the checkpoints: the default place
    check_cache_dir(FLAG, tmp_path / "iter_notes" / "cc")


def _torch_artifacts(valid: bool) -> bytes:
    """A file in torch's mega-cache format holding no artifact; torn: its last byte cut."""
    from torch.utils._appending_byte_serializer import AppendingByteSerializer

    data = AppendingByteSerializer(serialize_fn=lambda writer, item: None).to_bytes()
    return data if valid else data[:-1]


def test_a_torn_artifacts_file_is_one_line_of_ours_and_not_stamped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    cache_dir = tmp_path / "cc"
    cache_dir.mkdir(mode=0o700)
    artifacts = cache_dir / ARTIFACTS_FILE
    artifacts.write_bytes(_torch_artifacts(valid=True))
    with CompileCache(cache_dir) as cache:  # the control: a whole file loads and is stamped
        assert cache._stamp_matches() and cache.has_artifacts()
    artifacts.write_bytes(_torch_artifacts(valid=False))
    capfd.readouterr()
    caplog.clear()
    with caplog.at_level(logging.WARNING), CompileCache(cache_dir) as cache:
        assert cache.loaded_artifacts == 0
        assert not cache._stamp_matches()  # not stamped as loaded: the next start tries again
        assert not cache.has_artifacts()  # written again after the first compiled iteration
    ours = [r.getMessage() for r in caplog.records if r.name == "stalwart.compile_cache"]
    assert len(ours) == 1 and "\n" not in ours[0], ours
    assert f"{artifacts} is damaged or not torch's" in ours[0]
    assert "checksum" in ours[0] and "compiles without it" in ours[0]
    err = capfd.readouterr().err
    assert "Traceback" not in err and "un-pickle" not in err, err  # nothing of torch's
    stamp = json.loads((cache_dir / INDUCTOR_DIR / "artifacts.stamp").read_text())
    assert stamp["size"] != artifacts.stat().st_size  # still the whole file's stamp


def test_a_planted_fifo_as_artifacts_file_is_refused(tmp_path: Path) -> None:
    cache_dir = tmp_path / "cc"
    cache_dir.mkdir(mode=0o700)
    os.mkfifo(cache_dir / ARTIFACTS_FILE)
    with pytest.raises(ValueError, match=f"{ARTIFACTS_FILE} is not a regular file"):
        CompileCache(cache_dir)
    assert stat.S_ISFIFO((cache_dir / ARTIFACTS_FILE).lstat().st_mode)
