"""DCP reader and load planners that read through `stalwart.checkpoint.dcp_safe`'s allow-list.

Kept apart from `stalwart.checkpoint.dcp_safe` because subclassing DCP's classes imports
``torch.distributed.checkpoint`` (~1.5 s): `stalwart.checkpoint.dcp_io` imports this module only
when it loads, so a process that never loads a checkpoint never pays for it.
"""

from __future__ import annotations

import io
import os
from typing import Any

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    _EmptyStateDictLoadPlanner,
)

from stalwart.checkpoint.dcp_safe import load_bytes_item, read_dcp_metadata


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``read_metadata`` uses :func:`read_dcp_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        rank = kwargs.get("rank")
        filename = ".metadata" if rank is None else f"__{rank}.metadata"
        metadata = read_dcp_metadata(os.fspath(self.path), filename)
        # What upstream's read_metadata does after unpickling (the attributes exist from 2.4 on).
        if hasattr(metadata, "storage_meta"):
            if metadata.storage_meta is None:
                from torch.distributed.checkpoint.metadata import StorageMeta

                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata


class _SafeBytesMixin:
    """``load_bytes`` through :func:`load_bytes_item` instead of
    ``torch.load(weights_only=False)``."""

    flatten_state_dict: bool
    original_state_dict: Any
    mappings: Any
    state_dict: Any

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        obj = load_bytes_item(value)
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


class SafeLoadPlanner(_SafeBytesMixin, DefaultLoadPlanner):
    """``DefaultLoadPlanner`` with the restricted reading of non-tensor entries."""


class SafeEmptyStateDictLoadPlanner(_SafeBytesMixin, _EmptyStateDictLoadPlanner):
    """Loads every entry of a checkpoint without a model (tools), non-tensor entries restricted."""
