from __future__ import annotations

import math

import pytest
import torch

from stalwart.models import GPT, GPTConfig


def _cfg(**overrides: object) -> GPTConfig:
    values: dict[str, object] = {
        "num_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "seq_length": 16,
        "vocab_size": 128,
    }
    values.update(overrides)
    return GPTConfig(**values)  # type: ignore[arg-type]


def test_config_resolves_ffn_and_is_frozen() -> None:
    cfg = _cfg()
    assert cfg.ffn_hidden_size == 256 and cfg.ffn_size == 256
    with pytest.raises(AttributeError):
        cfg.hidden_size = 8  # type: ignore[misc]


@pytest.mark.parametrize(
    ("overrides", "flag"),
    [
        ({"num_layers": 0}, "--num-layers"),
        ({"hidden_size": 0}, "--hidden-size"),
        ({"num_attention_heads": 5}, "--num-attention-heads"),
        ({"seq_length": 0}, "--seq-length"),
        ({"vocab_size": 0}, "--vocab-size"),
        ({"ffn_hidden_size": 0}, "--ffn-hidden-size"),
        ({"dropout": 1.0}, "--hidden-dropout"),
        ({"num_experts": -1}, "--num-experts"),
        ({"num_experts": 4, "moe_router_topk": 5}, "--moe-router-topk"),
        ({"num_experts": 4, "moe_router_topk": 0}, "--moe-router-topk"),
        ({"moe_aux_loss_coeff": -1.0}, "--moe-aux-loss-coeff"),
        ({"moe_capacity_factor": 0.0}, "--moe-expert-capacity-factor"),
        ({"init_std": 0.0}, "--init-method-std"),
        ({"layernorm_epsilon": 0.0}, "--norm-epsilon"),
        ({"num_layers": True}, "--num-layers"),
    ],
)
def test_bad_config_names_flag(overrides: dict[str, object], flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        _cfg(**overrides)


def test_shapes_and_loss_at_init() -> None:
    torch.manual_seed(0)
    model = GPT(_cfg(vocab_size=512))
    ids = torch.randint(0, 512, (3, 16))
    logits = model(ids)
    assert isinstance(logits, torch.Tensor) and logits.shape == (3, 16, 512)
    out = model(ids, torch.randint(0, 512, (3, 16)))
    assert isinstance(out, dict) and set(out) == {"loss", "lm loss"}
    assert out["loss"].dim() == 0 and not out["lm loss"].requires_grad
    assert abs(out["lm loss"].item() - math.log(512)) < 0.3
    assert torch.equal(out["loss"].detach(), out["lm loss"])


def test_shorter_sequence_ok_longer_rejected() -> None:
    model = GPT(_cfg())
    assert model(torch.zeros(1, 5, dtype=torch.long)).shape == (1, 5, 128)  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="--seq-length"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_causal() -> None:
    torch.manual_seed(0)
    model = GPT(_cfg()).eval()
    ids = torch.randint(0, 128, (2, 16))
    changed = ids.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 128
    a, b = model(ids), model(changed)
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_tied_embeddings_and_param_count() -> None:
    cfg = _cfg()
    model = GPT(cfg)
    names = [n for n, _ in model.named_parameters()]
    assert not any("lm_head" in n or "output" in n for n in names)
    h, v, s, f, n_layers = 64, 128, 16, 256, 2
    per_layer = 2 * h + (3 * h * h + 3 * h) + (h * h + h) + 2 * h + (h * f + f) + (f * h + h)
    expected = v * h + s * h + n_layers * per_layer + 2 * h
    assert model.num_parameters() == expected
    assert model.num_parameters(exclude_embeddings=True) == expected - v * h - s * h
    ids = torch.randint(0, 128, (1, 8))
    out = model(ids, ids)
    assert isinstance(out, dict)
    out["loss"].backward()
    assert model.word_embeddings.weight.grad is not None


def test_init_deterministic_and_residual_scaling() -> None:
    torch.manual_seed(123)
    a = GPT(_cfg(num_layers=8))
    torch.manual_seed(123)
    b = GPT(_cfg(num_layers=8))
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    proj = a.layers[0].attn.proj.weight.std().item()
    qkv = a.layers[0].attn.qkv.weight.std().item()
    assert abs(qkv - 0.02) < 0.002
    assert abs(proj - 0.02 / 4.0) < 0.001


def test_one_step_lowers_loss_with_dropout() -> None:
    torch.manual_seed(0)
    model = GPT(_cfg(dropout=0.1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, 128, (4, 16))
    labels = torch.roll(ids, -1, dims=1)
    model.eval()
    before = model(ids, labels)
    model.train()
    out = model(ids, labels)
    assert isinstance(out, dict) and isinstance(before, dict)
    out["loss"].backward()
    opt.step()
    model.eval()
    after = model(ids, labels)
    assert isinstance(after, dict)
    assert after["lm loss"].item() < before["lm loss"].item() - 0.05


def test_ignore_index_labels() -> None:
    model = GPT(_cfg())
    ids = torch.randint(0, 128, (1, 8))
    labels = ids.clone()
    labels[:, :4] = -100
    full = model(ids[:, :], labels)
    assert isinstance(full, dict) and torch.isfinite(full["lm loss"])


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"position_embedding_type": "rope", "normalization": "RMSNorm", "swiglu": True},
        {"num_experts": 4, "moe_router_topk": 2},
    ],
    ids=["learned", "rope", "moe"],
)
def test_for_loading_is_zero_and_computes_as_the_model_once_loaded(overrides) -> None:
    cfg = _cfg(**overrides)
    torch.manual_seed(0)
    fresh = GPT(cfg)
    blank = GPT.for_loading(cfg, "cpu")
    assert all(p.device.type == "cpu" and not p.is_meta for p in blank.parameters())
    assert all(bool((p == 0).all()) for p in blank.parameters())
    # Non-persistent buffers are no checkpoint's: they must equal a freshly built model's.
    fresh_buffers = dict(fresh.named_buffers())
    for name, buf in blank.named_buffers():
        assert torch.equal(buf, fresh_buffers[name]), name
    blank.load_state_dict(fresh.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length))
    fresh.eval(), blank.eval()
    assert torch.equal(fresh(ids, ids)["loss"], blank(ids, ids)["loss"])
