"""On-disk layout of stalwart checkpoints (Megatron-compatible) and pure filesystem helpers.

Layout of one checkpoint root (``--save`` or ``--non-persistent-ckpt-dir``)::

    <root>/latest_checkpointed_iteration.txt   the iteration integer + newline (Megatron format)
    <root>/iter_0000010/                        one complete checkpoint (7-digit zero pad)
        .metadata, __<r>_<i>.distcp             torch.distributed.checkpoint (model + optimizer)
        common.json                             rank 0's ``common`` dict (`safe_state` JSON)
        rank_00000.json ...                     every rank's ``per_rank`` dict (`safe_state` JSON)
        metadata.json                           human-readable facts (iteration, world size, ...)
        COMPLETE                                completeness marker (the same facts, incl. which
                                                kind of save wrote it), written last, before
                                                the rename
    <root>/iter_0000020.tmp-<token>/            a save in progress (or a crashed one): never loaded

A directory counts as a checkpoint only when its name is exactly ``iter_<digits>`` and it holds
the ``COMPLETE`` marker; both are created only after every rank finished writing. Checkpoints of
stalwart before the JSON state files hold ``common.pt``/``rank_*.pt`` pickles instead: they are
refused (reading a pickle can run code) until ``stalwart checkpoints convert --trust-pickle``
rewrites them.

Files are created with the process umask, like DCP's own files (a teammate's evaluation job
must be able to read them).
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

from stalwart.atomic_file import create_exclusive, write_text_atomic
from stalwart.checkpoint.errors import CheckpointError
from stalwart.iteration_dirs import (
    TRACKER_FILENAME,
    iteration_dir_name,
    parse_iteration_dir_name,
    tracker_iteration,
)
from stalwart.regular_file import open_regular, remove_own_tree

COMPLETE_MARKER = "COMPLETE"
COMMON_FILENAME = "common.json"
LEGACY_COMMON_FILENAME = "common.pt"
METADATA_FILENAME = "metadata.json"
DCP_METADATA_FILENAME = ".metadata"
TMP_INFIX = ".tmp-"
NON_PERSISTENT_SUBDIR = "non_persistent"  # the default --non-persistent-ckpt-dir under --save


def rank_filename(rank: int) -> str:
    return f"rank_{rank:05d}.json"


def convert_hint(path: str) -> str:
    """The one-line refusal of a checkpoint in the pickle format of stalwart before JSON state."""
    return (
        f"checkpoint {path} holds {LEGACY_COMMON_FILENAME}/rank_*.pt pickles (an older stalwart), "
        "which can run code when read; if you trust whoever wrote it, convert it once with: "
        f"stalwart checkpoints convert --trust-pickle {path}"
    )


def tmp_dir_name(iteration: int, token: str) -> str:
    return f"{iteration_dir_name(iteration)}{TMP_INFIX}{token}"


def probe_writable(directory: str, flag: str, rank: int) -> str | None:
    """Create ``directory`` and write/delete a probe file; the problem naming ``flag``, or None."""
    try:
        os.makedirs(directory, exist_ok=True)
        fd, probe = create_exclusive(directory, f".write_probe_rank{rank}_")  # never a planted link
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write("ok")
        os.unlink(probe)
    except OSError as exc:
        return f"{flag} {directory!r} is not writable: {exc.strerror or exc}"
    return None


def check_roots_disjoint(save_dir: str | None, non_persistent_dir: str | None) -> None:
    """``ValueError`` naming both flags when ``--non-persistent-ckpt-dir`` is ``--save``, inside
    it (other than the default ``<save>/non_persistent``) or holds it: the two retentions and
    leftover clean-ups would then work on each other's checkpoints."""
    if save_dir is None or non_persistent_dir is None:
        return
    save, np_dir = os.path.realpath(save_dir), os.path.realpath(non_persistent_dir)
    if np_dir == os.path.join(save, NON_PERSISTENT_SUBDIR):
        return
    if np_dir == save:
        relation = "is the same directory as"
    elif np_dir.startswith(save + os.sep):
        relation = "is inside"
    elif save.startswith(np_dir + os.sep):
        relation = "contains"
    else:
        return
    raise ValueError(
        f"--non-persistent-ckpt-dir {non_persistent_dir} {relation} --save {save_dir}: "
        "non-persistent retention would delete persistent checkpoints; use a separate "
        f"directory (or leave it unset for {os.path.join(save_dir, NON_PERSISTENT_SUBDIR)})"
    )


