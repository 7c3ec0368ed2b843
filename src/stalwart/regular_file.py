"""Open a file that stalwart did not just write (a checkpoint side file, a ledger, a metrics file)
for reading, refusing anything but a regular file *without blocking*.

``open(path, "rb")`` on a FIFO planted under the name of ``metadata.json``, ``rank_00000.json``
or ``goodput.jsonl`` waits forever for a writer (a hung resume, a hung ``stalwart checkpoints``);
on ``/dev/zero`` a bounded read returns garbage, on ``/dev/stdin`` it waits for the terminal.
`open_regular` opens with ``O_NONBLOCK`` (a FIFO opens at once), checks what was opened
(``fstat``: no race with a swap after a ``stat``) and raises an ``OSError`` for anything that is
not a regular file, so every caller's existing ``except OSError`` reports it as unreadable.
Symbolic links are followed, as ``open`` does: a link to a regular file reads it.

    >>> import os, tempfile
    >>> fifo = os.path.join(tempfile.mkdtemp(), "metadata.json")
    >>> os.mkfifo(fifo)
    >>> open_regular(fifo)
    Traceback (most recent call last):
    ...
    OSError: [Errno 22] not a regular file (a FIFO): '...metadata.json'
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from typing import BinaryIO

_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def open_regular(path: str | os.PathLike[str]) -> BinaryIO:
    """``open(path, "rb")`` for regular files only (see the module docstring).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        IsADirectoryError: ``path`` is a directory (as ``open`` raises).
        OSError: ``path`` is a FIFO, a device or a socket (``EINVAL``), or cannot be opened.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", os.fspath(path))
        if not stat.S_ISREG(mode):
            kind = next((name for test, name in _KINDS if test(mode)), "not a file")
            raise OSError(errno.EINVAL, f"not a regular file ({kind})", os.fspath(path))
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def remove_own_tree(path: str, first: str | None = None) -> str | None:
    """Delete the directory ``path`` that stalwart created (its entry ``first`` first, e.g. a
    completeness marker), never deleting anything through a symbolic link.

    A ``path`` that is a link (stalwart never creates one) or not a directory is left alone, link
    included: the one-line reason is returned for the caller to warn with (it names ``path``
    only, never what the link points at). Links inside the tree are removed as links, never
    followed (``shutil.rmtree`` works on directory descriptors, and ``first`` is unlinked
    relative to the directory opened with ``O_NOFOLLOW``).

    Returns:
        None when ``path`` was removed or did not exist; else why it was left alone.
    """
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return _left_alone(path, exc)
    try:
        if first is not None:
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                os.unlink(first, dir_fd=fd)  # the link itself, were it one: unlink never follows
    finally:
        os.close(fd)
    if os.path.islink(path):  # swapped for a link meanwhile: rmtree would refuse it anyway
        return _left_alone(path, None)
    shutil.rmtree(path, ignore_errors=True)
    return None


def _left_alone(path: str, exc: OSError | None) -> str:
    if os.path.islink(path):
        return (
            f"not deleting {path}: it is a symbolic link, which stalwart never creates "
            "(nothing is deleted through it; remove the link yourself)"
        )
    if exc is not None and exc.errno == errno.ENOTDIR:
        return f"not deleting {path}: it is not a directory (stalwart created a directory there)"
    return f"not deleting {path}: {exc.strerror if exc is not None else 'unreadable'}"


__all__ = ["open_regular", "remove_own_tree"]
