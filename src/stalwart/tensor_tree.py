"""Walks of tensors nested in dicts (any ``Mapping``), lists and tuples, shared by the graphs'
static inputs and the checkpoint's host copy (a leaf: it imports nothing of stalwart)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``obj`` with every tensor ``t`` replaced by ``fn(t)``: mappings are rebuilt as dicts, lists
    as lists, tuples as plain tuples; any other value is kept as it is (not copied)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        return {key: map_tensors(value, fn) for key, value in obj.items()}
    if isinstance(obj, list):
        return [map_tensors(value, fn) for value in obj]
    if isinstance(obj, tuple):
        return tuple(map_tensors(value, fn) for value in obj)
    return obj


def tensor_leaves(obj: Any) -> list[torch.Tensor]:
    """All tensors of a nested structure, in a deterministic order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, Mapping):
        return [t for value in obj.values() for t in tensor_leaves(value)]
    if isinstance(obj, (list, tuple)):
        return [t for value in obj for t in tensor_leaves(value)]
    return []
