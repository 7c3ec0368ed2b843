"""Output paths named by flags, checked before anything is allocated or written.

A directory flag (``--tensorboard-dir``) must name a directory or a path that can become one;
a file flag (``--metrics-file``) must not name a directory. The check only looks (``stat``):
nothing is created, so a refused run leaves no trace. ``ValueError`` names the flag and what is
wrong, in one line.

    >>> check_output_dir("--tensorboard-dir", "/")
    >>> check_output_file("--metrics-file", "/")
    Traceback (most recent call last):
    ...
    ValueError: --metrics-file '/' is a directory (it names a file to write)
"""

from __future__ import annotations

import os
from pathlib import Path


def _check_ancestors(flag: str, path: Path) -> None:
    """The nearest existing ancestor of ``path`` must be a writable directory."""
    for parent in path.absolute().parents:
        if not parent.exists():
            continue
        if not parent.is_dir():
            raise ValueError(f"{flag} {str(path)!r}: {str(parent)!r} is a file, not a directory")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise ValueError(f"{flag} {str(path)!r}: {str(parent)!r} is not writable")
        return


def _existing(flag: str, value: str | None, takes: str) -> Path | None:
    """``value``'s path when it exists (the caller checks what it is); None when unset, or new
    with a writable directory as its nearest existing ancestor. ``takes``: what the flag takes."""
    if value is None:
        return None
    if not value.strip():
        raise ValueError(f"{flag} is empty (it takes {takes})")
    path = Path(value)
    if path.exists():
        return path
    _check_ancestors(flag, path)
    return None


def check_output_dir(flag: str, value: str | None) -> None:
    """``value`` (None: unset) names a directory that exists or can be created."""
    path = _existing(flag, value, "a directory")
    if path is None:
        return
    if not path.is_dir():
        raise ValueError(f"{flag} {value!r} is a file, not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {value!r} is not writable")


def check_output_file(flag: str, value: str | None) -> None:
    """``value`` (None: unset) names a file that can be written (created or appended)."""
    path = _existing(flag, value, "a file path")
    if path is None:
        return
    if path.is_dir():
        raise ValueError(f"{flag} {value!r} is a directory (it names a file to write)")
    if not path.is_file():  # a FIFO blocks the first append until a reader comes
        raise ValueError(f"{flag} {value!r} is not a regular file (it names a file to write)")
    if not os.access(path, os.W_OK):
        raise ValueError(f"{flag} {value!r} is not writable")


def check_files_in(flag: str, directory: str | None, names: tuple[str, ...]) -> None:
    """The files the run appends to inside ``directory`` (None: unset), where present, must be
    regular files: a FIFO planted under such a name would block the first append forever."""
    if directory is None or not directory.strip():
        return
    for name in names:
        path = Path(directory) / name
        if path.exists() and not path.is_file():
            raise ValueError(
                f"{flag} {directory!r}: {name} is not a regular file (the run appends to it)"
            )


__all__ = ["check_files_in", "check_output_dir", "check_output_file"]
