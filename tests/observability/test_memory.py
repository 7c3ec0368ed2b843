from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from stalwart.models import GPT, GPTConfig
from stalwart.models.memory_model import (
    activation_breakdown,
    bytes_per_parameter,
    count_parameters,
    theoretical_memory,
)
from stalwart.observability.memory import (
    MEMORY_FILE,
    MemoryMonitor,
    NullMemoryMonitor,
    measured_memory,
)
from stalwart.observability.train_log import IntervalInfo

# L=2, h=8, heads=2, s=4, V=16, f=4h=32; micro-batch b=2 -> t = 8 tokens.
DENSE = GPTConfig(num_layers=2, hidden_size=8, num_attention_heads=2, seq_length=4, vocab_size=16)
MOE = GPTConfig(
    num_layers=2,
    hidden_size=8,
    num_attention_heads=2,
    seq_length=4,
    vocab_size=16,
    num_experts=4,
    moe_router_topk=2,
    moe_capacity_factor=1.0,
)


def test_parameter_count_matches_reference_model() -> None:
    # V*h + s*h + L*(qkv 8*24+24 + proj 64+8 + fc1 8*32+32 + fc2 32*8+8 + 2 LN 32) + final LN 16
    assert count_parameters(DENSE) == 128 + 32 + 2 * (216 + 72 + 288 + 264 + 32) + 16 == 1920
    assert count_parameters(DENSE) == GPT(DENSE).num_parameters()
    assert count_parameters(MOE) == GPT(MOE).num_parameters()


def test_bytes_per_parameter() -> None:
    assert bytes_per_parameter(1, False, bf16=True) == 18  # 4 param + 4 grad + 8 Adam + 2 copy
    assert bytes_per_parameter(4, True, bf16=True) == 12  # 10 + 8/4
    assert bytes_per_parameter(1, False, bf16=False) == 16


def test_dense_bf16_hand_computed() -> None:
    acts = activation_breakdown(DENSE, micro_batch_size=2, bf16=True)
    # attention/layer: t*(8h + 16 + 5*e*h) + 4*b*heads*s = 8*(64+16+80) + 64 = 1344
    assert acts["layers.attention"] == 2 * 1344
    # dense MLP/layer: t*(e*h + 2*e*f) = 8*(16 + 128) = 1152
    assert acts["layers.mlp"] == 2 * 1152
    assert acts["embedding"] == 16 * 8  # ids + labels
    # head: t*(4h+8) + e*t*h + 4*t*V = 320 + 128 + 512
    assert acts["head"] == 960
    assert acts["loss_backward_transient"] == 8 * 8 * 16
    est = theoretical_memory(DENSE, micro_batch_size=2, dp_size=1, workspace_bytes=0)
    assert est.activation_bytes == 7104
    assert est.weights_optimizer_bytes == 18 * 1920
    # The optimizer-step temporary (4 B/param = 7680) exceeds this toy's activations.
    assert est.total_bytes == 34560 + 7680
    # Default: + 64 MiB of cuBLAS/cuBLASLt workspaces.
    assert theoretical_memory(DENSE, 2, 1).total_bytes == 34560 + 7680 + 64 * 2**20


def test_dense_sharded_and_fp32_hand_computed() -> None:
    est = theoretical_memory(
        DENSE, micro_batch_size=2, dp_size=4, sharded_optimizer=True, workspace_bytes=0
    )
    assert est.weights_optimizer_bytes == 12 * 1920
    assert est.total_bytes == 23040 + 7104
    fp32 = theoretical_memory(DENSE, micro_batch_size=2, dp_size=1, bf16=False, workspace_bytes=0)
    # e=4: attention 2*(8*(64+16+160)+64) + MLP 2*8*(32+256) + emb 128 + head 1088 + 1024
    assert fp32.activation_bytes == 3968 + 4608 + 128 + 1088 + 1024
    assert fp32.total_bytes == 16 * 1920 + 10816


def test_moe_hand_computed() -> None:
    acts = activation_breakdown(MOE, micro_batch_size=2, bf16=True)
    # capacity = ceil(1.0*2*8/4) = 4 -> N = 16 slots;
    # t*(4h + 4E + 24k) + e*k*t*h + N*(e*h + 2*e*f) = 768 + 256 + 16*144
    assert acts["layers.mlp"] == 2 * (768 + 256 + 2304)
    est = theoretical_memory(MOE, micro_batch_size=2, dp_size=1)
    assert est.num_parameters == count_parameters(MOE)


