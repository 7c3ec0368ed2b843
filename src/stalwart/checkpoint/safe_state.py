"""Non-tensor checkpoint state as JSON: a format that cannot run code when it is read.

``common.json`` and ``rank_XXXXX.json`` hold the small state a training loop saves next to the
DCP shards (counters, sampler position, RNG states, the rerun machine). JSON cannot name a
class or a function, so reading a planted file can only produce data; the few non-JSON types
this state needs get an explicit, tagged encoding that the reader checks field by field:

* ``tuple``, a ``dict`` with non-string keys, ``bytes``, a non-finite ``float``;
* a ``torch.Tensor`` (CPU copy, raw bytes in the host's order: little-endian on every
  platform torch ships for; numeric and bool dtypes) and a ``numpy.ndarray`` (numeric and
  bool dtypes only: never ``object``, stored little-endian), both in base64.

Anything else (a class instance, an enum, a function) is refused at save time with the path of
the offending value, so a loop learns at its first save, not at its first resume. NumPy scalars
are stored as Python numbers.

Example::

    >>> import torch
    >>> text = dumps_state({"rng": torch.get_rng_state(), "pos": (3, 4), "loss": float("nan")})
    >>> back = loads_state(text, "common.json")
    >>> back["pos"], torch.equal(back["rng"], torch.get_rng_state())
    ((3, 4), True)
"""

from __future__ import annotations

import base64
import json
import math
from typing import Any

import numpy as np
import torch

from stalwart.regular_file import open_regular

TAG = "__stalwart__"
# Bigger files are refused before they are parsed (this state is kilobytes; tensors go to DCP).
MAX_STATE_BYTES = 1 << 30

_TORCH_DTYPES: dict[str, torch.dtype] = {
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


class StateFormatError(ValueError):
    """A value cannot be stored (save) or a file does not hold valid state (load)."""


# ----------------------------------------------------------------------------- encoding
def _encode(obj: Any, path: str) -> Any:
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)  # IntEnum & co. become plain ints
    if isinstance(obj, float):
        if math.isfinite(obj):
            return float(obj)
        return {TAG: "float", "value": repr(obj)}  # 'nan', 'inf', '-inf'
    if isinstance(obj, np.generic) and obj.dtype.kind in "biuf":
        return _encode(obj.item(), path)
    if isinstance(obj, list):
        if all(type(v) is int or type(v) is str for v in obj):
            return obj  # JSON as it is (a Python RNG state's 625 ints): no walk per element
        return [_encode(v, f"{path}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return {TAG: "tuple", "items": [_encode(v, f"{path}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, dict):
        return _encode_dict(obj, path)
    if isinstance(obj, (bytes, bytearray)):
        return {TAG: "bytes", "base64": base64.b64encode(bytes(obj)).decode("ascii")}
    if isinstance(obj, torch.Tensor):
        return _encode_tensor(obj, path)
    if isinstance(obj, np.ndarray):
        return _encode_ndarray(obj, path)
    raise StateFormatError(
        f"{path}: a {type(obj).__module__}.{type(obj).__qualname__} cannot be stored in a "
        "checkpoint's state (allowed: None, bool, int, float, str, bytes, list, tuple, dict, "
        "torch.Tensor, numpy.ndarray of numbers); store its state_dict() or a plain value"
    )


def _encode_dict(obj: dict[Any, Any], path: str) -> Any:
    if all(isinstance(k, str) for k in obj) and TAG not in obj:
        return {k: _encode(v, f"{path}[{k!r}]") for k, v in obj.items()}
    return {
        TAG: "dict",
        "items": [
            [_encode(k, f"{path} key"), _encode(v, f"{path}[{k!r}]")] for k, v in obj.items()
        ],
    }


def _encode_tensor(tensor: torch.Tensor, path: str) -> dict[str, Any]:
    if type(tensor) is not torch.Tensor or tensor.is_sparse or tensor.is_quantized:
        raise StateFormatError(
            f"{path}: only dense torch.Tensor values can be stored, got {type(tensor).__name__}"
        )
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in _TORCH_DTYPES:
        raise StateFormatError(f"{path}: tensor dtype {tensor.dtype} cannot be stored")
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return {
        TAG: "tensor",
        "dtype": name,
        "shape": list(tensor.shape),
        "base64": base64.b64encode(raw).decode("ascii"),
    }


def _encode_ndarray(array: np.ndarray, path: str) -> dict[str, Any]:
    if array.dtype.kind not in "biufc" or array.dtype.fields is not None:
        raise StateFormatError(f"{path}: numpy dtype {array.dtype} cannot be stored")
    little = array.astype(array.dtype.newbyteorder("<"), copy=False)
    return {
        TAG: "ndarray",
        "dtype": little.dtype.str,
        "shape": list(array.shape),
        "base64": base64.b64encode(np.ascontiguousarray(little).tobytes()).decode("ascii"),
    }


def dumps_state(state: Any, name: str = "state") -> str:
    """``state`` as JSON text (see module docstring for what may be in it).

    Raises:
        StateFormatError: naming the path of the first value that cannot be stored.
    """
    return json.dumps(_encode(state, name), allow_nan=False, separators=(",", ":")) + "\n"


# ----------------------------------------------------------------------------- decoding
def _fields(obj: dict[str, Any], keys: set[str], where: str) -> None:
    if set(obj) != keys:
        raise StateFormatError(f"{where}: malformed {obj.get(TAG)!r} entry (keys {sorted(obj)})")


def _shape(value: Any, where: str) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value
    ):
        raise StateFormatError(f"{where}: malformed shape {value!r}")
    return value


