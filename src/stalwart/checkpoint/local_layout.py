"""Node-local checkpoint directories (``--non-persistent-local-ckpt-dir``): where a rank stores,
the atomic write of one shard, the scan a resume starts from, retention.

Layout of one node's directory::

    <dir>/.stalwart.lock                     one job per directory (held by the node's first rank)
    <dir>/rank_00003/                        what rank 3 stores: its own shards and its peers'
        iter_0000040/
            shard_00003/                     rank 3's shard of iteration 40
                shard.bin                    `stalwart.checkpoint.shard_format` bytes
                metadata.json, checksums.json, COMPLETE   as every stalwart checkpoint
            shard_00001/                     a replica of rank 1's shard (its clique's)
            shard_00001.tmp-<token>/         a write in progress or a crashed one: never read

A shard directory is written under a temporary name and renamed into place; its marker is the
canonical rendering of ``metadata.json`` plus the CRC-32 of its checksum manifest (see
`stalwart.checkpoint.integrity`), whose digests are computed from the bytes in memory. Nothing
is fsynced: a local copy protects against a process that dies (the page cache survives it); a
node that dies takes its copies along, and the replicas on other nodes cover that.

Inside ``<dir>`` stalwart makes every directory itself, so a symbolic link there is never
followed: the scan skips it with a warning and a save refuses to write through it. ``<dir>``
itself may be a link (a scratch path pointing at the node's NVMe).

Fake nodes for tests on one machine: ``STALWART_FAKE_NODE_SIZE=R`` puts ranks ``nR .. nR+R-1``
on fake node ``n``, whose directory is ``<dir>/fake_node_<n>`` (and ``R`` is the default
``--replication-jump``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import json
import logging
import os
import re
import stat
import time
from dataclasses import dataclass
from typing import Any, cast

import torch

from stalwart.checkpoint import integrity, layout
from stalwart.checkpoint.errors import CheckpointError
from stalwart.checkpoint.shard_format import tensor_bytes
from stalwart.distributed.launch_env import env_int
from stalwart.iteration_dirs import iteration_dir_name
from stalwart.regular_file import open_regular, remove_own_tree

LOCAL_FORMAT = "stalwart-local-v1"
SHARD_FILE = "shard.bin"
FAKE_NODE_ENV = "STALWART_FAKE_NODE_SIZE"
LOCAL_FLAG = "--non-persistent-local-ckpt-dir"
_RANK_RE = re.compile(r"^rank_(\d{5,})$")
_SHARD_RE = re.compile(r"^shard_(\d{5,})$")
_MAX_SHARD_BYTES = 1 << 44
_CRC_THREADS = min(8, os.cpu_count() or 1)


@dataclass(frozen=True)
class NodePlace:
    """Where this rank keeps its local copies: ``root`` (its node's directory), its node index,
    its rank on the node and the ranks per node."""

    root: str
    node: int
    local_rank: int
    ranks_per_node: int
    fake: bool = False  # a test's fake node: stalwart makes ``root`` itself

    @classmethod
    def from_env(cls, local_dir: str, rank: int, world_size: int) -> NodePlace:
        """From torchrun's ``LOCAL_RANK``/``LOCAL_WORLD_SIZE``/``GROUP_RANK``, or fake nodes
        (``STALWART_FAKE_NODE_SIZE``; module docstring). ``ValueError`` naming a bad variable."""
        fake = env_int(FAKE_NODE_ENV, 0, maximum=world_size)
        if fake:
            if world_size % fake:
                raise ValueError(
                    f"environment variable {FAKE_NODE_ENV}={fake}: must divide the world "
                    f"size ({world_size})"
                )
            root = os.path.join(local_dir, f"fake_node_{rank // fake}")
            return cls(root, rank // fake, rank % fake, fake, fake=True)
        per_node = env_int("LOCAL_WORLD_SIZE", world_size, minimum=1, maximum=world_size)
        local_rank = env_int("LOCAL_RANK", rank % per_node, maximum=per_node - 1)
        node = env_int("GROUP_RANK", rank // per_node)
        return cls(local_dir, node, local_rank, per_node)

    def rank_dir(self, rank: int) -> str:
        return os.path.join(self.root, f"rank_{rank:05d}")


@dataclass(frozen=True)
class FoundShard:
    """A complete shard directory the scan found: what its ``metadata.json`` says, and where."""

    iteration: int
    owner: int
    world_size: int
    algo: str
    save_id: str
    sharded: bool
    job: str
    path: str


_FACT_KEYS = ("iteration", "owner", "world_size", "algo", "save_id", "sharded", "job")


def shard_facts(
    iteration: int, owner: int, world_size: int, algo: str, save_id: str, sharded: bool, job: str
) -> dict[str, Any]:
    """A shard's ``metadata.json`` (and marker) facts; ``job`` names the job whose copies they
    are (its ``--save``): a job never resumes from, or deletes, another's."""
    return {
        "format": LOCAL_FORMAT,
        "iteration": iteration,
        "owner": owner,
        "world_size": world_size,
        "algo": algo,
        "save_id": save_id,
        "sharded": sharded,
        "job": job,
    }


def _real_dir(path: str) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def ensure_own_dir(path: str) -> None:
    """Create ``path`` (one level) unless it exists as a real directory; ``CheckpointError``
    when it is a link or anything else (stalwart never writes through one)."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path)
    if not _real_dir(path):
        raise CheckpointError(
            f"{LOCAL_FLAG}: {path} is a symbolic link or not a directory; stalwart makes every "
            "directory there itself and never writes through a link: remove it"
        )


def ensure_node_root(place: NodePlace) -> None:
    """Create the node's directory (the flag's, which may be a link; a fake node's is made
    here, never through a link)."""
    if not place.fake:
        os.makedirs(place.root, exist_ok=True)
        return
    os.makedirs(os.path.dirname(place.root), exist_ok=True)
    ensure_own_dir(place.root)


def write_shard(rank_dir: str, facts: dict[str, Any], header: bytes, data: torch.Tensor) -> str:
    """Write one shard directory atomically under ``rank_dir`` (created before: see
    :func:`ensure_own_dir`); returns its final path."""
    iter_dir = os.path.join(rank_dir, iteration_dir_name(facts["iteration"]))
    ensure_own_dir(iter_dir)
    name = f"shard_{facts['owner']:05d}"
    tmp = os.path.join(iter_dir, f"{name}{layout.TMP_INFIX}{os.getpid()}-{os.urandom(4).hex()}")
    os.mkdir(tmp)
    try:
        payload = tensor_bytes(data) if data.numel() else memoryview(b"")
        with concurrent.futures.ThreadPoolExecutor(1, "stalwart-local-crc") as crc:
            # The checksums of the bytes in memory, on other threads, while they are written.
            digest = crc.submit(integrity.digest_bytes, header, payload, threads=_CRC_THREADS)
            _write_new(os.path.join(tmp, SHARD_FILE), header, payload)
            shard_digest = digest.result()
        meta = json.dumps(facts, indent=2) + "\n"
        with open(os.path.join(tmp, layout.METADATA_FILENAME), "x", encoding="utf-8") as f:
            f.write(meta)
        integrity.write_manifest_entries(
            tmp,
            {
                SHARD_FILE: (len(header) + len(payload), shard_digest),
                layout.METADATA_FILENAME: (
                    len(meta.encode()),
                    integrity.digest_bytes(meta.encode()),
                ),
            },
        )
        layout.write_marker(tmp, facts, integrity.manifest_crc(tmp))
        return _publish(tmp, os.path.join(iter_dir, name))
    except BaseException:
        remove_own_tree(tmp)
        raise


def _write_new(path: str, *parts: bytes | memoryview) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    with os.fdopen(fd, "wb") as f:
        for part in parts:
            f.write(part)


def _publish(tmp: str, final: str) -> str:
    aside = None
    if os.path.lexists(final):  # the same iteration saved again (after a resume): old aside
        aside = f"{tmp}-replaced"
        os.replace(final, aside)
    os.replace(tmp, final)
    if aside is not None:
        remove_own_tree(aside)
    return final


def _facts(path: str) -> FoundShard | str:
    entries = integrity.manifest_entries(path)
    if isinstance(entries, str):
        return entries
    if set(entries) != {SHARD_FILE, layout.METADATA_FILENAME}:
        return f"it holds {sorted(entries)}, not {SHARD_FILE} and {layout.METADATA_FILENAME}"
    try:
        with open_regular(os.path.join(path, layout.METADATA_FILENAME)) as f:
            facts = json.loads(f.read(1 << 16))
        found = FoundShard(**{k: facts[k] for k in _FACT_KEYS}, path=path)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{layout.METADATA_FILENAME} is unreadable ({type(exc).__name__})"
    ints = (found.iteration, found.owner, found.world_size)
    if facts.get("format") != LOCAL_FORMAT or not all(type(i) is int and i >= 0 for i in ints):
        return f"{layout.METADATA_FILENAME} is not a {LOCAL_FORMAT} shard's"
    if found.owner >= found.world_size:
        return f"{layout.METADATA_FILENAME} names owner {found.owner} of {found.world_size} ranks"
    if not isinstance(found.save_id, str) or not isinstance(found.job, str):
        return f"{layout.METADATA_FILENAME} has a malformed save_id or job field"
    if not isinstance(found.algo, str) or not isinstance(found.sharded, bool):
        return f"{layout.METADATA_FILENAME} has a malformed algo or sharded field"
    return found


def _children(path: str, pattern: re.Pattern[str], log: logging.Logger) -> list[tuple[int, str]]:
    """``(number, path)`` of the real directories under ``path`` named by ``pattern``."""
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return []
    found = []
    for name in names:
        match = pattern.match(name)
        if match is None:
            continue
        child = os.path.join(path, name)
        if not _real_dir(child):
            log.warning("local checkpoint: skipping %s: a symbolic link or not a directory", child)
            continue
        found.append((int(match.group(1)), child))
    return found


_ITER_RE = re.compile(r"^iter_(\d{7,})$")


def rank_dirs(root: str, log: logging.Logger) -> list[tuple[int, str]]:
    """``(rank, path)`` of every rank directory under a node's directory, ascending."""
    return _children(root, _RANK_RE, log)