def read_tracker(root: str) -> int | None:
    """The iteration in ``<root>/latest_checkpointed_iteration.txt``; None when the file is absent.

    Raises:
        CheckpointError: the file exists but does not hold a non-negative integer (Megatron's
            ``release`` marker included: release checkpoints are not supported).
    """
    try:
        return tracker_iteration(root)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from exc.__cause__


def link_problem(root: str, flag: str, own_root: bool) -> str | None:
    """Why a save into ``root`` would replace or delete a symbolic link stalwart did not make:
    the tracker is one, or ``root`` is (when stalwart creates ``root`` itself, as the default
    ``<save>/non_persistent``); None when there is no such link."""
    tracker = os.path.join(root, TRACKER_FILENAME)
    if own_root and os.path.islink(root):
        return (
            f"{root} (under {flag}) is a symbolic link; stalwart creates that directory itself "
            "and never saves or deletes through a link: remove it, or pass "
            "--non-persistent-ckpt-dir"
        )
    if os.path.islink(tracker):
        return (
            f"{flag}: the checkpoint tracker {tracker} is a symbolic link; stalwart never "
            "replaces a link it did not make: remove it"
        )
    return None


def write_tracker_atomic(root: str, iteration: int) -> None:
    """Point ``<root>/latest_checkpointed_iteration.txt`` at ``iteration`` atomically."""
    if iteration < 0:
        raise ValueError(f"checkpoint iteration must be >= 0, got {iteration}")
    write_text_atomic(os.path.join(root, TRACKER_FILENAME), f"{iteration}\n")


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, COMPLETE_MARKER))


def list_complete_checkpoints(root: str) -> list[int]:
    """Iterations of the complete checkpoints under ``root``, ascending (empty if ``root`` is
    absent)."""
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


MARKER_MANIFEST_KEY = "manifest_crc32"  # the checksum manifest's own CRC-32 (see integrity)


def marker_text(facts: dict[str, Any], manifest_crc: str | None = None) -> str:
    """The ``COMPLETE`` marker of ``facts`` (``metadata.json``'s) and its manifest's CRC-32."""
    body = facts if manifest_crc is None else {**facts, MARKER_MANIFEST_KEY: manifest_crc}
    return json.dumps(body, sort_keys=True) + "\n"


def write_marker(path: str, facts: dict[str, Any], manifest_crc: str | None = None) -> None:
    """Write the completeness marker of a fully written checkpoint directory."""
    write_text_atomic(os.path.join(path, COMPLETE_MARKER), marker_text(facts, manifest_crc))


def written_as(path: str, non_persistent: bool) -> bool:
    """Whether the ``COMPLETE`` marker of ``path`` says a save of this kind (persistent or
    non-persistent) wrote it: retention deletes only those (an unreadable marker: never)."""
    try:
        with open_regular(os.path.join(path, COMPLETE_MARKER)) as f:
            facts = json.loads(f.read(1 << 16))
    except (OSError, ValueError):
        return False
    return isinstance(facts, dict) and facts.get("non_persistent") is non_persistent


def remove_checkpoint_dir(path: str, log: Any) -> bool:
    """Delete a checkpoint directory, marker first so that a half-deleted one is never 'complete'.

    Never through a symbolic link: a ``path`` that is one (stalwart never makes links) is left
    alone with one warning on ``log``. Returns whether ``path`` is gone.
    """
    refused = remove_own_tree(path, first=COMPLETE_MARKER)
    if refused is not None:
        log.warning("%s", refused)
    return refused is None


