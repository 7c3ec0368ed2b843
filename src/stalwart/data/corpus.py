"""Embedded default corpus: the Python standard library's ``*.py`` sources as bytes (no download).

Layout: files under ``sysconfig.get_paths()["stdlib"]`` (skipping ``site-packages``,
``dist-packages`` and ``__pycache__``), in sorted POSIX relative-path order, each preceded by a
header line ``# file: <relative path>\\n``; whole files are taken in order until the next one
would exceed ``max_bytes``. Tokens are the bytes (uint8, vocabulary 256).

The built corpus is cached as ``corpus-py<major>.<minor>-<key>.npz`` under ``$STALWART_CACHE``
(default ``~/.cache/stalwart``), where ``key`` hashes the file listing (paths, sizes, mtimes)
and ``max_bytes``. The cache stores the content sha256 and is verified on every load; a missing,
unreadable or corrupt cache is rebuilt and rewritten atomically (temp file + ``os.replace``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
import sysconfig
import zipfile
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

import numpy as np

from stalwart.atomic_file import Sync, write_atomic

DEFAULT_CORPUS_MAX_BYTES = 16 * 1024 * 1024
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})

EXPECTED_CORPUS_SHA256: Mapping[str, str] = MappingProxyType(
    {
        # Default max_bytes. Measured on CPython 3.11.7 (pyenv build) and on the device
        # machine's 3.12.3; other patch releases or distro-patched stdlibs may differ.
        "3.11": "b529a2b63ffe9b86e54114ef05105a6ebe19058242a7dc9410893e90923eb15a",
        "3.12": "249b8dd5ce567e7a62947ba3b2d0f8a80638dacccfe252971aa91589d9bcb643",
    }
)
"""``"major.minor"`` -> sha256 of the default embedded corpus, for versions measured so far."""


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Corpus bytes and file boundaries.

    Attributes:
        tokens: uint8 [n] corpus bytes.
        file_offsets: int64 [num_files + 1], start offset of each file (header included), with
            ``file_offsets[-1] == n``.
    """

    tokens: np.ndarray
    file_offsets: np.ndarray

    def split_at_file_boundary(self, valid_fraction: float) -> int:
        """Offset of the first file boundary at or after ``(1 - valid_fraction) * n``.

        The returned offset ``k`` splits the corpus into a train prefix ``tokens[:k]`` and a
        held-out suffix ``tokens[k:]`` of whole files (roughly the last ``valid_fraction`` of
        bytes). Raises ``ValueError`` when no boundary leaves both sides non-empty.
        """
        n = int(self.tokens.shape[0])
        target = (1.0 - valid_fraction) * n
        inner = self.file_offsets[1:-1]
        candidates = inner[inner >= target]
        if candidates.size == 0:
            candidates = inner[-1:]
        if candidates.size == 0:
            raise ValueError("embedded corpus has a single file; cannot split off a validation set")
        return int(candidates[0])


def _stdlib_files(root: Path) -> list[tuple[str, Path]]:
    """Sorted ``(posix relative path, absolute path)`` of every eligible ``*.py`` file."""
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        for filename in filenames:
            if filename.endswith(".py"):
                path = Path(dirpath) / filename
                found.append((path.relative_to(root).as_posix(), path))
    found.sort(key=lambda item: item[0])
    return found


def _listing_key(files: list[tuple[str, Path]], max_bytes: int) -> str:
    digest = hashlib.sha256(f"max_bytes={max_bytes}\n".encode())
    for rel, path in files:
        stat = path.stat()
        digest.update(f"{rel}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:24]


def build_corpus(max_bytes: int = DEFAULT_CORPUS_MAX_BYTES, root: Path | None = None) -> Corpus:
    """Build the corpus from the stdlib at ``root`` (default: this interpreter's), uncached."""
    if max_bytes < 1:
        raise ValueError(f"corpus max_bytes must be >= 1, got {max_bytes}")
    stdlib = Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    chunks: list[bytes] = []
    offsets = [0]
    for rel, path in _stdlib_files(stdlib):
        try:
            body = path.read_bytes()
        except OSError:
            continue  # unreadable files are skipped; the listing key still changes with them
        chunk = f"# file: {rel}\n".encode() + body
        if offsets[-1] + len(chunk) > max_bytes:
            break
        chunks.append(chunk)
        offsets.append(offsets[-1] + len(chunk))
    if not chunks:
        raise ValueError(f"no standard-library *.py files found under {stdlib}")
    tokens = np.frombuffer(b"".join(chunks), dtype=np.uint8).copy()
    return Corpus(tokens=tokens, file_offsets=np.asarray(offsets, dtype=np.int64))


def _sha256(tokens: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(tokens).tobytes()).hexdigest()


def default_cache_dir() -> Path:
    """``$STALWART_CACHE`` if set, else ``~/.cache/stalwart``."""
    env = os.environ.get("STALWART_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "stalwart"


def _read_cache(path: Path) -> Corpus | None:
    try:
        with np.load(path, allow_pickle=False) as archive:
            tokens = np.asarray(archive["tokens"], dtype=np.uint8)
            offsets = np.asarray(archive["file_offsets"], dtype=np.int64)
            expected = str(archive["sha256"])
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        return None
    valid = (
        tokens.ndim == 1
        and offsets.ndim == 1
        and offsets.size >= 2
        and int(offsets[-1]) == tokens.size
        and _sha256(tokens) == expected
    )
    return Corpus(tokens=tokens, file_offsets=offsets) if valid else None


def _save_npz(tmp: str, corpus: Corpus) -> None:
    with open(tmp, "wb") as f:  # a file object: np.savez would add ".npz" to a path
        np.savez(
            f,
            tokens=corpus.tokens,
            file_offsets=corpus.file_offsets,
            sha256=np.array(_sha256(corpus.tokens)),
        )


def _write_cache(path: Path, corpus: Corpus) -> None:
    """Atomically write the cache; failures are ignored because the cache is only an
    optimization."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, lambda tmp: _save_npz(tmp, corpus), sync=Sync.NONE)
    except OSError:
        pass


def load_corpus(max_bytes: int = DEFAULT_CORPUS_MAX_BYTES) -> Corpus:
    """Return the embedded corpus, from the verified cache when possible, else built and cached."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    key = _listing_key(_stdlib_files(stdlib), max_bytes)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    path = default_cache_dir() / f"corpus-py{version}-{key}.npz"
    cached = _read_cache(path)
    if cached is not None:
        return cached
    corpus = build_corpus(max_bytes, stdlib)
    _write_cache(path, corpus)
    return corpus


def corpus_sha256(corpus: Corpus | None = None) -> str:
    """Hex sha256 of ``corpus.tokens`` (default: the default embedded corpus)."""
    return _sha256((corpus or load_corpus()).tokens)


def expected_corpus_sha256() -> str | None:
    """The recorded sha256 of the default corpus for this Python minor version, if measured."""
    return EXPECTED_CORPUS_SHA256.get(f"{sys.version_info.major}.{sys.version_info.minor}")