def test_bad_args() -> None:
    with pytest.raises(ValueError, match="--micro-batch-size"):
        theoretical_memory(DENSE, 0, 1)
    with pytest.raises(ValueError, match="--log-memory-interval"):
        MemoryMonitor(torch.device("cpu"), None, log_interval=10, log_memory_interval=15)


def test_measured_cpu_is_rss() -> None:
    m = measured_memory(torch.device("cpu"))
    assert m["mem-rss-bytes"] > 0 and m["mem-max-rss-bytes"] >= m["mem-rss-bytes"] * 0.5


def _info(it: int) -> IntervalInfo:
    return IntervalInfo(
        iteration=it,
        num_iterations=1,
        elapsed_ms_per_iteration=1.0,
        consumed_samples=0,
        is_first=it == 1,
    )


class _Sink:
    def __init__(self) -> None:
        self.calls: list[tuple[dict[str, float], int]] = []

    def add_scalars(self, values: dict[str, float], step: int) -> None:
        self.calls.append((dict(values), step))


def test_monitor_reports_once_then_interval(tmp_path: Path) -> None:
    lines: list[str] = []
    sink = _Sink()
    est = theoretical_memory(DENSE, 2, 1)
    mon = MemoryMonitor(
        torch.device("cpu"),
        est,
        run_dir=tmp_path,
        log_interval=1,
        log_memory_interval=3,
        to_tensorboard=True,
        sink=sink,
        log=lines.append,  # type: ignore[arg-type]
    )
    assert mon.log_fields(_info(1))  # first: report + file
    record = json.loads((tmp_path / MEMORY_FILE).read_text())
    assert record["measured_source"] == "cpu-rss"
    assert record["theoretical"]["total_bytes"] == est.total_bytes
    assert lines[0].startswith("Theoretical memory footprints: weight and optimizer=")
    assert "[Rank 0] (after 1 iterations) memory (MB)" in lines[1]
    assert mon.log_fields(_info(2)) == []  # not due
    assert mon.log_fields(_info(3))  # due
    assert [step for _, step in sink.calls] == [1, 3]
    assert len(lines) == 2  # the report lines are printed once
    assert NullMemoryMonitor().log_fields(_info(1)) == []


def test_full_recompute_keeps_one_input_per_unit_and_drops_weight_copies() -> None:
    full = GPTConfig(**{**DENSE.__dict__, "recompute_granularity": "full",
                        "recompute_method": "uniform", "recompute_num_layers": 1})  # fmt: skip
    acts = activation_breakdown(full, micro_batch_size=2, bf16=True)
    assert acts["layers.attention"] == acts["layers.mlp"] == 0  # nothing kept per layer
    assert acts["layers.recompute_inputs"] == 2 * 4 * 8 * 8  # 2 units x fp32 [t=8, h=8]
    plain = theoretical_memory(DENSE, 2, 1, workspace_bytes=0)
    est = theoretical_memory(full, 2, 1, workspace_bytes=0)
    layer_params = (1920 - 128 - 32 - 16) // 2
    assert est.weights_optimizer_bytes == plain.weights_optimizer_bytes - 2 * 2 * layer_params
    fp32 = theoretical_memory(full, 2, 1, bf16=False, workspace_bytes=0)
    assert fp32.weights_optimizer_bytes == 16 * 1920  # no autocast copies to drop


def test_llama_counts_and_selective_recompute() -> None:
    from stalwart.models import preset_model_config

    cfg = preset_model_config("llama-150m")
    assert count_parameters(cfg) == 152_783_616
    with torch.device("meta"):
        assert GPT(cfg).num_parameters() == count_parameters(cfg)
    selective = preset_model_config("llama-150m", recompute_granularity="selective")
    plain = activation_breakdown(cfg, 8, bf16=True)["layers.attention"]
    saved = activation_breakdown(selective, 8, bf16=True)["layers.attention"]
    t, h, kv, heads = 8 * 1024, 768, 4 * 64, 12
    # RoPE outputs (bf16 q and k) and the fp32 logsumexp are recomputed, per layer.
    assert plain - saved == 12 * (2 * t * (h + kv) + 4 * 8 * heads * 1024)


def _with(cfg: GPTConfig, **overrides: object) -> GPTConfig:
    return GPTConfig(**{**cfg.__dict__, **overrides})


FULL = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