def check_files(path: str) -> str | None:
    """Cheap integrity check of a checkpoint directory without reading tensor data.

    Returns:
        None when the directory looks loadable, else a short description of what is wrong
        (missing directory/marker/metadata, or a DCP shard shorter than its metadata says).
    """
    if not os.path.isdir(path):
        return "directory is missing"
    if not is_complete(path):
        return f"completeness marker {COMPLETE_MARKER} is missing (save did not finish)"
    if is_legacy(path):
        return convert_hint(path)
    for name in (DCP_METADATA_FILENAME, COMMON_FILENAME):
        if not os.path.isfile(os.path.join(path, name)):
            return f"file {name} is missing"
    return _check_shard_sizes(path)


def is_legacy(path: str) -> bool:
    """A checkpoint of stalwart before JSON state files (``common.pt`` pickle, no
    ``common.json``)."""
    return os.path.isfile(os.path.join(path, LEGACY_COMMON_FILENAME)) and not os.path.exists(
        os.path.join(path, COMMON_FILENAME)
    )


def _check_shard_sizes(path: str) -> str | None:
    """Compare each DCP shard's size with the byte ranges recorded in ``.metadata`` (read with
    the restricted unpickler: nothing in it can run)."""
    from stalwart.checkpoint.dcp_safe import read_dcp_metadata

    try:
        metadata = read_dcp_metadata(path)
    except CheckpointError as exc:
        return str(exc)
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


def apply_retention(root: str, keep: int, non_persistent: bool, log: Any) -> list[int]:
    """Delete all but the newest ``keep`` complete checkpoints under ``root`` that this kind of
    save wrote (their marker says so; never the tracked one); returns the deleted iterations.
    Failures only warn via ``log`` (the new checkpoint is already committed)."""
    try:
        ours = [
            it
            for it in list_complete_checkpoints(root)
            if written_as(os.path.join(root, iteration_dir_name(it)), non_persistent)
        ]
        doomed = [
            old
            for old in select_for_deletion(ours, keep, read_tracker(root))
            if remove_checkpoint_dir(os.path.join(root, iteration_dir_name(old)), log)
        ]
    except (OSError, CheckpointError) as exc:
        log.warning("checkpoint retention in %s failed: %s", root, exc)
        return []
    if doomed:
        log.info("retention removed checkpoints %s from %s", doomed, root)
    return doomed


def write_state_fsynced(obj: Any, path: str) -> None:
    """``obj`` as `safe_state` JSON, fsynced, so the file is durable before the completeness
    marker is written (atomic: a reader never sees half of it).

    Raises:
        StateFormatError: naming the value that cannot be stored.
    """
    from stalwart.checkpoint.safe_state import dumps_state

    write_text_atomic(path, dumps_state(obj, os.path.basename(path)))


def save_failure_message(what: str, root: str, details: str) -> str:
    """One line for a failed save: ``"<what> failed: <OS cause> (<details>)"``.

    torch's writers report a full disk (ENOSPC), a quota (EDQUOT) or a file-size limit (EFBIG)
    only as a short-write assertion ("unexpected pos N vs M"); a probe write of 1 MiB into
    ``root`` names the OS cause, which leads the line. Without one, the details are the cause.
    """
    cause = _probe_write(root)
    if cause is None:
        return f"{what} failed: {details}"
    return f"{what} failed: the checkpoint directory {root} rejects writes: {cause} ({details})"


def _probe_write(root: str) -> str | None:
    probe = None
    try:
        fd, probe = create_exclusive(root, ".write_probe_")  # a new file: never a planted link
        with os.fdopen(fd, "wb") as f:
            f.write(bytes(1 << 20))
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        return str(exc.strerror or exc)
    finally:
        if probe is not None:
            with contextlib.suppress(OSError):
                os.unlink(probe)
    return None
