"""On-disk layout of stalwart checkpoints (Megatron-compatible) and pure filesystem helpers.

Layout of one checkpoint root (``--save`` or ``--non-persistent-ckpt-dir``)::

    <root>/latest_checkpointed_iteration.txt   the iteration integer + newline (Megatron format)
    <root>/iter_0000010/                        one complete checkpoint (7-digit zero pad)
        .metadata, __<r>_<i>.distcp             torch.distributed.checkpoint (model + optimizer)
        common.pt                               rank 0's ``common`` dict (torch.save)
        rank_00000.pt ...                       every rank's ``per_rank`` dict (torch.save)
        metadata.json                           human-readable facts (iteration, world size, ...)
        COMPLETE                                completeness marker, written last, before the rename
    <root>/iter_0000020.tmp-<token>/            a save in progress (or a crashed one): never loaded

A directory counts as a checkpoint only when its name is exactly ``iter_<digits>`` and it holds
the ``COMPLETE`` marker; both are created only after every rank finished writing.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from typing import Any

from stalwart.checkpoint.errors import CheckpointError

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
COMPLETE_MARKER = "COMPLETE"
COMMON_FILENAME = "common.pt"
METADATA_FILENAME = "metadata.json"
DCP_METADATA_FILENAME = ".metadata"
TMP_INFIX = ".tmp-"

_ITER_DIR_RE = re.compile(r"^iter_(\d{7,})$")


def iteration_dir_name(iteration: int) -> str:
    """``iter_0000010`` for 10 (Megatron's 7-digit zero pad; longer numbers keep every digit)."""
    if iteration < 0:
        raise ValueError(f"checkpoint iteration must be >= 0, got {iteration}")
    return f"iter_{iteration:07d}"


def parse_iteration_dir_name(name: str) -> int | None:
    """Inverse of :func:`iteration_dir_name`; None for anything else (tmp dirs included)."""
    match = _ITER_DIR_RE.match(name)
    return int(match.group(1)) if match else None


def rank_filename(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def tmp_dir_name(iteration: int, token: str) -> str:
    return f"{iteration_dir_name(iteration)}{TMP_INFIX}{token}"


def fsync_dir(path: str) -> None:
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


def write_text_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` via tmp file + fsync + os.replace: readers see old or new, never half."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(directory)


def read_tracker(root: str) -> int | None:
    """The iteration in ``<root>/latest_checkpointed_iteration.txt``; None when the file is absent.

    Raises:
        CheckpointError: the file exists but does not hold a non-negative integer (Megatron's
            ``release`` marker included: release checkpoints are not supported).
    """
    path = os.path.join(root, TRACKER_FILENAME)
    try:
        with open(path, encoding="utf-8") as f:
            content = f.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint tracker {path}: {exc}") from exc
    text = content.strip()
    if not text.isdigit():
        raise CheckpointError(
            f"checkpoint tracker {path} must hold a non-negative iteration integer, got {content!r}"
        )
    return int(text)


def write_tracker_atomic(root: str, iteration: int) -> None:
    """Point ``<root>/latest_checkpointed_iteration.txt`` at ``iteration`` atomically."""
    if iteration < 0:
        raise ValueError(f"checkpoint iteration must be >= 0, got {iteration}")
    write_text_atomic(os.path.join(root, TRACKER_FILENAME), f"{iteration}\n")


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, COMPLETE_MARKER))


def list_complete_checkpoints(root: str) -> list[int]:
    """Iterations of the complete checkpoints under ``root``, ascending (empty if ``root`` is absent)."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        iteration = parse_iteration_dir_name(name)
        if iteration is not None and is_complete(os.path.join(root, name)):
            found.append(iteration)
    return sorted(found)


def list_tmp_dirs(root: str) -> list[str]:
    """Paths of in-progress or crashed saves (``*.tmp-*``) under ``root``."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    return [os.path.join(root, n) for n in names if n.startswith("iter_") and TMP_INFIX in n]


def write_marker(path: str, facts: dict[str, Any]) -> None:
    """Write the completeness marker of a fully written checkpoint directory."""
    write_text_atomic(os.path.join(path, COMPLETE_MARKER), json.dumps(facts, sort_keys=True) + "\n")


def remove_checkpoint_dir(path: str) -> None:
    """Delete a checkpoint directory, marker first so that a half-deleted one is never 'complete'."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(path, COMPLETE_MARKER))
    shutil.rmtree(path, ignore_errors=True)


def check_files(path: str, world_size: int | None = None) -> str | None:
    """Cheap integrity check of a checkpoint directory without reading tensor data.

    Returns:
        None when the directory looks loadable, else a short description of what is wrong
        (missing directory/marker/metadata, or a DCP shard shorter than its metadata says).
    """
    if not os.path.isdir(path):
        return "directory is missing"
    if not is_complete(path):
        return f"completeness marker {COMPLETE_MARKER} is missing (save did not finish)"
    for name in (DCP_METADATA_FILENAME, COMMON_FILENAME):
        if not os.path.isfile(os.path.join(path, name)):
            return f"file {name} is missing"
    return _check_shard_sizes(path)


def _check_shard_sizes(path: str) -> str | None:
    """Compare each DCP shard's size with the byte ranges recorded in ``.metadata``."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as exc:  # any parse failure means the metadata file is corrupt
        return f"DCP metadata unreadable: {type(exc).__name__}: {exc}"
    needed: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        rel = getattr(info, "relative_path", None)
        end = int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0))
        if isinstance(rel, str):
            needed[rel] = max(needed.get(rel, 0), end)
    for rel, end in sorted(needed.items()):
        full = os.path.join(path, rel)
        try:
            size = os.path.getsize(full)
        except OSError:
            return f"shard {rel} is missing"
        if size < end:
            return f"shard {rel} is truncated ({size} bytes, metadata needs {end})"
    return None


def select_for_deletion(complete: list[int], keep_last: int, protected: int | None) -> list[int]:
    """Retention decision: all but the newest ``keep_last`` iterations, never ``protected``."""
    if keep_last < 1:
        raise ValueError(f"--ckpt-keep-last must be >= 1, got {keep_last}")
    older = sorted(complete)[:-keep_last]
    return [it for it in older if it != protected]


def torch_save_fsynced(obj: Any, path: str) -> None:
    """torch.save + fsync, so the file is durable before the completeness marker is written."""
    import torch

    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def write_failure_hint(root: str) -> str:
    """After a failed save: probe-write 1 MiB into ``root`` so the error can name the OS cause.

    torch's writers report a full disk (ENOSPC), a quota (EDQUOT) or a file-size limit (EFBIG)
    only as a short-write assertion; the probe's ``strerror`` says which. Empty when it succeeds.
    """
    probe = os.path.join(root, f".write_probe_{os.getpid()}")
    try:
        with open(probe, "wb") as f:
            f.write(bytes(1 << 20))
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        return f" (the checkpoint directory {root} rejects writes: {exc.strerror or exc})"
    finally:
        with contextlib.suppress(OSError):
            os.unlink(probe)
    return ""
