"""Loading optimizer state keeps the running job's implementation (eager <-> graph-ready AdamW)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from stalwart.checkpoint import dcp_io
from stalwart.graphs import make_capturable_adamw

CPU = torch.device("cpu")


def _trained(optimizer_factory, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Linear(4, 2)
    optimizer = optimizer_factory(model)
    for _ in range(2):
        model(torch.randn(3, 4)).pow(2).sum().backward()
        optimizer.step()
    return model, optimizer


def _eager(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.01, foreach=True)


def _graph_ready(model: nn.Module) -> torch.optim.Optimizer:
    return make_capturable_adamw(model.parameters(), lr=0.5, device=CPU, fused=True)


def _load(model: nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    state = dcp_io.gather_state(model, optimizer)
    dcp_io.load_into(state, str(path), None, True)
    dcp_io.apply_state(model, optimizer, state, True)


def test_eager_checkpoint_into_a_graph_ready_optimizer(tmp_path: Path) -> None:
    model, optimizer = _trained(_eager)
    dcp_io.save_sync(dcp_io.gather_state(model, optimizer), str(tmp_path), None)
    target_model, target = _trained(_graph_ready, seed=1)
    live_lr = target.param_groups[0]["lr"]
    _load(target_model, target, tmp_path)
    group = target.param_groups[0]
    # Implementation flags and the LR tensor (read in place by a captured graph) survive...
    assert group["capturable"] and group["fused"] and not group["foreach"]
    assert group["lr"] is live_lr and live_lr.item() == torch.tensor(0.01).item()  # loaded value
    state = target.state[target_model.weight]
    assert state["step"].item() == 2.0 and state["step"].dtype == torch.float32
    for a, b in zip(target_model.parameters(), model.parameters()):
        assert torch.equal(a, b)
    # The device-side skip works on the loaded state (found_inf needs the fused path).
    before = [p.detach().clone() for p in target_model.parameters()]
    target.found_inf = torch.ones(())  # type: ignore[attr-defined]
    target_model(torch.randn(3, 4)).sum().backward()
    target.step()
    assert all(torch.equal(p, b) for p, b in zip(target_model.parameters(), before))
    assert state["step"].item() == 2.0


def test_graph_ready_checkpoint_into_an_eager_optimizer(tmp_path: Path) -> None:
    model, optimizer = _trained(_graph_ready)
    dcp_io.save_sync(dcp_io.gather_state(model, optimizer), str(tmp_path), None)
    target_model, target = _trained(_eager, seed=1)
    _load(target_model, target, tmp_path)
    group = target.param_groups[0]
    assert group["foreach"] and not group["capturable"] and not group["fused"]
    assert group["lr"] == 0.5 and not isinstance(group["lr"], torch.Tensor)
    target_model(torch.randn(3, 4)).sum().backward()
    target.step()  # a plain foreach step runs on the loaded state
    assert target.state[target_model.weight]["step"].item() == 3.0
