"""Whether a compile cache directory may be trusted: nobody but this user (and root) can write
it, at the check and for the rest of the run.

Why a check of the whole path and not a check at each use: Inductor reads the cache by path, at
every load and compile, deep inside torch; it cannot be handed a file descriptor. Any check made
before torch's own open (an ``lstat``, or an ``fstat`` of a descriptor of ours) leaves a window in
which whoever can write the cache's parent directory renames the checked directory away and puts
their own in its place: the check then vouched for a directory torch never reads. What survives
that window is a property nobody else can change: every directory from ``/`` down to the cache is
owned by this user or root and writable by its owner only (or sticky, like ``/tmp``, where only an
entry's owner may rename it), and everything below the cache is this user's, is no link and, where
others can reach it, is not writable by them. A swap then needs this user or root, who could run
code anyway. The check runs at start-up and again when the cache is opened, right before its first
load and compile, so a directory that changed in between is judged as it is when used.

Also refused: a cache inside a checkpoint directory (``iter_NNNNNNN``: its files would break that
checkpoint's manifest, ``stalwart checkpoints --verify``), and directories that do not exist yet
and would be created writable by the group or others (the umask), such as a run directory made
under umask 002.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

INDUCTOR_DIR = "inductor"  # Inductor's caches (TORCHINDUCTOR_CACHE_DIR)
ARTIFACTS_FILE = "artifacts.bin"  # torch's mega-cache
# A checkpoint's directory: iter_0000010, and its in-progress form iter_0000010.tmp-...
_CHECKPOINT_DIR = re.compile(r"^iter_\d{7,}")
_WRITE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH


def current_umask() -> int:
    """This process's umask (``/proc/self/status``; elsewhere set and restored at once)."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def _uid() -> int | None:
    return os.getuid() if hasattr(os, "getuid") else None


def _writers(mode: int) -> str | None:
    """Who besides the owner may write an entry of ``mode`` ("every user", "its group")."""
    if mode & stat.S_IWOTH:
        return "every user"
    if mode & stat.S_IWGRP:
        return "its group"
    return None


def entry_problem(info: os.stat_result, what: str, *, directory: bool | None) -> str | None:
    """Why an entry of the cache (``lstat`` result ``info``) must not be used, or None.

    ``directory``: True/False when it must be a directory/regular file, None for either."""
    mode = info.st_mode
    if stat.S_ISLNK(mode):
        return f"{what} is a symbolic link"
    if directory is True and not stat.S_ISDIR(mode):
        return f"{what} is not a directory"
    if directory is False and not stat.S_ISREG(mode):
        return f"{what} is not a regular file"
    if directory is None and not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
        return f"{what} is neither a directory nor a regular file"
    uid = _uid()
    if uid is not None and info.st_uid != uid:
        return f"{what} is owned by uid {info.st_uid}, not by this user (uid {uid})"
    return None


def _writable_problem(mode: int, what: str) -> str | None:
    writers = _writers(stat.S_IMODE(mode))
    if writers is None:
        return None
    fix = "chmod g-w" if writers == "its group" else "chmod o-w"
    return f"{what} is writable by {writers} (mode {stat.S_IMODE(mode):o}; {fix})"


def checkpoint_problem(real: Path) -> str | None:
    """A cache at or below a checkpoint's directory (``iter_NNNNNNN``) would change that
    checkpoint: its manifest no longer matches (``stalwart checkpoints --verify`` fails)."""
    for depth, part in enumerate(real.parts):
        if _CHECKPOINT_DIR.match(part):
            inside = Path(*real.parts[: depth + 1])
            return (
                f"it is inside the checkpoint directory {str(inside)!r}, whose files the cache "
                "would change (stalwart checkpoints --verify would fail); choose a directory "
                "outside every checkpoint"
            )
    return None