def _raw(value: Any, where: str) -> bytes:
    if not isinstance(value, str):
        raise StateFormatError(f"{where}: malformed base64 payload")
    try:
        return base64.b64decode(value.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError) as exc:
        raise StateFormatError(f"{where}: malformed base64 payload ({exc})") from None


def _decode_tensor(obj: dict[str, Any], where: str) -> torch.Tensor:
    _fields(obj, {TAG, "dtype", "shape", "base64"}, where)
    dtype = _TORCH_DTYPES.get(obj["dtype"]) if isinstance(obj["dtype"], str) else None
    if dtype is None:
        raise StateFormatError(f"{where}: tensor dtype {obj['dtype']!r} is not allowed")
    shape, raw = _shape(obj["shape"], where), _raw(obj["base64"], where)
    numel = math.prod(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if len(raw) != numel * itemsize:
        raise StateFormatError(
            f"{where}: tensor payload has {len(raw)} bytes, shape needs {numel * itemsize}"
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype)
    return flat.reshape(shape).clone()


def _decode_ndarray(obj: dict[str, Any], where: str) -> np.ndarray:
    _fields(obj, {TAG, "dtype", "shape", "base64"}, where)
    try:
        dtype = np.dtype(obj["dtype"]) if isinstance(obj["dtype"], str) else None
    except TypeError:
        dtype = None
    if dtype is None or dtype.kind not in "biufc" or dtype.fields is not None:
        raise StateFormatError(f"{where}: numpy dtype {obj['dtype']!r} is not allowed")
    shape, raw = _shape(obj["shape"], where), _raw(obj["base64"], where)
    if len(raw) != math.prod(shape) * dtype.itemsize:
        raise StateFormatError(f"{where}: array payload size does not match its shape")
    return np.frombuffer(raw, dtype=dtype).reshape(shape).astype(dtype.newbyteorder("="))


def _decode(obj: Any, where: str) -> Any:
    if isinstance(obj, list):
        return [_decode(v, where) for v in obj]
    if not isinstance(obj, dict):
        return obj
    kind = obj.get(TAG)
    if kind is None:
        return {k: _decode(v, where) for k, v in obj.items()}
    if kind == "tuple":
        _fields(obj, {TAG, "items"}, where)
        return tuple(_decode(v, where) for v in _list(obj["items"], where))
    if kind == "dict":
        _fields(obj, {TAG, "items"}, where)
        pairs = [_pair(p, where) for p in _list(obj["items"], where)]
        return {_hashable(_decode(k, where), where): _decode(v, where) for k, v in pairs}
    if kind == "float":
        _fields(obj, {TAG, "value"}, where)
        if obj["value"] not in ("nan", "inf", "-inf"):
            raise StateFormatError(f"{where}: malformed float {obj['value']!r}")
        return float(obj["value"])
    if kind == "bytes":
        _fields(obj, {TAG, "base64"}, where)
        return _raw(obj["base64"], where)
    if kind == "tensor":
        return _decode_tensor(obj, where)
    if kind == "ndarray":
        return _decode_ndarray(obj, where)
    raise StateFormatError(f"{where}: unknown entry type {kind!r}")


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise StateFormatError(f"{where}: malformed entry (expected a list)")
    return value


def _pair(value: Any, where: str) -> tuple[Any, Any]:
    if not isinstance(value, list) or len(value) != 2:
        raise StateFormatError(f"{where}: malformed dict item")
    return value[0], value[1]


def _hashable(key: Any, where: str) -> Any:
    try:
        hash(key)
    except TypeError:
        raise StateFormatError(f"{where}: unhashable dict key") from None
    return key


def loads_state(text: str | bytes, where: str) -> Any:
    """Parse what :func:`dumps_state` wrote; ``where`` (a file name) prefixes every error.

    Raises:
        StateFormatError: not UTF-8, not JSON, too deeply nested or a malformed tagged entry.
    """
    if len(text) > MAX_STATE_BYTES:
        raise StateFormatError(f"{where}: {len(text)} bytes is larger than {MAX_STATE_BYTES}")
    try:
        parsed = json.loads(text)
    except UnicodeDecodeError:
        raise StateFormatError(f"{where}: not UTF-8 text") from None
    except (ValueError, RecursionError) as exc:
        raise StateFormatError(f"{where}: not valid JSON ({type(exc).__name__}: {exc})") from None
    try:
        return _decode(parsed, where)
    except RecursionError:
        raise StateFormatError(f"{where}: nested too deeply") from None


def read_state_file(path: str) -> Any:
    """:func:`loads_state` of a file (size checked before it is read).

    Raises:
        StateFormatError: as :func:`loads_state`, or the file is too large.
        OSError: the file cannot be read.
    """
    with open_regular(path) as f:
        data = f.read(MAX_STATE_BYTES + 1)
    return loads_state(data, path)