def scan(rank_dir: str, log: logging.Logger) -> list[FoundShard]:
    """Every complete, consistent shard under ``rank_dir`` (its bytes are hashed when read);
    each one skipped says why in one warning."""
    found = []
    for iteration, iter_dir in _children(rank_dir, _ITER_RE, log):
        for owner, shard_dir in _children(iter_dir, _SHARD_RE, log):
            facts = _facts(shard_dir)
            if isinstance(facts, str):
                log.warning("local checkpoint %s is unusable: %s", shard_dir, facts)
            elif (facts.iteration, facts.owner) != (iteration, owner):
                log.warning(
                    "local checkpoint %s is unusable: its metadata names another iteration or rank",
                    shard_dir,
                )
            else:
                found.append(facts)
    return found


def read_shard(path: str) -> bytearray:
    """``shard.bin`` of a shard directory, checked against its manifest (size and CRC-32).

    Raises:
        CheckpointError: naming the directory and what is wrong.
    """
    entries = integrity.manifest_entries(path)
    if isinstance(entries, str):
        raise CheckpointError(f"local checkpoint {path} is unusable: {entries}")
    size, digest = entries.get(SHARD_FILE, (-1, ""))
    if not 0 <= size <= _MAX_SHARD_BYTES:
        raise CheckpointError(f"local checkpoint {path} is unusable: no {SHARD_FILE}")
    data = bytearray(size)
    try:
        with open_regular(os.path.join(path, SHARD_FILE)) as f:
            got = cast(io.BufferedReader, f).readinto(data)
    except OSError as exc:
        raise CheckpointError(
            f"local checkpoint {path}: {SHARD_FILE} is unreadable: {exc}"
        ) from exc
    if got != size or integrity.digest_bytes(data, threads=_CRC_THREADS) != digest:
        raise CheckpointError(f"local checkpoint {path}: {SHARD_FILE} does not match its checksum")
    return data


