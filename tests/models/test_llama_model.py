"""Llama switches: parameter counts vs the formulas, RoPE, GQA, SwiGLU, FLOPs vs a FLOP counter."""

from __future__ import annotations

import doctest
import itertools
from typing import Any

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import stalwart.models.config
import stalwart.models.gpt
import stalwart.models.recompute
from stalwart.models import GPT, GPTConfig, num_floating_point_operations, preset_model_config
from stalwart.models import functional as F_models
from stalwart.models.memory_model import count_parameters

BASE: dict[str, Any] = {
    "num_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "seq_length": 16,
    "vocab_size": 64,
    "ffn_hidden_size": 48,
}
SWITCHES = {
    "position_embedding_type": ("learned_absolute", "rope"),
    "normalization": ("LayerNorm", "RMSNorm"),
    "swiglu": (False, True),
    "untie_embeddings_and_output_weights": (False, True),
    "add_bias_linear": (True, False),
    "num_query_groups": (None, 2, 1),
    "num_experts": (0, 4),
}
COMBOS = [dict(zip(SWITCHES, values)) for values in itertools.product(*SWITCHES.values())]


def _cfg(**overrides: Any) -> GPTConfig:
    return GPTConfig(**{**BASE, **overrides})


def _megatron_parameters(cfg: GPTConfig) -> int:
    """Megatron's ``compute_weight_and_optimizer_memory`` count (no biases, no learned positions)."""
    h, heads, groups, f = cfg.hidden_size, cfg.num_attention_heads, cfg.query_groups, cfg.ffn_size
    gate = 1.5 if cfg.swiglu else 1.0
    norm = 1 if cfg.normalization.value == "RMSNorm" else 2
    attention = 2 * h * h * (1 + groups / heads)
    mlp = 2 * h * f * gate
    if cfg.is_moe:
        mlp = 2 * h * f * cfg.num_experts * gate + h * cfg.num_experts
    layer = attention + mlp + 2 * h * norm
    embeddings = h * cfg.vocab_size * (2 if cfg.untie_embeddings_and_output_weights else 1)
    return int(cfg.num_layers * layer + embeddings + norm * h)


@pytest.mark.parametrize("switches", COMBOS, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_parameter_count_matches_both_formulas(switches: dict[str, Any]) -> None:
    cfg = _cfg(**switches)
    with torch.device("meta"):
        model = GPT(cfg)
    assert model.num_parameters() == count_parameters(cfg)
    if cfg.uses_rope and not cfg.add_bias_linear:  # Megatron counts neither biases nor positions
        assert model.num_parameters() == _megatron_parameters(cfg)


def test_llama_parameters_are_the_expected_ones() -> None:
    model = GPT(preset_model_config("llama-tiny", num_layers=1))
    names = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert names == {
        "word_embeddings.weight": (8192, 256),
        "layers.0.ln1.weight": (256,),
        "layers.0.attn.qkv.weight": (256 + 2 * 128, 256),  # 4 heads of 64, 2 key/value groups
        "layers.0.attn.proj.weight": (256, 256),
        "layers.0.ln2.weight": (256,),
        "layers.0.mlp.fc1.weight": (2 * 704, 256),  # [gate | up]
        "layers.0.mlp.fc2.weight": (256, 704),
        "final_layernorm.weight": (256,),
        "output_layer.weight": (8192, 256),
    }
    assert not [n for n, _ in model.named_buffers() if n in model.state_dict()]  # RoPE tables
    assert model.num_parameters(exclude_embeddings=True) == model.num_parameters() - 2 * 8192 * 256


def test_gpt2_defaults_are_unchanged() -> None:
    """The default switches build exactly the GPT-2 model (same names, same init, same output)."""
    torch.manual_seed(0)
    default = GPT(_cfg())
    torch.manual_seed(0)
    explicit = GPT(
        _cfg(
            position_embedding_type="learned_absolute",
            normalization="LayerNorm",
            num_query_groups=4,  # = heads: multi-head attention
        )
    )
    assert default.state_dict().keys() == explicit.state_dict().keys()
    ids = torch.randint(0, 64, (2, 16))
    assert torch.equal(default(ids), explicit(ids))  # type: ignore[arg-type]


def test_rope_scores_depend_on_relative_position_only() -> None:
    cos, sin = F_models.rotary_tables(8, 32, 10000.0)
    q, k = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    seq = torch.zeros(1, 32, 1, 8, dtype=torch.float64)

    def rotated(vec: torch.Tensor, pos: int) -> torch.Tensor:
        x = seq.clone()
        x[0, pos, 0] = vec
        return F_models.apply_rotary(x, cos.double(), sin.double())[0, pos, 0]

    score = [rotated(q, m) @ rotated(k, m - 3) for m in (3, 10, 31)]
    torch.testing.assert_close(score[0], score[1])
    torch.testing.assert_close(score[0], score[2])
    torch.testing.assert_close(rotated(q, 0), q)  # position 0: no rotation
    assert not torch.allclose(rotated(q, 5) @ rotated(k, 0), score[0])


def test_gqa_fallback_matches_enable_gqa(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 16, 8), torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
    native = F_models.causal_attention(q, k, v, 0.0)
    monkeypatch.setattr(F_models, "SDPA_HAS_GQA", False)  # the torch < 2.5 path
    repeated = F_models.causal_attention(q, k, v, 0.0)
    torch.testing.assert_close(native, repeated)
    # Group g serves query heads 2g and 2g+1.
    head1 = torch.nn.functional.scaled_dot_product_attention(
        q[:, 1:2], k[:, :1], v[:, :1], is_causal=True
    )
    torch.testing.assert_close(native[:, 1:2], head1)


@pytest.mark.parametrize("preset", ["llama-tiny", "tiny"])
def test_causal_and_finite(preset: str) -> None:
    torch.manual_seed(0)
    model = GPT(preset_model_config(preset, num_layers=1, seq_length=16)).eval()
    ids = torch.randint(0, 8192, (2, 16))
    changed = ids.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 8192
    a, b = model(ids), model(changed)
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


class _HostSyncs(TorchDispatchMode):
    """Records ops that read a tensor value on the host (what a captured graph cannot do)."""

    SYNCING = ("_local_scalar_dense", "nonzero", "item", "masked_select", "unique")

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(name in str(func) for name in self.SYNCING):
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
        {"recompute_granularity": "selective", "num_experts": 4},
    ],
)
def test_forward_backward_reads_nothing_on_the_host(extra: dict[str, Any]) -> None:
    model = GPT(preset_model_config("llama-tiny", num_layers=2, seq_length=32, **extra))
    ids = torch.randint(0, 8192, (2, 32))
    with _HostSyncs() as mode:
        out = model(ids, ids)
        assert isinstance(out, dict)
        out["loss"].backward()
    assert mode.seen == []


