"""Keep the running optimizer's implementation when its state is loaded from a checkpoint.

A checkpoint carries training progress (moments, step counts, hyperparameter values). How the
optimizer runs is a property of the current job: ``capturable``/``fused``/``foreach`` and whether
the learning rate is a device tensor (which a captured optimizer graph reads in place). torch's
``Optimizer.load_state_dict`` takes all of these from the checkpoint, so resuming a checkpoint of
an eager run under ``--optimizer-cuda-graph`` (or the other way round) would silently switch the
implementation: a float LR frozen into the graph, ``found_inf`` handed to a foreach step, step
counters left on the CPU for a capturable step. :func:`keep_optimizer_implementation` restores
them after the load, and :func:`canonical_learning_rates` stores every LR as a float, so a
checkpoint's layout (DCP metadata) does not depend on the mode that wrote it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.optim import Optimizer

IMPLEMENTATION_KEYS = ("capturable", "fused", "foreach", "differentiable")


@contextlib.contextmanager
def keep_optimizer_implementation(optimizer: Optimizer | None) -> Iterator[None]:
    """Around a state load: afterwards each group keeps its implementation flags and LR object
    (a tensor LR is refilled in place with the loaded value), and step counters move to the
    parameters' device as float32 where a capturable or fused step expects them."""
    if optimizer is None:
        yield
        return
    saved = [
        ({k: group[k] for k in IMPLEMENTATION_KEYS if k in group}, group.get("lr"))
        for group in optimizer.param_groups
    ]
    yield
    for group, (flags, live_lr) in zip(optimizer.param_groups, saved, strict=True):
        group.update(flags)
        if isinstance(live_lr, torch.Tensor):
            loaded = group["lr"]
            value = float(loaded.item() if isinstance(loaded, torch.Tensor) else loaded)
            live_lr.fill_(value)  # not a sync: the loaded value is on the host or tiny
            group["lr"] = live_lr
        if group.get("capturable") or group.get("fused"):
            _steps_on_param_device(optimizer, group)


def _steps_on_param_device(optimizer: Optimizer, group: dict[str, Any]) -> None:
    for param in group["params"]:
        state = optimizer.state.get(param)
        step = None if state is None else state.get("step")
        if isinstance(step, torch.Tensor) and (
            step.device != param.device or step.dtype != torch.float32
        ):
            state["step"] = step.to(device=param.device, dtype=torch.float32)  # type: ignore[index]


def canonical_learning_rates(optim_state: dict[str, Any]) -> dict[str, Any]:
    """Replace tensor LRs in an optimizer state dict's ``param_groups`` by floats (in place).

    DCP stores a float as bytes and a tensor as a tensor, and refuses to load one into the
    other, so without this a graph-mode checkpoint (device-tensor LR) could not be resumed
    eagerly, nor an eager one under ``--optimizer-cuda-graph``.
    """
    for group in optim_state.get("param_groups", []):
        lr = group.get("lr")
        if isinstance(lr, torch.Tensor):
            group["lr"] = float(lr.item())  # Deliberate sync: checkpoint save/load only
    return optim_state
