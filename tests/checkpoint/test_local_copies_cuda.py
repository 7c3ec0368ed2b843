"""CUDA: a local or in-memory snapshot holds the state of the iteration it was taken at, while
the GPU trains on (the host copy runs on a side stream; the next optimizer step changes the
weights under it), and loads back bitwise."""

from __future__ import annotations

import pytest
import torch

from stalwart.checkpoint import dcp_io
from stalwart.checkpoint.in_memory import InMemorySnapshots
from stalwart.checkpoint.local import LocalCheckpoints
from stalwart.checkpoint.shard_format import tensor_table
from stalwart.checkpoint.staging import HostStager

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _model(fused: bool = True) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """``fused=False``: AdamW keeps its step counts on the CPU (a snapshot of mixed devices)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 8)).cuda()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused, foreach=False)


def _steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, n: int) -> None:
    for _ in range(n):
        optimizer.zero_grad()
        model(torch.randn(64, 1024, device="cuda")).pow(2).mean().backward()
        optimizer.step()


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    state = dcp_io.gather_state(model, optimizer)
    out = {f"model.{k}": v.detach().cpu().clone() for k, v in state["model"].items()}
    for fqn, entries in state["optim"]["state"].items():
        out |= {f"optim.{fqn}.{k}": v.detach().cpu().clone() for k, v in entries.items()}
    return out


def test_the_host_copy_is_the_state_at_the_snapshot_while_training_goes_on() -> None:
    model, optimizer = _model()
    _steps(model, optimizer, 2)
    tensors = dict(model.state_dict())
    expected = {k: v.cpu().clone() for k, v in tensors.items()}
    table, size = tensor_table(tensors)
    staged = HostStager(torch.device("cuda")).stage(list(tensors.values()), table, size)
    _steps(model, optimizer, 3)  # the weights change on the device while the copy runs
    staged.wait()
    assert staged.data.is_pinned()
    for entry, key in zip(table, tensors, strict=True):
        assert torch.equal(staged.view(entry), expected[key]), key
    assert not torch.equal(model.state_dict()["0.weight"].cpu(), expected["0.weight"])


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("kind", ["local", "in_memory"])
def test_a_snapshot_loads_back_bitwise(kind: str, fused: bool, tmp_path) -> None:
    model, optimizer = _model(fused)
    _steps(model, optimizer, 2)
    copies = LocalCheckpoints(str(tmp_path)) if kind == "local" else InMemorySnapshots()
    copies.check_writable()
    copies.save(2, dcp_io.gather_state(model, optimizer, for_save=True), {"it": 2}, {})
    at_2 = _state(model, optimizer)
    _steps(model, optimizer, 3)
    copies.maybe_finalize(blocking=True)
    offer = copies.plan([copies.report()], exclude=set())
    problem, small = copies.load(offer.plan, model, optimizer, strict=True, check_common=None)
    assert problem is None and small[0] == {"it": 2}
    after = _state(model, optimizer)
    assert after.keys() == at_2.keys()
    for key, value in at_2.items():
        assert torch.equal(after[key], value), key
    copies.close()
