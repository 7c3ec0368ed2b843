"""Replica weight check across 3 gloo ranks: agreement, a bit flip on rank 1, subgroups, DTensor."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from stalwart.reliability.rerun.attribution.fingerprints import (
    FSDP2_FLAG,
    ReplicaCheckResult,
    check_replica_consistency,
    parameter_fingerprints,
)

from dist_utils import run_distributed

pytestmark = [pytest.mark.distributed]


def _model() -> nn.Module:
    torch.manual_seed(0)  # identical replicas on every rank
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _dtensor_error(world_size: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    holder = nn.Module()
    holder.p = nn.Parameter(distribute_tensor(torch.ones(world_size * 2, 3), mesh, [Shard(0)]))
    try:
        parameter_fingerprints(holder)
    except ValueError as exc:
        return str(exc)
    return ""


def _body(rank: int, world_size: int) -> dict[str, Any]:
    model = _model()
    out: dict[str, Any] = {"clean": check_replica_consistency(model)}
    out["fingerprints"] = parameter_fingerprints(model).tolist()
    if rank == 1:
        with torch.no_grad():
            model[0].weight.view(-1).view(torch.int32)[5] ^= 1 << 7  # one flipped bit
    out["corrupt"] = check_replica_consistency(model)
    # A subgroup of global ranks [1, 2]: a 1-vs-1 tie keeps group rank 0 (global 1) as the
    # reference, and the disagreeing rank is reported by its global rank, 2.
    sub = dist.new_group([1, 2])
    out["sub"] = check_replica_consistency(model, sub) if rank in (1, 2) else None
    out["dtensor_error"] = _dtensor_error(world_size)
    return out


def test_replica_check_three_ranks() -> None:
    results = run_distributed(_body, world_size=3)
    assert results[0]["fingerprints"] == results[1]["fingerprints"] == results[2]["fingerprints"]
    for out in results:
        assert out["clean"] == ReplicaCheckResult(True, [], [], reference_ranks=[0, 1, 2])
        corrupt = out["corrupt"]
        assert not corrupt.consistent
        assert corrupt.mismatched_ranks == [1]
        assert corrupt.has_majority and "disagree with the majority" in corrupt.describe()
        assert corrupt.mismatched_parameters == ["0.weight"]
        assert "0.weight" in corrupt.describe()
        assert FSDP2_FLAG in out["dtensor_error"]
    assert results[0]["sub"] is None
    assert results[1]["sub"] == results[2]["sub"]
    assert results[1]["sub"].mismatched_ranks == [2]
