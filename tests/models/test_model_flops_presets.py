from __future__ import annotations

import pytest
import torch

from stalwart.models import (
    GPT,
    PRESET_MICRO_BATCH_SIZE,
    PRESETS,
    GPTConfig,
    num_floating_point_operations,
    preset_model_config,
)


def test_flops_dense_hand_computation() -> None:
    cfg = GPTConfig(num_layers=2, hidden_size=4, num_attention_heads=2, seq_length=8, vocab_size=10)
    # per token per layer: QKV 2*3*16=96, scores 2*8*4=64, values 64, proj 2*16=32,
    # MLP 2*2*4*16=256 -> 512; per token: 2*512 + logits 2*4*10=80 -> 1104;
    # 3 (fwd+bwd) * batch 3 * seq 8 * 1104 = 79488.
    assert num_floating_point_operations(cfg, batch_size=3) == 79488.0
    # Shorter sequence: attention terms use s=4 -> per layer 96+32+32+32+256=448.
    assert num_floating_point_operations(cfg, 3, seq_length=4) == 3 * 3 * 4 * (2 * 448 + 80)


def test_flops_moe_hand_computation() -> None:
    cfg = GPTConfig(
        num_layers=1,
        hidden_size=4,
        num_attention_heads=2,
        seq_length=8,
        vocab_size=10,
        num_experts=4,
        moe_router_topk=2,
    )
    # per layer: 96 + 64 + 64 + 32 + topk 2 * 256 + router 2*4*4=32 = 800; + logits 80.
    assert num_floating_point_operations(cfg, 1) == 3 * 8 * (800 + 80)


def test_flops_rejects_bad_batch() -> None:
    cfg = preset_model_config("tiny")
    with pytest.raises(ValueError, match="batch-size"):
        num_floating_point_operations(cfg, 0)


def test_presets_and_overrides() -> None:
    assert set(PRESETS) == {"tiny", "small", "gpt2-124m", "llama-tiny", "llama-150m", "llama-1b"}
    assert all(PRESET_MICRO_BATCH_SIZE[n] == 8 for n in PRESETS if n != "llama-1b")
    assert PRESET_MICRO_BATCH_SIZE["llama-1b"] == 4
    tiny = preset_model_config("tiny", dropout=0.1)
    assert (tiny.num_layers, tiny.hidden_size, tiny.num_attention_heads) == (2, 256, 4)
    assert (tiny.seq_length, tiny.vocab_size, tiny.dropout) == (256, 8192, 0.1)
    with pytest.raises(TypeError):
        PRESETS["tiny"]["num_layers"] = 3  # type: ignore[index]
    assert preset_model_config("tiny").dropout == 0.0


def test_preset_errors() -> None:
    with pytest.raises(ValueError, match=r"--preset.*gpt2-124m"):
        preset_model_config("huge")
    with pytest.raises(ValueError, match="--preset"):
        preset_model_config("tiny", not_a_field=1)
    with pytest.raises(ValueError, match="--num-attention-heads"):
        preset_model_config("tiny", num_attention_heads=3)


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("tiny", 3_742_720),
        ("small", 35_954_688),
        ("gpt2-124m", 124_475_904),
        ("llama-tiny", 5_670_144),
        ("llama-150m", 152_783_616),
        ("llama-1b", 1_235_814_400),
    ],
)
def test_preset_parameter_counts(name: str, params: int) -> None:
    # gpt2-124m: 124,475,904 parameters incl. tied word (50304 x 768) + position embeddings.
    with torch.device("meta"):
        model = GPT(preset_model_config(name))
    assert model.num_parameters() == params
