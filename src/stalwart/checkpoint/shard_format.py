"""One rank's part of a local checkpoint as one byte string that reading cannot turn into code.

A shard is what a rank stores of a save (its tensors, the loop's small state) in one file,
``shard.bin``, and the bytes that go to its replicas over the process group are exactly that
file::

    b"STWSHRD1" | header length (8 bytes, little-endian) | header (UTF-8 JSON)
                | zero padding to a multiple of 64 | the tensors' bytes

The header holds the facts of the save (iteration, owner rank, world size, ...), the state as
`stalwart.checkpoint.safe_state` JSON in which every tensor is the placeholder
``{"__shard_tensor__": "<path>"}``, and the table of tensors this shard holds:
``{"<path>": [dtype, shape, offset, nbytes]}`` (offsets from the start of the tensor bytes,
each a multiple of 64). Reading checks every field (a known dtype, a shape whose size is
``nbytes``, inside the data, no overlap) and views the bytes with ``torch.frombuffer``: no pickle,
no ``torch.load``. A shard need not hold every tensor of the state (``fully_parallel`` spreads
the replicated tensors over the ranks): the placeholders name them all, the table what is here.

    >>> import torch
    >>> tree = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "step": 3}
    >>> skeleton, tensors = split_tensors(tree)
    >>> table, size = tensor_table(tensors)
    >>> data = bytearray(size)
    >>> for entry, t in zip(table, tensors.values()):
    ...     data[entry.offset : entry.offset + entry.nbytes] = t.numpy().tobytes()
    >>> blob = bytearray(encode_header({"iteration": 3}, skeleton, table)) + data
    >>> shard = parse_shard(blob, "shard.bin")
    >>> shard.facts["iteration"], shard.skeleton["step"], shard.tensors[table[0].path].tolist()
    (3, 3, [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]])
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from stalwart.checkpoint.safe_state import StateFormatError, dumps_state, loads_state

MAGIC = b"STWSHRD1"
SHARD_FORMAT = "stalwart-shard-v1"
PLACEHOLDER = "__shard_tensor__"
ALIGN = 64
MAX_HEADER_BYTES = 256 << 20  # the state's JSON and the table; tensors are never in it
_PREFIX = len(MAGIC) + 8
_SCALARS = (int, float, str, bool, type(None))

DTYPES: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
    )
}


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes are in a shard (``offset`` from the start of the data)."""

    path: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Shard:
    """A parsed shard: its facts, the state with placeholders, and the tensors it holds (views
    of the bytes it was parsed from, by path)."""

    facts: dict[str, Any]
    skeleton: Any
    tensors: dict[str, torch.Tensor]


