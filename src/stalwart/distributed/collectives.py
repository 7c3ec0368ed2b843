"""Small collectives that work identically on gloo/CPU and NCCL/GPU.

Every function degrades to the identity when no process group is initialised, so single-process
code calls them unconditionally. Each one is a deliberate host sync: call them once per decision,
never per micro-batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def device_for(group: ProcessGroup | None) -> torch.device:
    """Tensors for a collective must live where the backend expects them (CPU for gloo; the
    CPU too without a process group)."""
    if not is_initialized():
        return torch.device("cpu")
    backend = dist.get_backend(group)
    if backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_device_for = device_for


def world_size(group: ProcessGroup | None = None) -> int:
    """Ranks in ``group`` (1 without a process group)."""
    return dist.get_world_size(group) if is_initialized() else 1


def all_reduce_floats(
    values: Sequence[float], op: dist.ReduceOp.RedOpType, group: ProcessGroup | None = None
) -> list[float]:
    """Reduce a short list of floats across ranks in one collective; identity without a group."""
    if not is_initialized():
        return [float(v) for v in values]
    t = torch.tensor(list(values), dtype=torch.float64, device=_device_for(group))
    dist.all_reduce(t, op=op, group=group)
    return [float(v) for v in t.tolist()]


def all_reduce_max(value: float, group: ProcessGroup | None = None) -> float:
    return all_reduce_floats([value], dist.ReduceOp.MAX, group)[0]


def all_reduce_any(flags: Sequence[bool], group: ProcessGroup | None = None) -> list[bool]:
    """Element-wise logical OR of boolean flags across ranks, in one collective."""
    reduced = all_reduce_floats([1.0 if f else 0.0 for f in flags], dist.ReduceOp.MAX, group)
    return [r > 0.5 for r in reduced]


def all_gather_floats(
    values: Sequence[float], group: ProcessGroup | None = None
) -> list[list[float]]:
    """Gather a fixed-length list of floats from every rank: result[rank] is that rank's list."""
    if not is_initialized():
        return [[float(v) for v in values]]
    device = _device_for(group)
    local = torch.tensor(list(values), dtype=torch.float64, device=device)
    world = dist.get_world_size(group)
    out = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(out, local, group=group)
    return [[float(v) for v in t.tolist()] for t in out]


def all_gather_objects(obj: object, group: ProcessGroup | None = None) -> list[object]:
    """Gather one picklable object per rank (for rare, small metadata such as device identity)."""
    if not is_initialized():
        return [obj]
    out: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: object, src: int = 0, group: ProcessGroup | None = None) -> object:
    """Broadcast one picklable object from ``src``; identity without a group."""
    if not is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def barrier(group: ProcessGroup | None = None) -> None:
    if is_initialized():
        dist.barrier(group=group)