def ancestor_problem(real: Path, umask: int) -> str | None:
    """Why another user could replace the cache at ``real`` through a directory above it: one
    owned by another user, or writable by others without the sticky bit, or one that does not
    exist yet and would be created so under ``umask``. None when nobody else can."""
    uid = _uid()
    if uid is None:  # no POSIX ownership: nothing to judge
        return None
    for parent in reversed(real.parents):  # from / down
        try:
            info = parent.lstat()
        except FileNotFoundError:
            created = 0o777 & ~umask  # as mkdir(parents=True) makes it
            writers = _writers(created)
            if writers is None:
                return None  # what is below is created the same way
            return (
                f"{str(parent)!r} does not exist and would be created writable by {writers} "
                f"(umask {umask:04o}): another user could then rename the cache away and put "
                "theirs in its place; run under umask 022 or choose a directory only you can write"
            )
        except OSError as exc:
            return f"{str(parent)!r} cannot be examined ({exc.strerror or exc})"
        mode = info.st_mode
        if info.st_uid not in (0, uid):
            return (
                f"{str(parent)!r} is owned by uid {info.st_uid}, who can replace anything "
                "below it; choose a directory under ones owned by you or root"
            )
        writers = _writers(stat.S_IMODE(mode))
        if writers is not None and not mode & stat.S_ISVTX:
            return (
                f"{str(parent)!r} is writable by {writers} without the sticky bit (mode "
                f"{stat.S_IMODE(mode):o}): another user could rename the cache away and put "
                "theirs in its place; choose a directory only you can write (or chmod g-w,o-w)"
            )
    return None


def tree_problem(root: Path, root_mode: int, umask: int) -> str | None:
    """Why an entry below the cache directory ``root`` (``root_mode``) must not be used: a link,
    another user's entry, one that is neither a directory nor a regular file, or (where the
    group or others may enter ``root``) one they could write, now or as torch creates it."""
    reach = 0
    if root_mode & stat.S_IXGRP:
        reach |= stat.S_IWGRP
    if root_mode & stat.S_IXOTH:
        reach |= stat.S_IWOTH
    if reach & ~umask:
        return (
            f"others can enter it (mode {stat.S_IMODE(root_mode):o}) and the umask "
            f"({umask:04o}) makes what torch writes there writable by them; chmod 700 it"
        )
    pending = [root]
    while pending:
        directory = pending.pop()
        try:
            entries = list(os.scandir(directory))
        except FileNotFoundError:  # removed meanwhile (another rank's Inductor write)
            continue
        for entry in entries:
            what = os.path.relpath(entry.path, root)
            try:
                info = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            problem = entry_problem(info, what, directory=None)
            if problem is None and info.st_mode & reach:
                problem = _writable_problem(info.st_mode, what)
            if problem is not None:
                return problem
            if stat.S_ISDIR(info.st_mode):
                pending.append(Path(entry.path))
    return None


def cache_dir_problem(directory: Path, fixed: dict[str, bool]) -> str | None:
    """Why ``directory`` cannot hold a trusted compile cache, or None (see the module
    docstring). ``fixed``: names directly below it that must be a directory (True) or a regular
    file (False) where they exist. Only looks: nothing is created."""
    try:
        info: os.stat_result | None = directory.lstat()
    except FileNotFoundError:
        info = None
    if info is not None:
        problem = entry_problem(info, "it", directory=True) or _writable_problem(info.st_mode, "it")
        if problem is not None:
            return problem
    real = Path(os.path.realpath(directory))
    umask = current_umask()
    problem = checkpoint_problem(real) or ancestor_problem(real, umask)
    if problem is not None or info is None:
        return problem
    for name, is_dir in fixed.items():
        try:
            child = (directory / name).lstat()
        except FileNotFoundError:
            continue
        problem = entry_problem(child, name, directory=is_dir) or _writable_problem(
            child.st_mode, name
        )
        if problem is not None:
            return problem
    return tree_problem(directory, info.st_mode, umask)


def check_cache_dir(flag: str, directory: str | os.PathLike[str]) -> None:
    """``ValueError`` (one line naming ``flag``) unless ``directory`` can hold a trusted cache
    (`stalwart.compile.cache_trust`): it and everything below it are this user's, no links,
    not writable by others; every directory above it is this user's or root's and writable by
    its owner only (or sticky); it is not inside a checkpoint directory; a missing directory
    needs a writable parent. Only looks: nothing is created."""
    text = os.fspath(directory)
    if not text.strip():
        raise ValueError(f"{flag} is empty (it takes a directory)")
    root = Path(text)
    why = "the cache holds generated code that the run executes; use a directory only you write"
    problem = cache_dir_problem(root, {INDUCTOR_DIR: True, ARTIFACTS_FILE: False})
    if problem is not None:
        raise ValueError(f"{flag} {text!r}: {problem} ({why})")
    if not root.exists():
        parent = next((p for p in root.absolute().parents if p.exists()), None)
        if parent is None or not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
            raise ValueError(f"{flag} {text!r}: {str(parent)!r} is not a writable directory")


__all__ = [
    "ARTIFACTS_FILE",
    "INDUCTOR_DIR",
    "ancestor_problem",
    "cache_dir_problem",
    "check_cache_dir",
    "checkpoint_problem",
    "current_umask",
    "entry_problem",
    "tree_problem",
]