def test_compute_weight_parameters_are_the_models_slots() -> None:
    from stalwart.loop import ComputeWeights
    from stalwart.models.memory_model import compute_weight_parameters

    for cfg in (DENSE, MOE, _with(DENSE, untie_embeddings_and_output_weights=True)):
        weights = ComputeWeights(GPT(cfg))
        bf16 = [m for m, d in zip(weights.masters, weights.copy_dtypes) if d == torch.bfloat16]
        # (the norms' and positions' fp32 copies, fp32_grad_slots, are not counted: 4 bytes
        # per norm/position parameter, 3.3 MB at gpt2-124m)
        assert compute_weight_parameters(cfg) == sum(p.numel() for p in bf16)
    assert compute_weight_parameters(DENSE) == 1920 - 32 - 5 * 16  # no positions, no norms


def test_compute_weights_replace_the_autocast_copies_and_outlive_recompute() -> None:
    """Persistent bf16 copies of the 1808 slot parameters instead of autocast's 2 bytes for all
    1920; full recompute no longer drops the recomputed layers' copies; the copies' bf16
    gradients are a moment of their own (2 bytes per slot parameter)."""
    slots = 1920 - 32 - 5 * 16
    plain = theoretical_memory(DENSE, 2, 1, workspace_bytes=0)
    copies = theoretical_memory(DENSE, 2, 1, workspace_bytes=0, compute_weights=True)
    assert copies.weights_optimizer_bytes == plain.weights_optimizer_bytes - 2 * (1920 - slots)
    assert copies.breakdown["compute_weight_copies"] == 2 * slots
    assert "autocast_weight_copies" not in copies.breakdown
    assert copies.breakdown["activation_compute_weight_grads_moment"] == 2 * slots
    assert copies.activation_bytes == max(plain.activation_bytes, 2 * slots)
    full = _with(DENSE, **FULL)
    plain_full = theoretical_memory(full, 2, 1, workspace_bytes=0)
    copies_full = theoretical_memory(full, 2, 1, workspace_bytes=0, compute_weights=True)
    layer_params = (1920 - 128 - 32 - 16) // 2
    assert copies_full.weights_optimizer_bytes == copies.weights_optimizer_bytes
    assert copies_full.weights_optimizer_bytes - plain_full.weights_optimizer_bytes == (
        2 * slots - (2 * 1920 - 2 * 2 * layer_params)
    )
    with pytest.raises(ValueError, match="needs --bf16"):
        theoretical_memory(DENSE, 2, 1, bf16=False, compute_weights=True)


def test_bf16_residual_halves_the_stream_a_recomputed_unit_keeps() -> None:
    t, h = 8, 8
    full, full_bf16 = _with(DENSE, **FULL), _with(DENSE, bf16_residual_connection=True, **FULL)
    a = activation_breakdown(full, 2, bf16=True)
    b = activation_breakdown(full_bf16, 2, bf16=True)
    assert a["layers.recompute_inputs"] - b["layers.recompute_inputs"] == 2 * (4 - 2) * t * h
    assert b["head"] == a["head"]  # CUDA: the final norm saves the fp32 upcast of its input
    # Without autocast the stream is fp32 whatever the flag.
    assert activation_breakdown(full_bf16, 2, bf16=False) == activation_breakdown(full, 2, False)


def test_bf16_residual_on_cpu_changes_the_estimate_as_autocast_saves() -> None:
    """On CPU autocast runs the norms in bf16: each of the 2L+1 norms saves a bf16 input. The
    estimate moves by what the model really saves for backward (measured with saved-tensor
    hooks), 2 bytes per element of each norm's [t, h] input."""
    cfg = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=2, seq_length=32,
                    vocab_size=128)  # fmt: skip
    bf16 = _with(cfg, bf16_residual_connection=True)

    def saved(model_cfg: GPTConfig) -> int:
        torch.manual_seed(0)
        model, seen, total = GPT(model_cfg), set(), [0]
        ids = torch.randint(0, 128, (4, 32))

        def pack(x: torch.Tensor) -> torch.Tensor:
            key = (x.untyped_storage().data_ptr(), x.dtype)
            if key not in seen:
                seen.add(key)
                total[0] += x.untyped_storage().nbytes()
            return x

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x)
        with hooks, torch.autocast("cpu", dtype=torch.bfloat16):
            model(ids, ids)
        return total[0]

    def estimate(model_cfg: GPTConfig) -> float:
        est = theoretical_memory(model_cfg, 4, 1, workspace_bytes=0, fused_rms_norm=False)
        return est.activation_bytes

    expected = 5 * 2 * (4 * 32) * 64  # 5 norms x (4 - 2) bytes x [t = 128, h = 64]
    assert saved(cfg) - saved(bf16) == expected
    assert estimate(cfg) - estimate(bf16) == expected
