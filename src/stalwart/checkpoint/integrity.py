"""Is a checkpoint directory loadable? The one check that a resume and ``stalwart checkpoints
--verify`` both run, and the checksum manifest that lets it catch flipped bytes.

`check_checkpoint` applies, without reading a tensor, every check a resume applies before it
loads: the directory and its ``COMPLETE`` marker, the pickle format of an older stalwart, the
DCP ``.metadata`` (restricted unpickler) and every shard as long as it says, ``metadata.json``
(a saved world size), ``common.json`` and every saved rank's ``rank_XXXXX.json`` (JSON state
holding a dict). With ``checksums=True`` (``--verify``, ``--verify-checkpoint-on-load``) it also
checks every file against the manifest.

The manifest, ``checksums.json``, is written at save time after every rank's files are on disk
and before the ``COMPLETE`` marker: the size and CRC-32 of every file of the checkpoint (CRC-32
runs at several GB/s and releases the GIL; it is a check against corruption, not against an
attacker who rewrites the manifest too). During an async save rank 0 computes it on a
background thread, after the DCP write. The marker records the manifest's own CRC-32 and is
itself the canonical rendering of ``metadata.json``'s facts plus that CRC, so a changed byte
in any file, marker and manifest included, is caught. A file in the directory that the
manifest does not list is refused too (a resume could read it). Checkpoints of an older
stalwart (or saved with checksums off) have no manifest: they load, and `CheckResult.note`
says their files were not checked.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import stat
import zlib
from dataclasses import dataclass
from typing import Any

from stalwart.atomic_file import Sync, write_text_atomic
from stalwart.checkpoint import layout
from stalwart.checkpoint.safe_state import StateFormatError, read_state_file
from stalwart.regular_file import open_regular

MANIFEST_FILENAME = "checksums.json"
MANIFEST_FORMAT = "stalwart-checksums-v1"
MARKER_KEY = layout.MARKER_MANIFEST_KEY  # in the COMPLETE marker: the manifest's own CRC-32
_MAX_MANIFEST_BYTES = 64 << 20  # ~1M files; a bigger one is refused before it is parsed
_MAX_MARKER_BYTES = 1 << 16
_CHUNK = 8 << 20
BLOCK_BYTES = 64 << 20  # one CRC-32 per 64 MiB block of a file: blocks are hashed in parallel
_MAX_THREADS = 8
_CRC_RE = re.compile(r"^[0-9a-f]{8}$")
_DIGEST_RE = re.compile(r"^[0-9a-f]{8}(-[0-9a-f]{8})*$")
_UNLISTED = frozenset({MANIFEST_FILENAME, layout.COMPLETE_MARKER})


@dataclass(frozen=True)
class CheckResult:
    """``problem``: why a resume refuses the checkpoint (None: loadable); ``note``: what was
    not checked (an older checkpoint without a manifest)."""

    problem: str | None
    note: str | None = None


def crc32_file(path: str) -> tuple[int, str]:
    """(size, CRC-32 as 8 hex digits) of a small regular file (the manifest itself)."""
    with open_regular(path) as f:
        data = f.read()
    return len(data), f"{zlib.crc32(data):08x}"


def _block_crc(path: str, offset: int, length: int) -> int:
    crc = 0
    with open_regular(path) as f:
        f.seek(offset)
        while length > 0 and (chunk := f.read(min(_CHUNK, length))):
            crc = zlib.crc32(chunk, crc)
            length -= len(chunk)
    return crc


def digests(paths: list[str]) -> dict[str, tuple[int, str]]:
    """``{path: (size, digest)}``: the digest is the CRC-32 of each 64 MiB block of the file,
    as 8 hex digits joined by ``-``. Blocks of every file are hashed on up to 8 threads
    (``zlib.crc32`` releases the GIL), so one big shard does not take one core's time.

    Raises:
        OSError: a file is missing, unreadable or not a regular file.
    """
    sizes = {}
    for path in paths:
        with open_regular(path) as f:
            sizes[path] = os.fstat(f.fileno()).st_size
    blocks = [
        (p, off, min(BLOCK_BYTES, n - off))
        for p, n in sizes.items()
        for off in range(0, max(n, 1), BLOCK_BYTES)
    ]
    threads = max(1, min(_MAX_THREADS, os.cpu_count() or 1, len(blocks)))
    with concurrent.futures.ThreadPoolExecutor(threads, "stalwart-crc") as pool:
        crcs = list(pool.map(lambda b: _block_crc(*b), blocks))
    joined: dict[str, list[str]] = {p: [] for p in paths}
    for (path, _, _), crc in zip(blocks, crcs, strict=True):
        joined[path].append(f"{crc:08x}")
    return {p: (sizes[p], "-".join(joined[p])) for p in paths}


def _listed_files(path: str) -> list[str]:
    """Relative paths (``/``-separated) of every entry under ``path`` that a manifest covers."""
    found = []
    for root, dirs, names in os.walk(path):  # never follows a link
        rel_root = os.path.relpath(root, path)
        for name in names + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            rel = name if rel_root == "." else f"{rel_root}/{name}".replace(os.sep, "/")
            if rel not in _UNLISTED:
                found.append(rel)
    return sorted(found)


def write_manifest(path: str) -> None:
    """Write ``<path>/checksums.json`` over every file of the checkpoint directory ``path``
    (run once every rank's files are written, before the marker)."""
    names = _listed_files(path)
    found = digests([os.path.join(path, rel) for rel in names])
    files = {rel: list(found[os.path.join(path, rel)]) for rel in names}
    body = {
        "format": MANIFEST_FORMAT,
        "algorithm": "crc32",
        "block_bytes": BLOCK_BYTES,
        "files": files,
    }
    text = json.dumps(body, indent=0, sort_keys=True) + "\n"
    write_text_atomic(os.path.join(path, MANIFEST_FILENAME), text)


def manifest_crc(path: str) -> str | None:
    """The CRC-32 of ``<path>/checksums.json`` for the marker; None when there is none."""
    manifest = os.path.join(path, MANIFEST_FILENAME)
    return crc32_file(manifest)[1] if os.path.exists(manifest) else None


def saved_world_size(path: str) -> int:
    """The world size in ``<path>/metadata.json``; ``StateFormatError`` when there is none."""
    facts = read_state_file(os.path.join(path, layout.METADATA_FILENAME))
    world = facts.get("world_size") if isinstance(facts, dict) else None
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise StateFormatError(f"{layout.METADATA_FILENAME}: world_size must be an integer >= 1")
    return world


def read_state_dict(path: str) -> dict[str, Any]:
    """A JSON state file that must hold a dict (``common.json``, ``rank_XXXXX.json``)."""
    state = read_state_file(path)
    if not isinstance(state, dict):
        raise StateFormatError(f"{path}: holds a {type(state).__name__}, not a dict")
    return state


def check_checkpoint(path: str, *, checksums: bool) -> CheckResult:
    """Every check a resume applies to ``path`` before reading tensors (module docstring);
    with ``checksums``, every file against the manifest too. Never raises for bad content."""
    problem = layout.check_files(path)
    if problem is not None:
        return CheckResult(problem)
    try:
        world = saved_world_size(path)
        read_state_dict(os.path.join(path, layout.COMMON_FILENAME))
        for rank in range(world):
            read_state_dict(os.path.join(path, layout.rank_filename(rank)))
    except (OSError, StateFormatError) as exc:
        return CheckResult(f"unreadable state: {exc}")
    return _check_checksums(path) if checksums else CheckResult(None)


def _read_marker(path: str) -> tuple[bytes, dict[str, Any]]:
    with open_regular(os.path.join(path, layout.COMPLETE_MARKER)) as f:
        raw = f.read(_MAX_MARKER_BYTES + 1)
    facts = json.loads(raw) if len(raw) <= _MAX_MARKER_BYTES else None
    if not isinstance(facts, dict):
        raise ValueError("not a JSON object of at most 64 KiB")
    return raw, facts


def _check_checksums(path: str) -> CheckResult:
    manifest = os.path.join(path, MANIFEST_FILENAME)
    try:
        raw_marker, marker = _read_marker(path)
    except (OSError, ValueError) as exc:
        return CheckResult(f"marker {layout.COMPLETE_MARKER} is unreadable: {exc}")
    recorded = marker.get(MARKER_KEY)
    if recorded is None and not os.path.lexists(manifest):
        note = (
            f"no {MANIFEST_FILENAME} (saved by an older stalwart or with checksums off): "
            "its files were not checked against checksums"
        )
        return CheckResult(None, note)
    entries = _trusted_entries(path, raw_marker, recorded)
    if isinstance(entries, str):
        return CheckResult(entries)
    return CheckResult(_check_files_against(path, entries))


def _trusted_entries(
    path: str, raw_marker: bytes, recorded: Any
) -> dict[str, tuple[int, str]] | str:
    """The manifest's entries once marker, ``metadata.json`` and manifest agree (only the
    manifest is hashed); else why not."""
    manifest = os.path.join(path, MANIFEST_FILENAME)
    if not isinstance(recorded, str) or not _CRC_RE.match(recorded):
        marker = layout.COMPLETE_MARKER
        return f"{MANIFEST_FILENAME} is there but marker {marker} records no checksum of it"
    try:
        if crc32_file(manifest)[1] != recorded:
            return f"{MANIFEST_FILENAME} does not match the checksum in the marker"
        expected = layout.marker_text(json.loads(_small(path, layout.METADATA_FILENAME)), recorded)
    except FileNotFoundError:
        return f"{MANIFEST_FILENAME} is missing (the marker records one)"
    except (OSError, ValueError, TypeError) as exc:
        return f"cannot check the checksums: {exc}"
    entries = _parse_manifest(manifest)
    if isinstance(entries, str):
        return entries
    if raw_marker != expected.encode("utf-8"):
        return f"marker {layout.COMPLETE_MARKER} does not match metadata.json and the manifest"
    return entries


def manifest_entries(path: str) -> dict[str, tuple[int, str]] | str:
    """``{relative path: (size, digest)}`` of the manifest of ``path``, once its marker,
    ``metadata.json`` and manifest agree, and every file of the directory is listed there as a
    regular file of that size (no file is hashed: see :func:`digest_bytes`); else why not. A
    directory without a manifest has none to trust: refused."""
    try:
        raw_marker, marker = _read_marker(path)
    except (OSError, ValueError) as exc:
        return f"marker {layout.COMPLETE_MARKER} is unreadable: {exc}"
    entries = _trusted_entries(path, raw_marker, marker.get(MARKER_KEY))
    if isinstance(entries, str):
        return entries
    problem = _check_listing(path, entries)
    if problem is not None:
        return problem
    for rel, (size, _) in entries.items():
        try:
            actual = os.lstat(os.path.join(path, rel)).st_size
        except OSError as exc:
            return f"file {rel} is unreadable: {exc.strerror or exc}"
        if actual != size:
            return f"file {rel} has {actual} bytes, {MANIFEST_FILENAME} says {size}"
    return entries


def _blocks(parts: tuple[bytes | bytearray | memoryview, ...]) -> list[list[memoryview]]:
    """The 64 MiB blocks of ``parts`` joined, each as the slices of the parts it spans."""
    blocks: list[list[memoryview]] = [[]]
    filled = 0
    for part in parts:
        view = memoryview(part).cast("B")
        while len(view):
            take = min(BLOCK_BYTES - filled, len(view))
            blocks[-1].append(view[:take])
            filled, view = filled + take, view[take:]
            if filled == BLOCK_BYTES:
                blocks.append([])
                filled = 0
    return blocks if blocks[-1] or len(blocks) == 1 else blocks[:-1]


def _crc_of(slices: list[memoryview]) -> int:
    crc = 0
    for piece in slices:
        crc = zlib.crc32(piece, crc)
    return crc


def digest_bytes(*parts: bytes | bytearray | memoryview, threads: int = 1) -> str:
    """The manifest's digest of a file whose bytes are ``parts`` joined, computed in memory
    (a CRC-32 per 64 MiB block across the parts, as `digests` reads them from disk), the blocks
    on up to ``threads`` threads (``zlib.crc32`` releases the GIL)."""
    blocks = _blocks(parts)
    workers = max(1, min(threads, len(blocks), _MAX_THREADS))
    if workers == 1:
        crcs = [_crc_of(b) for b in blocks]
    else:
        with concurrent.futures.ThreadPoolExecutor(workers, "stalwart-crc") as pool:
            crcs = list(pool.map(_crc_of, blocks))
    return "-".join(f"{c:08x}" for c in crcs)


def write_manifest_entries(path: str, files: dict[str, tuple[int, str]]) -> None:
    """Write ``<path>/checksums.json`` of digests computed in memory (:func:`digest_bytes`)
    instead of reading the files back (a local checkpoint's shard: its bytes are at hand)."""
    listed = {rel: list(entry) for rel, entry in sorted(files.items())}
    body = {"format": MANIFEST_FORMAT, "algorithm": "crc32", "block_bytes": BLOCK_BYTES}
    text = json.dumps({**body, "files": listed}, indent=0, sort_keys=True) + "\n"
    write_text_atomic(os.path.join(path, MANIFEST_FILENAME), text, sync=Sync.NONE)


def _small(path: str, name: str) -> bytes:
    with open_regular(os.path.join(path, name)) as f:
        return f.read(_MAX_MARKER_BYTES + 1)


def _parse_manifest(manifest: str) -> dict[str, tuple[int, str]] | str:
    """The manifest's ``{relative path: (size, crc)}``, or why it is malformed."""
    try:
        with open_regular(manifest) as f:
            raw = f.read(_MAX_MANIFEST_BYTES + 1)
        if len(raw) > _MAX_MANIFEST_BYTES:
            return f"{MANIFEST_FILENAME} is larger than {_MAX_MANIFEST_BYTES} bytes"
        body = json.loads(raw)
    except (OSError, ValueError, RecursionError) as exc:
        return f"{MANIFEST_FILENAME} is unreadable: {type(exc).__name__}"
    files = body.get("files") if isinstance(body, dict) else None
    if (
        not isinstance(body, dict)
        or body.get("format") != MANIFEST_FORMAT
        or not isinstance(files, dict)
    ):
        return f"{MANIFEST_FILENAME} is not a {MANIFEST_FORMAT} manifest"
    entries: dict[str, tuple[int, str]] = {}
    for rel, value in files.items():
        if not _safe_relative(rel) or not _entry_ok(value):
            return f"{MANIFEST_FILENAME} has a malformed entry {str(rel)[:80]!r}"
        entries[rel] = (value[0], value[1])
    return entries


def _safe_relative(rel: Any) -> bool:
    parts = rel.split("/") if isinstance(rel, str) else [""]
    return rel not in _UNLISTED and all(p not in ("", ".", "..") and "\\" not in p for p in parts)


def _entry_ok(value: Any) -> bool:
    return (
        isinstance(value, list)
        and len(value) == 2
        and isinstance(value[0], int)
        and not isinstance(value[0], bool)
        and value[0] >= 0
        and isinstance(value[1], str)
        and _DIGEST_RE.match(value[1]) is not None
        and value[1].count("-") + 1 == max(1, -(-value[0] // BLOCK_BYTES))
    )


def _check_listing(path: str, entries: dict[str, tuple[int, str]]) -> str | None:
    """Every file under ``path`` is in the manifest, every entry a regular file."""
    unlisted = sorted(set(_listed_files(path)) - set(entries))
    if unlisted:
        return f"file {unlisted[0]} is not in {MANIFEST_FILENAME} (not written by this save)"
    for rel in sorted(entries):
        try:
            if not stat.S_ISREG(os.lstat(os.path.join(path, rel)).st_mode):
                return f"{rel} is not a regular file"
        except FileNotFoundError:
            return f"file {rel} is missing (listed in {MANIFEST_FILENAME})"
        except OSError as exc:
            return f"file {rel} is unreadable: {exc.strerror or exc}"
    return None


def _check_files_against(path: str, entries: dict[str, tuple[int, str]] | str) -> str | None:
    if isinstance(entries, str):
        return entries
    problem = _check_listing(path, entries)
    if problem is not None:
        return problem
    try:
        found = digests([os.path.join(path, rel) for rel in sorted(entries)])
    except OSError as exc:
        return f"a file is unreadable: {exc.strerror or exc}"
    for rel, (size, digest) in sorted(entries.items()):
        actual = found[os.path.join(path, rel)]
        if actual[0] != size:
            return f"file {rel} has {actual[0]} bytes, {MANIFEST_FILENAME} says {size}"
        if actual[1] != digest:
            block = next(
                i for i, (a, b) in enumerate(zip(actual[1].split("-"), digest.split("-"))) if a != b
            )
            return f"file {rel} does not match its checksum (CRC-32 of its 64 MiB block {block})"
    return None