def remove_leftovers(rank_dir: str, log: logging.Logger) -> None:
    """Remove crashed writes (``shard_*.tmp-*``) of every iteration under ``rank_dir``."""
    for _, iter_dir in _children(rank_dir, _ITER_RE, log):
        with contextlib.suppress(OSError):
            for name in os.listdir(iter_dir):
                if name.startswith("shard_") and layout.TMP_INFIX in name:
                    remove_own_tree(os.path.join(iter_dir, name))


def prune(rank_dir: str, newest: int, job: str, log: logging.Logger) -> list[int]:
    """Retention: remove this job's shards of the iterations older than ``newest`` (complete on
    every rank) under ``rank_dir``, and the iterations left empty; never through a link, never
    another job's copies. Returns the iterations removed."""
    removed = []
    for iteration, iter_dir in _children(rank_dir, _ITER_RE, log):
        if iteration >= newest:
            continue
        for _, shard_dir in _children(iter_dir, _SHARD_RE, log):
            facts = _facts(shard_dir)
            if isinstance(facts, str) or facts.job == job:  # ours, or garbage under our lock
                _remove(shard_dir, log)
        remaining = [n for n in os.listdir(iter_dir) if _SHARD_RE.match(n)]
        if not remaining and _remove(iter_dir, log):
            removed.append(iteration)
    return removed


def _remove(path: str, log: logging.Logger) -> bool:
    refused = remove_own_tree(path)
    if refused is not None:
        log.warning("%s", refused)
    return refused is None


def save_token() -> str:
    """A token that names one job session's saves (agreed across ranks by the caller)."""
    return f"{time.strftime('%Y%m%d%H%M%S')}-{os.getpid()}-{os.urandom(4).hex()}"


__all__ = [
    "FAKE_NODE_ENV",
    "LOCAL_FORMAT",
    "SHARD_FILE",
    "FoundShard",
    "NodePlace",
    "ensure_node_root",
    "ensure_own_dir",
    "prune",
    "rank_dirs",
    "read_shard",
    "remove_leftovers",
    "save_token",
    "scan",
    "shard_facts",
    "write_shard",
]
