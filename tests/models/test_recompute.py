"""Activation recompute: the same numbers bitwise (dropout on), less memory, Megatron's rules."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from stalwart.models import GPT, GPTConfig, layer_units
from stalwart.models.blocks import CausalSelfAttention, TransformerBlock
from stalwart.models.memory_model import theoretical_memory
from stalwart.observability.memory import cpu_peak_allocated_bytes

BASE: dict[str, Any] = {
    "num_layers": 4,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "seq_length": 16,
    "vocab_size": 64,
    "dropout": 0.1,
}
LLAMA: dict[str, Any] = {
    "position_embedding_type": "rope",
    "normalization": "RMSNorm",
    "swiglu": True,
    "untie_embeddings_and_output_weights": True,
    "add_bias_linear": False,
    "num_query_groups": 2,
}
ARCHS = {
    "gpt": {},
    "llama": LLAMA,
    "moe": {"num_experts": 4, "moe_router_topk": 2, **LLAMA},
}
RECOMPUTE = {
    "full-uniform-2": {
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": 2,
    },
    "full-uniform-1": {
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": 1,
    },
    "full-block-3": {
        "recompute_granularity": "full",
        "recompute_method": "block",
        "recompute_num_layers": 3,
    },
    "selective": {"recompute_granularity": "selective"},
}


def _cfg(**overrides: Any) -> GPTConfig:
    return GPTConfig(**{**BASE, **overrides})


def _train_two_steps(cfg: GPTConfig) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Losses and final grads of two AdamW steps (2 micro-batches each), and the RNG after."""
    torch.manual_seed(0)
    model = GPT(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(2):
        opt.zero_grad()
        for _ in range(2):
            ids = torch.randint(0, cfg.vocab_size, (3, cfg.seq_length), generator=gen)
            out = model(ids, ids.roll(-1, dims=1))
            assert isinstance(out, dict)
            (out["loss"] / 2).backward()
            losses.append(out["loss"].detach())
        opt.step()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return losses, grads, torch.rand(4)


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("recompute", sorted(RECOMPUTE))
def test_recompute_is_bitwise_with_dropout(arch: str, recompute: str) -> None:
    ref_losses, ref_grads, ref_rng = _train_two_steps(_cfg(**ARCHS[arch]))
    losses, grads, rng = _train_two_steps(_cfg(**ARCHS[arch], **RECOMPUTE[recompute]))
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses))
    assert len(grads) == len(ref_grads)
    assert all(torch.equal(a, b) for a, b in zip(ref_grads, grads))
    assert torch.equal(ref_rng, rng)  # the recompute put the generator back where it was


