"""Write a file so that a reader sees its old content or its new content, never a part: the one
atomic write of stalwart (a leaf module: any component may import it; it imports nothing of
stalwart's).

The new content goes to a temporary file in the same directory (same filesystem, so the rename
is atomic), created exclusively under a fresh name (two writers never share one), then
``os.replace`` puts it under the final name. A failure anywhere removes the temporary file and
raises. How much reaches the disk before the call returns is the caller's choice (`Sync`): a
report that can be written again needs no fsync; a checkpoint's tracker must survive a power
loss, rename included.

    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "latest")
    >>> write_text_atomic(path, "iter_0000020\\n", sync=Sync.NONE)
    >>> open(path).read()
    'iter_0000020\\n'
    >>> os.listdir(os.path.dirname(path))            # no temporary file left behind
    ['latest']
"""

from __future__ import annotations

import contextlib
import enum
import os
import stat
from collections.abc import Callable


class Sync(enum.Enum):
    """What is on the disk when the write returns (each level includes the one before)."""

    NONE = "none"  # nothing forced: a crash may lose the new content, never leaves half of it
    FILE = "file"  # the new content (fsync of the file before the rename)
    FILE_AND_DIR = "file_and_dir"  # and the rename (fsync of the directory after it)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Persist a directory entry change (create/rename); a no-op where the OS does not allow it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems (and Windows) refuse fsync on directories; rename is still atomic
    finally:
        os.close(fd)


def write_atomic(
    path: str | os.PathLike[str],
    write: Callable[[str], object],
    *,
    sync: Sync = Sync.FILE_AND_DIR,
    mode: int = 0o666,
) -> None:
    """``write(tmp)`` fills a new temporary file next to ``path`` (by its path: ``torch.save``,
    ``safetensors``' ``save_file`` and ``open(tmp, "wb")`` all work), then it replaces ``path``.

    ``path`` ends with ``mode`` minus the umask (``0o600`` for a private file): the temporary
    file is created so before ``write`` runs, and gets that mode back if ``write`` changed it (a
    library that writes a new file of its own under the name, as safetensors does with 0600,
    whatever the umask). The directory must exist. Raises what ``write`` or the filesystem
    raised, with the temporary file removed; ``path`` then keeps its previous content."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = create_exclusive(directory, f".{os.path.basename(path)}.", mode)
    try:
        created = stat.S_IMODE(os.fstat(fd).st_mode)  # ``mode`` as the umask (or an ACL) left it
    finally:
        os.close(fd)
    try:
        write(tmp)
        _restore_mode(tmp, created)
        if sync is not Sync.NONE:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if sync is Sync.FILE_AND_DIR:
        fsync_dir(directory)


def _restore_mode(tmp: str, mode: int) -> None:
    """Give ``tmp`` the permission bits its creation got, where ``write`` left others."""
    st = os.lstat(tmp)
    if not stat.S_ISREG(st.st_mode):  # a link or anything else is not what write() may leave
        raise OSError(f"{tmp} is not a regular file after it was written")
    if stat.S_IMODE(st.st_mode) != mode:
        os.chmod(tmp, mode)


def write_bytes_atomic(
    path: str | os.PathLike[str],
    data: bytes,
    *,
    sync: Sync = Sync.FILE_AND_DIR,
    mode: int = 0o666,
) -> None:
    """:func:`write_atomic` of ``data``."""

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data)

    write_atomic(path, write, sync=sync, mode=mode)


def write_text_atomic(
    path: str | os.PathLike[str],
    text: str,
    *,
    sync: Sync = Sync.FILE_AND_DIR,
) -> None:
    """:func:`write_atomic` of UTF-8 ``text``."""
    write_bytes_atomic(path, text.encode("utf-8"), sync=sync)


def create_exclusive(directory: str, prefix: str, mode: int = 0o666) -> tuple[int, str]:
    """A new file under ``directory`` (``prefix`` + random hex), opened for writing, and its
    path: created with ``mode`` minus the umask (``mkstemp`` would make it 0600 whatever the
    umask), never an existing file or a planted link. The caller closes the descriptor."""
    for _ in range(100):
        tmp = os.path.join(directory, f"{prefix}{os.urandom(6).hex()}")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"cannot create a temporary file in {directory}")
