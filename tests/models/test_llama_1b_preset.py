"""The ``llama-1b`` preset is Llama 3.2 1B's shape, and the FLOP and memory formulas hold for it.

Llama 3.2 1B's ``config.json`` (meta-llama/Llama-3.2-1B): 16 layers, hidden 2048, 32 heads, 8
key/value heads of 64, SwiGLU 8192, vocabulary 128,256, RMSNorm 1e-5, RoPE base 500,000 with
``rope_scaling`` ``llama3`` (factor 32, low/high frequency factors 1 and 4, original context
8192), tied embeddings, no biases; 1,235,814,400 parameters.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from stalwart.models import GPT, GPTConfig, num_floating_point_operations, preset_model_config
from stalwart.models.functional import llama3_scaled_frequencies, rotary_tables
from stalwart.models.hf_export import hf_llama_config, hf_llama_state
from stalwart.models.memory_model import (
    compute_weight_parameters,
    count_parameters,
    theoretical_memory,
)

# meta-llama/Llama-3.2-1B config.json, the fields that define the function.
LLAMA_3_2_1B = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 128256,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": True,
    "attention_bias": False,
    "mlp_bias": False,
}
PARAMETERS = 1_235_814_400


def test_preset_is_llama_3_2_1b() -> None:
    cfg = preset_model_config("llama-1b")
    exported = hf_llama_config(cfg)
    assert {k: exported[k] for k in LLAMA_3_2_1B} == LLAMA_3_2_1B
    assert cfg.seq_length == 2048 and not cfg.untie_embeddings_and_output_weights
    with torch.device("meta"):
        model = GPT(cfg)
    assert model.num_parameters() == count_parameters(cfg) == PARAMETERS
    assert model.output_layer is None  # the output layer is the word embeddings


def test_flops_formula_is_6n_plus_attention_and_matches_the_counter() -> None:
    """Per token: 6 x the matmul parameters (every parameter but the norms; the tied embedding
    once, as the output layer) + 12 * L * s * h (attention scores and values, full square);
    torch's FLOP counter on the meta device (math SDPA) counts exactly that."""
    cfg = preset_model_config("llama-1b")
    L, h, s = 16, 2048, 2048
    matmul_params = PARAMETERS - (2 * L + 1) * h
    per_token = 6 * matmul_params + 12 * L * s * h
    assert num_floating_point_operations(cfg, 1) == per_token * s
    with torch.device("meta"):
        model = GPT(cfg)
        ids = torch.zeros(1, s, dtype=torch.long)
    counter = FlopCounterMode(display=False)
    with sdpa_kernel(SDPBackend.MATH), counter:
        out = model(ids, ids)
        assert isinstance(out, dict)
        out["loss"].backward()
    assert counter.get_total_flops() == num_floating_point_operations(cfg, 1)


def test_memory_formula_terms_at_llama_1b() -> None:
    """The documented activation terms by hand at micro-batch 4 (t = 8192 tokens, bf16, fused
    RMSNorm, RoPE, GQA kv = 512, SwiGLU, tied output with the fused loss) and the weights with
    bf16 compute copies of every matmul parameter."""
    cfg = preset_model_config("llama-1b", cross_entropy_loss_fusion=True)
    est = theoretical_memory(cfg, 4, 1, compute_weights=True, grad_accumulation_fusion=True)
    t, h, kv, f, v, heads, s, e = 8192, 2048, 512, 8192, 128256, 32, 2048, 2
    norm = 4 * h + 4
    attention = t * (2 * norm + e * h + e * (h + 2 * kv) + e * (h + kv) + e * h) + 4 * 4 * heads * s
    mlp = t * (e * h + e * 2 * f + e * f + e * f)
    head = t * norm + e * t * h + e * t * v
    b = est.breakdown
    assert b["activation.layers.attention"] == 16 * attention
    assert b["activation.layers.mlp"] == 16 * mlp
    assert b["activation.head"] == head
    assert compute_weight_parameters(cfg) == PARAMETERS - 33 * h
    assert b["compute_weight_copies"] == 2 * (PARAMETERS - 33 * h)
    assert b["params_fp32"] + b["grads_fp32"] + b["adam_states"] == 16 * PARAMETERS
    assert 34e9 < est.total_bytes < 40e9  # fits an 80 GB card at micro-batch 4


def test_rope_scaling_keeps_high_frequencies_and_slows_low_ones() -> None:
    inv = 1.0 / (500000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    scaled = llama3_scaled_frequencies(inv, 32.0)
    wavelength = 2 * math.pi / inv
    short, long = wavelength < 8192 / 4, wavelength > 8192
    assert short.any() and long.any() and (~short & ~long).any()
    assert torch.equal(scaled[short], inv[short])
    torch.testing.assert_close(scaled[long], inv[long] / 32, rtol=1e-15, atol=0)
    between = ~short & ~long
    assert bool(((scaled[between] < inv[between]) & (scaled[between] > inv[between] / 32)).all())
    cos, _ = rotary_tables(64, 16, 500000.0, 32.0)
    plain, _ = rotary_tables(64, 16, 500000.0)
    assert torch.equal(cos[:, 0], plain[:, 0]) and not torch.equal(cos, plain)


def test_scaled_rope_tied_gqa_model_is_transformers_llama() -> None:
    """A small model with every llama-1b switch computes transformers' ``LlamaForCausalLM``
    with the exported config and weights (its ``llama3`` RoPE scaling included)."""
    transformers = pytest.importorskip("transformers")
    small = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2)
    cfg = preset_model_config(
        "llama-1b",
        **small,
        ffn_hidden_size=96,
        vocab_size=256,
        seq_length=64,
        rope_scaling_factor=8.0,
        rotary_base=10000,
        init_std=0.2,
    )
    torch.manual_seed(0)
    ours = GPT(cfg).eval()
    hf_cfg = transformers.LlamaConfig(**hf_llama_config(cfg))
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    missing, unexpected = hf.load_state_dict(hf_llama_state(cfg, ours.state_dict()), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied: lm_head is the embedding
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ours(ids)
        got = hf(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    # (large weights: attention scores that the frequencies move, so the check can fail)
    unscaled = GPT(GPTConfig(**{**cfg.__dict__, "use_rope_scaling": False})).eval()
    unscaled.load_state_dict(ours.state_dict())
    with torch.no_grad():
        assert not torch.allclose(unscaled(ids), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"use_rope_scaling": "yes"}, "--use-rope-scaling is a switch"),
        ({"rope_scaling_factor": 0.0}, "--rope-scaling-factor must be a finite number > 0"),
        ({"rope_scaling_factor": float("inf")}, "--rope-scaling-factor"),
        ({"position_embedding_type": "learned_absolute"}, "--use-rope-scaling needs"),
    ],
)
def test_bad_rope_scaling_names_the_flag(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        preset_model_config("llama-1b", **overrides)