def _forward_calls(cfg: GPTConfig, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How often each block / attention core runs in one forward + backward."""
    calls = {"block": 0, "core": 0}
    block_forward, core = TransformerBlock.forward, CausalSelfAttention._core

    def counted_block(self: Any, *args: Any) -> Any:
        calls["block"] += 1
        return block_forward(self, *args)

    def counted_core(self: Any, *args: Any) -> Any:
        calls["core"] += 1
        return core(self, *args)

    monkeypatch.setattr(TransformerBlock, "forward", counted_block)
    monkeypatch.setattr(CausalSelfAttention, "_core", counted_core)
    model = GPT(cfg)
    ids = torch.zeros(2, cfg.seq_length, dtype=torch.long)
    out = model(ids, ids)
    assert isinstance(out, dict)
    out["loss"].backward()
    return calls


@pytest.mark.parametrize(
    ("recompute", "blocks", "cores"),
    [
        (None, 4, 4),
        ("full-uniform-2", 8, 8),  # every layer runs again in backward
        ("full-block-3", 7, 7),  # the first three layers run again
        ("selective", 4, 8),  # only the attention cores run again
    ],
)
def test_recompute_runs_the_modules_again_in_backward(
    monkeypatch: pytest.MonkeyPatch, recompute: str | None, blocks: int, cores: int
) -> None:
    cfg = _cfg(**LLAMA, **(RECOMPUTE[recompute] if recompute else {}))
    assert _forward_calls(cfg, monkeypatch) == {"block": blocks, "core": cores}


def test_evaluation_is_a_plain_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _cfg(**RECOMPUTE["full-uniform-1"])
    model = GPT(cfg).eval()
    reference = GPT(_cfg()).eval()
    reference.load_state_dict(model.state_dict())
    ids = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        assert torch.equal(model(ids), reference(ids))  # type: ignore[arg-type]


def test_without_dropout_the_rng_state_is_never_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """What lets recompute run inside a captured CUDA graph: no generator state read or set."""

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("RNG state touched")

    monkeypatch.setattr(torch, "get_rng_state", forbidden)
    monkeypatch.setattr(torch, "set_rng_state", forbidden)
    for recompute in RECOMPUTE.values():
        model = GPT(_cfg(**LLAMA, **recompute, dropout=0.0))
        out = model(torch.zeros(2, 16, dtype=torch.long), torch.zeros(2, 16, dtype=torch.long))
        assert isinstance(out, dict)
        out["loss"].backward()
    # With dropout the checkpoint must save the state (and so would fail here).
    model = GPT(_cfg(**RECOMPUTE["full-uniform-1"]))
    with pytest.raises(AssertionError, match="RNG state touched"):
        model(torch.zeros(2, 16, dtype=torch.long), torch.zeros(2, 16, dtype=torch.long))


def test_layer_units_follow_megatron() -> None:
    full = {"recompute_granularity": "full"}
    units = layer_units(_cfg(**full, recompute_method="uniform", recompute_num_layers=2))
    assert [tuple(u) for u in units] == [(0, 2, True), (2, 4, True)]
    units = layer_units(_cfg(**full, recompute_method="block", recompute_num_layers=1))
    assert [u.recompute for u in units] == [True, False, False, False]
    units = layer_units(_cfg(recompute_granularity="selective"))
    assert [u.recompute for u in units] == [False] * 4


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"recompute_granularity": "bogus"}, "--recompute-granularity must be one of"),
        ({"recompute_method": "uniform"}, "--recompute-method uniform requires"),
        (
            {"recompute_granularity": "selective", "recompute_method": "block"},
            "--recompute-method block requires --recompute-granularity full",
        ),
        (
            {"recompute_granularity": "selective", "recompute_num_layers": 1},
            "--recompute-num-layers requires --recompute-granularity full",
        ),
        ({"recompute_granularity": "full"}, "requires --recompute-method uniform or block"),
        (
            {"recompute_granularity": "full", "recompute_method": "block"},
            "requires --recompute-num-layers",
        ),
        (
            {
                "recompute_granularity": "full",
                "recompute_method": "block",
                "recompute_num_layers": 5,
            },
            r"--recompute-num-layers must be an integer in \[1, --num-layers=4\], got 5",
        ),
        (
            {
                "recompute_granularity": "full",
                "recompute_method": "block",
                "recompute_num_layers": 0,
            },
            "--recompute-num-layers must be an integer",
        ),
        (
            {
                "recompute_granularity": "full",
                "recompute_method": "uniform",
                "recompute_num_layers": 3,
            },
            r"uniform needs --recompute-num-layers \(3\) to divide --num-layers \(4\)",
        ),
        (
            {
                "recompute_granularity": "full",
                "recompute_method": "sideways",
                "recompute_num_layers": 1,
            },
            "--recompute-method must be one of uniform, block",
        ),
    ],
)
def test_bad_recompute_settings_name_the_flag(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _cfg(**overrides)


def _peak_and_estimate(cfg: GPTConfig) -> tuple[float, float]:
    """Measured CPU peak of 2 micro-batches + AdamW step (fp32), and the formula's same part.

    Gradients are zeroed in place, so params, grads and Adam states (16 bytes/param) all exist
    before the measured window: it holds the activations and the step's transients.
    """
    torch.manual_seed(0)
    model = GPT(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    ids = torch.randint(0, cfg.vocab_size, (4, cfg.seq_length))

    def step() -> None:
        opt.zero_grad(set_to_none=False)
        for _ in range(2):
            out = model(ids, ids)
            assert isinstance(out, dict)
            (out["loss"] / 2).backward()
        opt.step()

    step()  # the grads and Adam states exist from here on
    peak = cpu_peak_allocated_bytes(step)
    n = model.num_parameters()
    est = theoretical_memory(cfg, 4, 1, bf16=False, workspace_bytes=0, fused_rms_norm=False)
    return peak, est.total_bytes - 16.0 * n


@pytest.mark.parametrize("arch", ["gpt", "llama", "moe"])
def test_recompute_lowers_measured_memory_as_the_formula_says(arch: str) -> None:
    shapes = {"num_layers": 4, "hidden_size": 64, "seq_length": 64, "vocab_size": 256}
    base = _cfg(**ARCHS[arch], **shapes, ffn_hidden_size=192, dropout=0.0)
    measured = {}
    for name, recompute in {"none": {}, **RECOMPUTE}.items():
        peak, estimate = _peak_and_estimate(dataclasses.replace(base, **recompute))
        measured[name] = peak
        assert 0.9 <= estimate / peak <= 1.1, (name, estimate, peak)  # measured: 0.97-1.05
    assert measured["full-uniform-1"] < 0.7 * measured["none"]
    assert measured["full-block-3"] < measured["none"]
    assert measured["selective"] <= measured["none"]