def local_part(tensor: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A DTensor's local part (and True: sharded state), else the tensor itself (and False)."""
    to_local = getattr(tensor, "to_local", None)
    if type(tensor) is not torch.Tensor and callable(to_local):
        return to_local(), True
    return tensor, False


def split_tensors(tree: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """``tree`` with each tensor replaced by its placeholder, and the tensors by path, in the
    tree's order (a DTensor as it is: :func:`local_part` gives what a shard stores of it).
    Paths are JSON lists of the keys."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(obj: Any, keys: list[Any]) -> Any:
        if isinstance(obj, torch.Tensor):
            path = json.dumps(keys)
            tensors[path] = obj
            return {PLACEHOLDER: path}
        if isinstance(obj, Mapping):
            return {
                k: walk(v, [*keys, k if isinstance(k, (str, int)) else str(k)])
                for k, v in obj.items()
            }
        if isinstance(obj, (list, tuple)):
            if all(type(v) in _SCALARS for v in obj):
                return obj  # no tensor below (an RNG state's ints): nothing to walk
            walked = [walk(v, [*keys, i]) for i, v in enumerate(obj)]
            return walked if isinstance(obj, list) else tuple(walked)
        return obj

    return walk(tree, []), tensors


def device_first(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with the CPU's after the others (the order `HostStager` copies best)."""
    return dict(sorted(tensors.items(), key=lambda item: local_part(item[1])[0].is_cpu))


def tensor_table(tensors: Mapping[str, torch.Tensor]) -> tuple[list[TensorEntry], int]:
    """The table of ``tensors`` (in their order, each at a multiple of 64) and the data size."""
    table, offset = [], 0
    for path, whole in tensors.items():
        tensor = local_part(whole)[0]
        name = str(tensor.dtype).removeprefix("torch.")
        if name not in DTYPES:
            raise StateFormatError(f"tensor {path}: dtype {tensor.dtype} cannot be stored")
        nbytes = tensor.numel() * tensor.element_size()
        table.append(TensorEntry(path, name, tuple(tensor.shape), offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    return table, offset


def encode_header(facts: dict[str, Any], skeleton: Any, table: list[TensorEntry]) -> bytes:
    """The shard's bytes before its data: magic, length, header JSON, padding to 64."""
    body = {
        "format": SHARD_FORMAT,
        "facts": facts,
        "state": json.loads(dumps_state(skeleton, "shard state")),
        "tensors": {e.path: [e.dtype, list(e.shape), e.offset, e.nbytes] for e in table},
    }
    text = json.dumps(body, allow_nan=False, separators=(",", ":")).encode("utf-8")
    pad = -(_PREFIX + len(text)) % ALIGN
    return MAGIC + len(text).to_bytes(8, "little") + text + b" " * pad


def _header(blob: memoryview, where: str) -> tuple[dict[str, Any], int]:
    if len(blob) < _PREFIX or bytes(blob[: len(MAGIC)]) != MAGIC:
        raise StateFormatError(f"{where}: not a stalwart shard (no {MAGIC.decode()} header)")
    length = int.from_bytes(blob[len(MAGIC) : _PREFIX], "little")
    if length > MAX_HEADER_BYTES or _PREFIX + length > len(blob):
        raise StateFormatError(f"{where}: header length {length} is past the end of the shard")
    try:
        body = json.loads(bytes(blob[_PREFIX : _PREFIX + length]))
    except (ValueError, RecursionError) as exc:
        raise StateFormatError(f"{where}: header is not JSON ({type(exc).__name__})") from None
    if not isinstance(body, dict) or body.get("format") != SHARD_FORMAT:
        raise StateFormatError(f"{where}: header is not a {SHARD_FORMAT} header")
    if set(body) != {"format", "facts", "state", "tensors"} or not isinstance(body["facts"], dict):
        raise StateFormatError(f"{where}: header has fields {sorted(body)}")
    start = _PREFIX + length
    return body, start + (-start % ALIGN)


def _entry(path: Any, value: Any, size: int, where: str) -> TensorEntry:
    ok = isinstance(path, str) and isinstance(value, list) and len(value) == 4
    dtype = DTYPES.get(value[0]) if ok and isinstance(value[0], str) else None
    shape, offset, nbytes = (value[1], value[2], value[3]) if ok else ([], -1, -1)
    counts = [offset, nbytes, *shape] if isinstance(shape, list) else [None]
    if dtype is None or not all(type(c) is int and c >= 0 for c in counts):
        raise StateFormatError(f"{where}: malformed tensor entry {str(path)[:80]!r}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    if nbytes != math.prod(shape) * itemsize or offset % ALIGN or offset + nbytes > size:
        raise StateFormatError(f"{where}: tensor {path[:80]!r} does not fit its bytes")
    return TensorEntry(path, value[0], tuple(shape), offset, nbytes)


def parse_shard(blob: bytearray | memoryview, where: str) -> Shard:
    """Check and parse a shard; its tensors view ``blob`` (a writable buffer: copy the tensors
    before ``blob`` changes).

    Raises:
        StateFormatError: naming ``where`` and the first thing that is wrong.
    """
    view = memoryview(blob).cast("B")
    body, data_start = _header(view, where)
    return _shard(body, view[data_start:], where)


def parse_parts(header: bytes | bytearray, data: memoryview, where: str) -> Shard:
    """:func:`parse_shard` of a shard held as its header (:func:`encode_header`'s bytes) and
    its data apart (a snapshot in host memory, a replica received from a peer)."""
    body, data_start = _header(memoryview(header).cast("B"), where)
    if data_start != len(header):
        raise StateFormatError(f"{where}: header is {len(header)} bytes, its length says otherwise")
    return _shard(body, memoryview(data).cast("B"), where)


def read_facts(header: bytes | bytearray, where: str) -> dict[str, Any]:
    """The facts of a shard's header (nothing else is parsed)."""
    return dict(_header(memoryview(header).cast("B"), where)[0]["facts"])


def _shard(body: dict[str, Any], data: memoryview, where: str) -> Shard:
    tensors_field = body["tensors"]
    if not isinstance(tensors_field, dict):
        raise StateFormatError(f"{where}: malformed tensor table")
    entries = sorted(
        (_entry(p, v, len(data), where) for p, v in tensors_field.items()), key=lambda e: e.offset
    )
    for before, after in itertools.pairwise(entries):
        if before.offset + before.nbytes > after.offset:
            raise StateFormatError(f"{where}: tensors {before.path[:60]!r} and the next overlap")
    skeleton = loads_state(json.dumps(body["state"]), where)
    return Shard(dict(body["facts"]), skeleton, {e.path: _view(data, e) for e in entries})


def _view(data: memoryview, entry: TensorEntry) -> torch.Tensor:
    dtype = DTYPES[entry.dtype]
    if entry.nbytes == 0:
        return torch.empty(entry.shape, dtype=dtype)
    raw = data[entry.offset : entry.offset + entry.nbytes]
    flat = torch.frombuffer(raw, dtype=torch.uint8)
    return flat.view(dtype).reshape(entry.shape)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU ``uint8`` tensor, without a copy (writable)."""
    array: Any = tensor.numpy()
    return memoryview(array).cast("B")


def placeholder_path(value: Any) -> str | None:
    """The path of a tensor placeholder, or None when ``value`` is not one."""
    if isinstance(value, dict) and len(value) == 1 and isinstance(value.get(PLACEHOLDER), str):
        return str(value[PLACEHOLDER])
    return None
