from __future__ import annotations

import pytest
import torch

from stalwart.models import GPT, GPTConfig, MoEMLP
from stalwart.models.moe import expert_capacity


def _cfg(**overrides: object) -> GPTConfig:
    values: dict[str, object] = {
        "num_layers": 2,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "seq_length": 16,
        "vocab_size": 64,
        "num_experts": 4,
        "moe_router_topk": 2,
    }
    values.update(overrides)
    return GPTConfig(**values)  # type: ignore[arg-type]


def test_capacity_formula() -> None:
    assert expert_capacity(100, 8, 2, 1.25) == 32  # ceil(1.25 * 2 * 100 / 8) = ceil(31.25)
    assert expert_capacity(100, 8, 2, None) == 100
    assert expert_capacity(4, 64, 1, 0.01) == 1


def test_moe_forward_backward_and_observability() -> None:
    torch.manual_seed(0)
    model = GPT(_cfg())
    ids = torch.randint(0, 64, (3, 16))
    out = model(ids, ids)
    assert isinstance(out, dict)
    assert set(out) == {"loss", "lm loss", "load balancing loss"}
    aux = out["load balancing loss"]
    assert aux.item() > 0.0 and not aux.requires_grad
    # loss = lm + coeff * sum over the 2 MoE layers (reported value is the per-layer mean).
    torch.testing.assert_close(out["loss"].detach(), out["lm loss"] + 1e-2 * 2 * aux)
    out["loss"].backward()
    routers = model.moe_routers()
    assert [n for n, _ in routers] == ["layers.0.mlp.router", "layers.1.mlp.router"]
    for _, router in routers:
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
        counts = router.last_tokens_per_expert
        assert counts.dtype == torch.int64 and counts.shape == (4,)
        assert int(counts.sum()) == 2 * 3 * 16
        assert router.last_num_dropped_tokens.dim() == 0
    assert "last_tokens_per_expert" not in "".join(model.state_dict())


def test_capacity_dropping_passes_residual() -> None:
    torch.manual_seed(0)
    mlp = MoEMLP(8, 16, num_experts=2, topk=1, capacity_factor=0.5)
    with torch.no_grad():
        mlp.router.weight.zero_()
        mlp.router.weight[0, 0] = 10.0  # every token with x[:, 0] > 0 prefers expert 0
        for p in (mlp.fc1_weight, mlp.fc2_weight):
            p.normal_()
    x = torch.randn(10, 8)
    x[:, 0] = 1.0  # all 10 tokens pick expert 0; capacity = ceil(0.5 * 10 / 2) = 3
    out, aux = mlp(x)
    assert mlp.router.last_tokens_per_expert.tolist() == [10, 0]
    assert int(mlp.router.last_num_dropped_tokens) == 7
    assert (out[:3].abs().sum(dim=1) > 0).all()
    assert torch.equal(out[3:], torch.zeros_like(out[3:]))  # dropped -> MLP contributes nothing
    assert aux.item() > 1.5  # all mass on one expert: aux = 2 * (1 * p0) with p0 ~ 1


def test_no_drop_matches_dense_per_token_computation() -> None:
    torch.manual_seed(1)
    mlp = MoEMLP(8, 16, num_experts=3, topk=2, capacity_factor=None)
    with torch.no_grad():
        for p in (mlp.router.weight, mlp.fc1_weight, mlp.fc2_weight, mlp.fc1_bias, mlp.fc2_bias):
            p.normal_()
    x = torch.randn(2, 5, 8)
    out, _ = mlp(x)
    assert out.shape == x.shape and int(mlp.router.last_num_dropped_tokens) == 0
    flat = x.reshape(-1, 8)
    probs = torch.softmax(flat @ mlp.router.weight.t(), dim=-1)
    top_p, top_e = probs.topk(2, dim=-1)
    top_p = top_p / top_p.sum(-1, keepdim=True)
    expected = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        for j in range(2):
            e = int(top_e[t, j])
            h = torch.nn.functional.gelu(flat[t] @ mlp.fc1_weight[e] + mlp.fc1_bias[e, 0])
            expected[t] += top_p[t, j] * (h @ mlp.fc2_weight[e] + mlp.fc2_bias[e, 0])
    torch.testing.assert_close(out.reshape(-1, 8), expected, rtol=1e-4, atol=1e-5)


def test_moe_bf16_autocast_router_fp32() -> None:
    torch.manual_seed(0)
    model = GPT(_cfg(num_layers=1, moe_router_topk=1))
    ids = torch.randint(0, 64, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids, ids)
    assert isinstance(out, dict)
    assert out["lm loss"].dtype == torch.float32 and torch.isfinite(out["loss"])
    out["loss"].backward()


@pytest.mark.parametrize("topk", [1, 2])
def test_moe_training_step_lowers_loss(topk: int) -> None:
    torch.manual_seed(0)
    model = GPT(_cfg(moe_router_topk=topk))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, 64, (4, 16))
    first = model(ids, ids)
    assert isinstance(first, dict)
    first["loss"].backward()
    opt.step()
    second = model(ids, ids)
    assert isinstance(second, dict)
    assert second["lm loss"].item() < first["lm loss"].item()


@pytest.mark.slow
def test_moe_model_compiles_fullgraph_without_breaks() -> None:
    # fullgraph=True fails on any graph break, e.g. .item() or data-dependent shapes.
    torch.manual_seed(0)
    model = GPT(_cfg(num_layers=1))
    ids = torch.randint(0, 64, (2, 16))
    expected = model(ids, ids)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    out = compiled(ids, ids)
    assert isinstance(out, dict) and isinstance(expected, dict)
    torch.testing.assert_close(out["loss"], expected["loss"])
    out["loss"].backward()
    assert int(model.moe_routers()[0][1].last_tokens_per_expert.sum()) == 2 * 2 * 16
