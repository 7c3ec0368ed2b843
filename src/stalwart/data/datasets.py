"""Token datasets: non-overlapping next-token windows over a flat token array.

Data sources (``--data-path``): none -> the embedded stdlib corpus (bytes); ``*.bin`` -> a raw
little-endian array of ``--data-dtype`` (uint16 or uint32), memory-mapped; anything else -> a
text/binary file read as bytes (uint8, vocabulary 256). Several sources, optionally weighted,
are blended (`stalwart.data.blend`).

A ``*.bin`` with a Megatron index beside it (``x.idx``: magic ``MMIDIDX\\x00\\x00``, a uint64
version, then one byte naming the token dtype) must have the index's item size: the tokens of
an int32 ``.bin`` read as uint16 would be a silently different run. Only those first 18 bytes are
read. The ``.idx`` itself, or a Megatron path prefix without ``.bin``, is refused with a hint.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from stalwart.data.blend import BlendedDataset, SampleSource, parse_data_blend
from stalwart.data.corpus import load_corpus

_BIN_DTYPES = ("uint16", "uint32")
_IDX_MAGIC = b"MMIDIDX\x00\x00"
# Megatron's index dtype codes (its DType enum) -> numpy dtype.
_IDX_DTYPES = {
    1: "uint8",
    2: "int8",
    3: "int16",
    4: "int32",
    5: "int64",
    6: "float64",
    7: "float32",
    8: "uint16",
}
_MAX_CHECK_CHUNK = 1 << 24


class TokenDataset:
    """Sample ``i`` = window ``tokens[i*seq : i*seq + seq + 1]`` split into inputs and labels.

    ``__getitem__(i)`` returns ``(input_ids, labels)``, both int64 CPU tensors of shape
    ``[seq_length]`` with ``labels`` shifted left by one. Consecutive windows share one token
    (the last label of window i is the first input of window i+1). ``len = (n - 1) // seq``;
    a token array too short for one window raises ``ValueError`` naming ``--seq-length``.
    """

    def __init__(self, tokens: np.ndarray, seq_length: int) -> None:
        if isinstance(seq_length, bool) or not isinstance(seq_length, int) or seq_length < 1:
            raise ValueError(f"--seq-length must be an integer >= 1, got {seq_length!r}")
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be a 1-D array, got shape {tokens.shape}")
        self.tokens = tokens
        self.seq_length = seq_length
        self._len = (int(tokens.shape[0]) - 1) // seq_length
        if self._len < 1:
            raise ValueError(
                f"--seq-length {seq_length} is too long: a dataset split of {tokens.shape[0]} "
                f"tokens needs at least --seq-length + 1 tokens for one sample"
            )

    def __len__(self) -> int:
        return self._len

    def window(self, index: int) -> np.ndarray:
        """The ``seq_length + 1`` tokens of sample ``index`` as an int64 numpy array."""
        if not 0 <= index < self._len:
            raise IndexError(f"sample index {index} out of range [0, {self._len})")
        start = index * self.seq_length
        return np.asarray(self.tokens[start : start + self.seq_length + 1], dtype=np.int64)

    def windows(self, indices: np.ndarray) -> np.ndarray:
        """``np.stack([window(i) for i in indices])`` in one gather (``[len, seq + 1]`` int64)."""
        indices = np.asarray(indices, dtype=np.int64)
        if indices.size and (int(indices.min()) < 0 or int(indices.max()) >= self._len):
            bad = indices[(indices < 0) | (indices >= self._len)][0]
            raise IndexError(f"sample index {int(bad)} out of range [0, {self._len})")
        offsets = np.arange(self.seq_length + 1, dtype=np.int64)
        gathered = self.tokens[indices[:, None] * self.seq_length + offsets]
        return np.asarray(gathered, dtype=np.int64)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = torch.from_numpy(self.window(index))
        return w[:-1], w[1:]


def _bin_dtype(data_dtype: str) -> np.dtype:
    if data_dtype not in _BIN_DTYPES:
        raise ValueError(f"--data-dtype must be one of {list(_BIN_DTYPES)}, got {data_dtype!r}")
    return np.dtype(data_dtype).newbyteorder("<")


def _check_megatron_index(data_path: str, path: Path, data_dtype: str) -> None:
    """A Megatron ``.idx`` beside the ``.bin`` must name a dtype of ``data_dtype``'s item size."""
    from stalwart.regular_file import open_regular

    try:
        with open_regular(path.with_suffix(".idx")) as f:
            head = f.read(len(_IDX_MAGIC) + 9)
    except OSError:
        return  # no index (or not a file): a plain token array
    if len(head) < len(_IDX_MAGIC) + 9 or not head.startswith(_IDX_MAGIC):
        return
    code = head[-1]
    name = _IDX_DTYPES.get(code)
    if name is None:
        raise ValueError(
            f"--data-path {data_path!r}: its Megatron index names an unknown dtype code {code}"
        )
    kind = np.dtype(name)
    if kind.kind not in "iu" or kind.itemsize != np.dtype(data_dtype).itemsize:
        allowed = {2: "uint16", 4: "uint32"}.get(kind.itemsize) if kind.kind in "iu" else None
        fix = f"pass --data-dtype {allowed}" if allowed else "allowed: uint16, uint32 token ids"
        raise ValueError(
            f"--data-path {data_path!r}: its Megatron index {path.with_suffix('.idx').name} says "
            f"the tokens are {name}, not --data-dtype {data_dtype} ({fix})"
        )


