"""Read DCP checkpoints without running code from them.

DCP stores two things as pickles: the ``.metadata`` file (read by every load and by our
integrity check) and every non-tensor entry of the state dict (optimizer hyperparameters such as
``lr`` or ``betas``, written with ``torch.save`` inside a ``.distcp`` shard). Upstream reads both
with an unrestricted ``pickle``/``torch.load(weights_only=False)``, so a planted file runs code
on load. Here both go through :class:`RestrictedUnpickler`, whose ``find_class`` resolves only
an explicit allow-list (Python's documented way to restrict unpickling: every global the stream
names, and so every callable it could invoke, passes through ``find_class``):

* ``.metadata``: the dataclasses and enums of DCP's own metadata modules, ``torch.Size``,
  torch dtypes/layouts/memory formats, ``pathlib`` paths and a few builtin containers;
* non-tensor entries: builtin containers and numbers only (no tensors: DCP stores those as
  tensor items, read by torch's ``weights_only`` loader).

:class:`~stalwart.checkpoint.dcp_readers.SafeFileSystemReader` and
:class:`~stalwart.checkpoint.dcp_readers.SafeLoadPlanner` plug these into ``dcp.load``. This
module imports only ``torch``: ``torch.distributed.checkpoint`` (~1.5 s of import, most of it
``torch.distributed.tensor``) is imported by the code that saves or loads, not by every process
that imports the checkpoint package.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import io
import os
import pathlib
import pickle
import zipfile
from typing import Any

import torch

from stalwart.checkpoint.errors import CheckpointError
from stalwart.regular_file import open_regular

# Modules whose dataclasses and enums a DCP ``.metadata`` may name (they differ across torch
# versions; only data classes and enums of these modules are accepted, never a function).
_DCP_DATA_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.filesystem",
    "torch.distributed.checkpoint.planner",
    "torch.distributed.checkpoint._extension",
)
_BUILTINS = {
    ("builtins", name)
    for name in (
        "set",
        "frozenset",
        "bytearray",
        "complex",
        "slice",
        "range",
        "list",
        "dict",
        "tuple",
    )
} | {("collections", "OrderedDict")}
_PATHS = {
    ("pathlib", n) for n in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")
}
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)
MAX_METADATA_BYTES = 1 << 30


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves only allow-listed globals (``metadata=True``: DCP's metadata
    classes as well) and refuses persistent ids; anything else raises ``UnpicklingError``."""

    def __init__(self, file: Any, *, metadata: bool) -> None:
        super().__init__(file)
        self._metadata = metadata

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _BUILTINS:
            return super().find_class(module, name)
        if self._metadata:
            found = _metadata_global(module, name)
            if found is not None:
                return found
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids (tensor storages) are not allowed here")


def _metadata_global(module: str, name: str) -> Any:
    if (module, name) in _PATHS:
        return getattr(pathlib, name)
    if module == "torch":
        if name == "Size":
            return torch.Size
        value = getattr(torch, name, None)
        return value if isinstance(value, _TORCH_VALUES) else None
    if (module, name) == ("torch.serialization", "_get_layout"):
        from torch.serialization import _get_layout  # str -> torch.layout; no other effect

        return _get_layout
    if module not in _DCP_DATA_MODULES:
        return None
    try:
        value = getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None
    is_data = isinstance(value, type) and (
        dataclasses.is_dataclass(value) or issubclass(value, enum.Enum)
    )
    return value if is_data else None


def read_dcp_metadata(checkpoint_dir: str | os.PathLike[str], filename: str = ".metadata") -> Any:
    """The DCP ``Metadata`` of ``checkpoint_dir``, unpickled with the allow-list.

    Raises:
        CheckpointError: naming the file when it is missing, too large, not a pickle of DCP
            metadata, or names a global outside the allow-list.
    """
    from torch.distributed.checkpoint.metadata import Metadata

    path = os.path.join(os.fspath(checkpoint_dir), filename)
    try:
        with open_regular(path) as f:
            data = f.read(MAX_METADATA_BYTES + 1)
    except OSError as exc:
        raise CheckpointError(f"DCP metadata {path} unreadable: {exc.strerror or exc}") from None
    if len(data) > MAX_METADATA_BYTES:
        raise CheckpointError(f"DCP metadata {path} is larger than {MAX_METADATA_BYTES} bytes")
    try:
        metadata = RestrictedUnpickler(io.BytesIO(data), metadata=True).load()
    except Exception as exc:  # any unpickling failure: corrupt or hostile
        raise CheckpointError(f"DCP metadata {path} refused: {type(exc).__name__}: {exc}") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(
            f"DCP metadata {path} holds a {type(metadata).__name__}, not Metadata"
        )
    return metadata


def load_bytes_item(value: io.BytesIO) -> Any:
    """A non-tensor DCP entry (a ``torch.save`` zip archive) through the restricted unpickler."""
    try:
        with zipfile.ZipFile(value) as archive:
            pickles = [n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
            if len(pickles) != 1:
                raise pickle.UnpicklingError("not a torch.save archive")
            data = archive.read(pickles[0])
        return RestrictedUnpickler(io.BytesIO(data), metadata=False).load()
    except (zipfile.BadZipFile, pickle.UnpicklingError, EOFError, ValueError) as exc:
        raise CheckpointError(
            f"non-tensor checkpoint entry refused: {type(exc).__name__}: {exc}"
        ) from None
