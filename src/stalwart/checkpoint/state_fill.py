"""Put a saved state (a shard's skeleton and its tensors by path) into a live model and
optimizer, as a DCP load does: in place, tensor by tensor, then through torch's
``set_state_dict`` (`stalwart.checkpoint.dcp_io.apply_state`).

    >>> import torch
    >>> from stalwart.checkpoint.shard_format import split_tensors
    >>> model = torch.nn.Linear(2, 1)
    >>> saved = {"model": {k: v.clone().fill_(0.5) for k, v in model.state_dict().items()}}
    >>> skeleton, tensors = split_tensors(saved)
    >>> load_into_model(model, None, skeleton, tensors, strict=True, where="demo")
    >>> model.bias.item()
    0.5
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from stalwart.checkpoint import dcp_io
from stalwart.checkpoint.errors import CheckpointError
from stalwart.checkpoint.shard_format import local_part, placeholder_path


def _copy(target: Any, saved: torch.Tensor, where: str, key: Any) -> None:
    if not isinstance(target, torch.Tensor):
        raise CheckpointError(f"{where}: {key!r} is a tensor in the copy, not in this run")
    local = local_part(target)[0]
    if tuple(local.shape) != tuple(saved.shape) or local.dtype != saved.dtype:
        raise CheckpointError(
            f"{where}: {key!r} is {saved.dtype} {tuple(saved.shape)} in the copy, "
            f"{local.dtype} {tuple(local.shape)} in this run"
        )
    with torch.no_grad():
        local.copy_(saved)


def fill(target: Any, saved: Any, tensors: Mapping[str, torch.Tensor], where: str) -> Any:
    """``target`` with ``saved``'s values: a placeholder's tensor copied into the target's
    tensor at the same place (shape and dtype checked), dicts and lists walked, any other value
    taken from ``saved``. Returns the filled value (the same object for tensors, dicts, lists)."""
    path = placeholder_path(saved)
    if path is not None:
        if path not in tensors:
            raise CheckpointError(f"{where}: no shard holds the tensor {path[:80]}")
        _copy(target, tensors[path], where, path)
        return target
    if isinstance(saved, dict) and isinstance(target, dict):
        for key, value in saved.items():
            target[key] = fill(target.get(key), value, tensors, where)
        return target
    sequences = isinstance(saved, (list, tuple)) and isinstance(target, (list, tuple))
    if sequences and len(target) == len(saved):
        items = [fill(t, s, tensors, where) for t, s in zip(target, saved, strict=True)]
        return items if isinstance(saved, list) else tuple(items)
    if _holds_placeholder(saved):
        raise CheckpointError(f"{where}: the copy's state does not match this run's structure")
    return saved


def materialize(value: Any, tensors: Mapping[str, torch.Tensor], where: str) -> Any:
    """``value`` with each placeholder replaced by a copy of its tensor (a loop's small state:
    RNG states and the like, handed to its parts' ``load_state_dict``)."""
    path = placeholder_path(value)
    if path is not None:
        if path not in tensors:
            raise CheckpointError(f"{where}: no shard holds the tensor {path[:80]}")
        return tensors[path].clone()
    if isinstance(value, dict):
        return {k: materialize(v, tensors, where) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [materialize(v, tensors, where) for v in value]
        return items if isinstance(value, list) else tuple(items)
    return value


def _holds_placeholder(value: Any) -> bool:
    if placeholder_path(value) is not None:
        return True
    if isinstance(value, dict):
        return any(_holds_placeholder(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_placeholder(v) for v in value)
    return False


def _saved_optimizer_keys(skeleton: Any) -> list[str]:
    per_param = (
        skeleton.get(dcp_io.OPTIM_KEY, {}).get("state") if isinstance(skeleton, dict) else None
    )
    if not isinstance(per_param, dict):
        return []
    return [
        f"{dcp_io.OPTIM_KEY}.state.{fqn}.{name}"
        for fqn, entries in per_param.items()
        if isinstance(entries, dict)
        for name in entries
    ]


def load_into_model(
    model: nn.Module,
    optimizer: Optimizer | None,
    skeleton: Any,
    tensors: Mapping[str, torch.Tensor],
    *,
    strict: bool,
    where: str,
) -> None:
    """Restore ``model`` (and ``optimizer``) from a saved `dcp_io.gather_state` tree given as
    its skeleton and tensors (see `stalwart.checkpoint.shard_format`).

    Raises:
        CheckpointError: naming ``where`` when the copy does not fit this model/optimizer.
    """
    if not isinstance(skeleton, dict) or dcp_io.MODEL_KEY not in skeleton:
        raise CheckpointError(f"{where}: the copy holds no model state")
    state = dcp_io.gather_state(model, optimizer)
    if optimizer is not None:
        if dcp_io.OPTIM_KEY not in skeleton:
            raise CheckpointError(f"{where}: the copy holds no optimizer state")
        # Parameters the copy has no optimizer state for (saved before their first step).
        dcp_io.prune_unsaved_optimizer_state(state, _saved_optimizer_keys(skeleton))
    wanted = {k: v for k, v in skeleton.items() if k in state}
    fill(state, wanted, tensors, where)
    try:
        dcp_io.apply_state(model, optimizer, state, strict)
    except (RuntimeError, KeyError, ValueError) as exc:
        raise CheckpointError(f"{where}: loading model/optimizer failed: {exc}") from exc


__all__ = ["fill", "load_into_model", "materialize"]