def _missing_path_hint(data_path: str) -> str:
    if os.path.isfile(f"{data_path}.bin"):  # Megatron's --data-path takes the prefix
        return f"; a Megatron prefix? pass {data_path}.bin"
    return ""


def load_tokens(data_path: str | None, data_dtype: str = "uint16") -> np.ndarray:
    """Load the flat token array for ``--data-path`` (see module docstring).

    ``*.bin`` files are memory-mapped read-only (not read into memory). Raises ``ValueError``
    naming ``--data-path`` and the path when the file is missing, empty, unreadable or its size
    is not a multiple of the ``--data-dtype`` item size.
    """
    if data_path is None:
        return load_corpus().tokens
    path = Path(data_path)
    if not path.is_file():
        raise ValueError(
            f"--data-path {data_path!r} does not exist or is not a regular file"
            + _missing_path_hint(data_path)
        )
    if path.suffix == ".idx" and path.with_suffix(".bin").is_file():
        raise ValueError(
            f"--data-path {data_path!r} is a Megatron index, not tokens: pass "
            f"{path.with_suffix('.bin')} (with --data-dtype of the index)"
        )
    try:
        size = path.stat().st_size
        if path.suffix == ".bin":
            dtype = _bin_dtype(data_dtype)
            if size == 0 or size % dtype.itemsize != 0:
                raise ValueError(
                    f"--data-path {data_path!r}: size {size} bytes is empty or not a multiple "
                    f"of --data-dtype {data_dtype} ({dtype.itemsize} bytes)"
                )
            _check_megatron_index(data_path, path, data_dtype)
            return np.memmap(path, dtype=dtype, mode="r")
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"--data-path {data_path!r} is unreadable: {exc}") from exc
    if not data:
        raise ValueError(f"--data-path {data_path!r} is empty")
    return np.frombuffer(data, dtype=np.uint8)


def check_vocab(tokens: np.ndarray, vocab_size: int, source: str) -> None:
    """Raise ``ValueError`` naming ``--vocab-size`` if any token is >= ``vocab_size``.

    Scans in chunks so memory-mapped files are never loaded whole.
    """
    for start in range(0, int(tokens.shape[0]), _MAX_CHECK_CHUNK):
        chunk_max = int(np.max(tokens[start : start + _MAX_CHECK_CHUNK]))
        if chunk_max >= vocab_size:
            raise ValueError(
                f"--vocab-size {vocab_size} is too small for {source}: it contains token id "
                f"{chunk_max} (need --vocab-size > max token id)"
            )


def _split_source(
    data_path: str, seq_length: int, vocab_size: int, data_dtype: str, valid_fraction: float
) -> tuple[TokenDataset, TokenDataset]:
    tokens = load_tokens(data_path, data_dtype)
    check_vocab(tokens, vocab_size, f"--data-path {data_path!r}")
    split = int((1.0 - valid_fraction) * tokens.shape[0])
    return TokenDataset(tokens[:split], seq_length), TokenDataset(tokens[split:], seq_length)


def build_datasets(
    data_path: str | Sequence[str] | None,
    seq_length: int,
    vocab_size: int,
    data_dtype: str = "uint16",
    valid_fraction: float = 0.02,
) -> tuple[SampleSource, SampleSource]:
    """Return ``(train, valid)`` datasets over disjoint token ranges.

    The embedded corpus (``data_path=None``) is split at a file boundary so the validation set is
    roughly the last ``valid_fraction`` of bytes as whole files; other sources split at token
    ``floor((1 - valid_fraction) * n)``. Several sources (``--data-path 0.3 a 0.7 b``, see
    `stalwart.data.blend`) are split one by one, then blended by weight. Raises ``ValueError``
    naming ``--vocab-size`` for out-of-range tokens, ``--seq-length`` when a split is too short
    for one sample, ``--valid-fraction`` unless ``0 < valid_fraction < 1`` and ``--data-path``
    for a malformed blend.
    """
    if not 0.0 < valid_fraction < 1.0:
        raise ValueError(f"--valid-fraction must be in (0, 1), got {valid_fraction!r}")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"--vocab-size must be an integer >= 1, got {vocab_size!r}")
    blend = parse_data_blend(data_path)
    if blend is None:
        corpus = load_corpus()
        check_vocab(corpus.tokens, vocab_size, "the embedded corpus")
        split = corpus.split_at_file_boundary(valid_fraction)
        tokens = corpus.tokens
        return TokenDataset(tokens[:split], seq_length), TokenDataset(tokens[split:], seq_length)
    splits = [
        _split_source(path, seq_length, vocab_size, data_dtype, valid_fraction) for _, path in blend
    ]
    if len(splits) == 1:
        return splits[0]
    weights = [w for w, _ in blend]
    train = BlendedDataset([t for t, _ in splits], weights)
    valid = BlendedDataset([v for _, v in splits], weights)
    return train, valid
