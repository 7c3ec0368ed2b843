"""Helpers shared by the checkpoint tests: a tiny model trained a few steps so AdamW has state."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_steps(
    model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int = 1
) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(4, 8, generator=gen)
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Deep copy of params (and optimizer state) for bitwise comparison."""
    out: dict[str, Any] = {"params": {k: v.detach().clone() for k, v in model.state_dict().items()}}
    if optimizer is not None:
        out["optim"] = {
            i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
            for i, s in enumerate(optimizer.state.values())
        }
    return out


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["params"].keys() == b["params"].keys()
    for k in a["params"]:
        assert torch.equal(a["params"][k], b["params"][k]), k
    if "optim" in a and "optim" in b:
        assert a["optim"].keys() == b["optim"].keys()
        for i in a["optim"]:
            for k, v in a["optim"][i].items():
                w = b["optim"][i][k]
                assert torch.equal(v, w) if torch.is_tensor(v) else v == w, (i, k)
