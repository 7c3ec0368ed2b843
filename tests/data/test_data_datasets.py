from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from stalwart.data import TokenDataset, build_datasets, load_tokens


def test_token_dataset_windows() -> None:
    ds = TokenDataset(np.arange(21, dtype=np.uint16), seq_length=4)
    assert len(ds) == 5
    x, y = ds[1]
    assert x.dtype == torch.int64 and y.dtype == torch.int64
    assert x.tolist() == [4, 5, 6, 7] and y.tolist() == [5, 6, 7, 8]
    assert ds[4][1].tolist() == [17, 18, 19, 20]
    with pytest.raises(IndexError):
        ds[5]
    with pytest.raises(ValueError, match="--seq-length"):
        TokenDataset(np.arange(4, dtype=np.uint8), seq_length=4)


def test_txt_loading(tmp_path: Path) -> None:
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"hello world\n" * 10)
    tokens = load_tokens(str(path))
    assert tokens.dtype == np.uint8 and bytes(tokens) == b"hello world\n" * 10
    train, valid = build_datasets(str(path), seq_length=4, vocab_size=256, valid_fraction=0.1)
    assert train.tokens.size == 108 and valid.tokens.size == 12
    with pytest.raises(ValueError, match="--seq-length"):
        build_datasets(str(path), seq_length=16, vocab_size=256, valid_fraction=0.1)
    with pytest.raises(ValueError, match="--vocab-size"):
        build_datasets(str(path), seq_length=4, vocab_size=100)


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_bin_loading(tmp_path: Path, dtype: str) -> None:
    values = np.array([1, 70000 if dtype == "uint32" else 65535, 3, 4, 5, 6], dtype=dtype)
    path = tmp_path / "tokens.bin"
    values.tofile(path)
    tokens = load_tokens(str(path), data_dtype=dtype)
    assert isinstance(tokens, np.memmap)
    assert tokens.tolist() == values.tolist()
    vocab = int(values.max()) + 1
    train, valid = build_datasets(str(path), 1, vocab, data_dtype=dtype, valid_fraction=0.5)
    assert train[0][1].tolist() == [int(values[1])] and len(valid) == 2
    with pytest.raises(ValueError, match="--vocab-size"):
        build_datasets(str(path), 1, vocab - 1, data_dtype=dtype, valid_fraction=0.5)


def test_bad_paths_and_dtypes(tmp_path: Path) -> None:
    missing = tmp_path / "nope.bin"
    with pytest.raises(ValueError, match=r"--data-path.*nope\.bin"):
        load_tokens(str(missing))
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=r"--data-path.*empty\.txt"):
        load_tokens(str(empty))
    with pytest.raises(ValueError, match="--data-path"):
        load_tokens(str(tmp_path))
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x00\x01\x02")
    with pytest.raises(ValueError, match="--data-path"):
        load_tokens(str(odd), "uint16")
    with pytest.raises(ValueError, match="--data-dtype"):
        load_tokens(str(odd), "int8")
    with pytest.raises(ValueError, match="--valid-fraction"):
        build_datasets(str(odd), 1, 256, valid_fraction=0.0)