@pytest.mark.parametrize(
    "switches",
    [
        {},
        {"swiglu": True, "num_query_groups": 2, "untie_embeddings_and_output_weights": True},
        {"position_embedding_type": "rope", "num_query_groups": 1, "add_bias_linear": False},
        {"num_experts": 4, "moe_router_topk": 2, "moe_capacity_factor": 1.0, "swiglu": True},
    ],
)
def test_flops_formula_matches_flop_counter(switches: dict[str, Any]) -> None:
    """Forward + backward FLOPs counted by torch equal the formula (math SDPA: full square).

    MoE with capacity factor 1.0 and divisible shapes computes exactly top-k rows per token.
    """
    cfg = _cfg(**switches)
    model = GPT(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length))
    counter = FlopCounterMode(display=False)
    with sdpa_kernel(SDPBackend.MATH), counter:
        out = model(ids, ids)
        assert isinstance(out, dict)
        out["loss"].backward()
    counted = counter.get_total_flops()
    # The router's fp32 matmul is counted in forward and backward like every other matmul.
    assert num_floating_point_operations(cfg, 2) == pytest.approx(counted, rel=0.02)


def test_flops_llama_hand_computation() -> None:
    cfg = preset_model_config("llama-150m")
    h, s, f, v, L = 768, 1024, 2048, 50304, 12
    kv = 4 * 64
    per_token = L * (2 * h * (h + 2 * kv) + 4 * s * h + 2 * h * h + 2 * h * f * 3) + 2 * h * v
    assert num_floating_point_operations(cfg, 8) == 3 * 8 * s * per_token


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"position_embedding_type": "alibi"}, "--position-embedding-type must be one of"),
        ({"normalization": "rmsnorm"}, "--normalization must be one of LayerNorm, RMSNorm"),
        ({"swiglu": "yes"}, "--swiglu is a switch"),
        ({"untie_embeddings_and_output_weights": 1}, "--untie-embeddings-and-output-weights"),
        ({"add_bias_linear": None}, "--disable-bias-linear"),
        ({"num_query_groups": 3}, r"--num-query-groups \(3\) must divide"),
        ({"num_query_groups": 0}, "--num-query-groups must be an integer >= 1"),
        ({"rotary_base": 0}, "--rotary-base"),
        ({"rotary_base": 1.5}, "--rotary-base"),
        ({"layernorm_epsilon": "tiny"}, "--norm-epsilon"),
        ({"layernorm_epsilon": float("nan")}, "--norm-epsilon"),
        (
            {"position_embedding_type": "rope", "hidden_size": 36, "num_attention_heads": 4},
            "rope needs an even head dimension",
        ),
    ],
)
def test_bad_switches_name_the_flag(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _cfg(**overrides)


def test_config_round_trips_through_json_values() -> None:
    """A checkpoint stores the config with enum values as strings; it builds the same config."""
    from stalwart.config.run import _jsonable

    cfg = preset_model_config("llama-tiny", recompute_granularity="selective")
    values = _jsonable(cfg.__dict__)
    assert values["normalization"] == "RMSNorm" and values["recompute_granularity"] == "selective"
    assert GPTConfig(**values) == cfg


@pytest.mark.parametrize(
    "module", [stalwart.models.config, stalwart.models.gpt, stalwart.models.recompute]
)
def test_docstring_examples_run(module: Any) -> None:
    result = doctest.testmod(module, extraglobs={"torch": torch})
    assert result.attempted > 0 and result.failed == 0
