from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from stalwart.data import (
    build_corpus,
    build_datasets,
    corpus_sha256,
    expected_corpus_sha256,
    load_corpus,
)


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("STALWART_CACHE", str(tmp_path))
    return tmp_path


def test_corpus_deterministic_and_matches_recorded_hash(cache_dir: Path) -> None:
    a, b = build_corpus(), build_corpus()
    assert corpus_sha256(a) == corpus_sha256(b)
    assert a.tokens.dtype == np.uint8 and 0 < a.tokens.size <= 16 * 1024 * 1024
    assert a.file_offsets[0] == 0 and a.file_offsets[-1] == a.tokens.size
    assert bytes(a.tokens[:8]) == b"# file: "
    assert b"site-packages" not in bytes(a.tokens[:: max(1, a.tokens.size // 100000)])
    expected = expected_corpus_sha256()
    if expected is None:
        pytest.skip("no recorded corpus hash for this Python version")
    assert corpus_sha256(a) == expected


def test_max_bytes_takes_whole_files() -> None:
    small = build_corpus(max_bytes=100_000)
    full = build_corpus()
    n = small.tokens.size
    assert n <= 100_000 and np.array_equal(small.tokens, full.tokens[:n])
    assert n in set(full.file_offsets.tolist())


def test_cache_roundtrip_and_corruption(cache_dir: Path) -> None:
    first = load_corpus(max_bytes=200_000)
    files = list(cache_dir.glob("corpus-py*.npz"))
    assert len(files) == 1
    second = load_corpus(max_bytes=200_000)
    assert np.array_equal(first.tokens, second.tokens)
    good = files[0].read_bytes()
    for corrupt in (b"garbage", good[: len(good) // 2], good[:-64] + bytes(64)):
        files[0].write_bytes(corrupt)
        again = load_corpus(max_bytes=200_000)
        assert np.array_equal(first.tokens, again.tokens)
    assert not list(cache_dir.glob("*.tmp"))


def test_split_at_file_boundary_disjoint(cache_dir: Path) -> None:
    corpus = load_corpus()
    split = corpus.split_at_file_boundary(0.02)
    assert split in set(corpus.file_offsets.tolist())
    assert 0.97 < split / corpus.tokens.size <= 0.99
    train, valid = build_datasets(None, seq_length=128, vocab_size=256)
    assert train.tokens.size == split
    assert train.tokens.size + valid.tokens.size == corpus.tokens.size
    assert bytes(valid.tokens[:8]) == b"# file: "
    with pytest.raises(ValueError, match="--vocab-size"):
        build_datasets(None, seq_length=128, vocab_size=100)
