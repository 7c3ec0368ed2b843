from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from stalwart.models import GPT, GPTConfig
from stalwart.observability.dumps import (
    DumpConfig,
    NullTensorDumper,
    TensorDumper,
    layer_number,
    make_tensor_dumper,
)

CFG = GPTConfig(
    num_layers=2,
    hidden_size=16,
    num_attention_heads=2,
    seq_length=8,
    vocab_size=32,
    num_experts=4,
    moe_router_topk=2,
)
ALL = DumpConfig(
    save_activations_interval=2,
    save_dgrads_interval=2,
    save_tokens_per_expert_interval=2,
    tensor_stats_interval=1,
)


def _iteration(model: GPT, dumper: TensorDumper | NullTensorDumper, it: int) -> torch.Tensor:
    """Two micro-batches: 3 sequences, then 2 (shapes tell which one a dump came from)."""
    dumper.begin_iteration(it)
    last = torch.empty(0)
    for i, b in enumerate((3, 2)):
        dumper.set_last_microbatch(i == 1)
        ids = torch.randint(0, CFG.vocab_size, (b, CFG.seq_length))
        out = model(ids, ids)
        assert isinstance(out, dict)
        out["loss"].backward()
        last = ids
    dumper.end_iteration()
    return last


def _hook_count(model: nn.Module) -> int:
    return sum(
        len(m._forward_hooks) + len(m._backward_hooks) + len(m._forward_pre_hooks)
        for m in model.modules()
    )


def test_dumps_written_last_microbatch_only(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = GPT(CFG)
    dumper = TensorDumper(model, tmp_path, ALL, rank=3, dp_rank=0)
    _iteration(model, dumper, 1)
    assert not (tmp_path / "activations").exists()  # iteration 1 is not an activation iteration
    last_ids = _iteration(model, dumper, 2)
    acts = torch.load(tmp_path / "activations" / "iter_0000002" / "rank3.pt")
    assert torch.equal(acts["word_embeddings/input0"], last_ids)
    assert acts["word_embeddings/output0"].shape == (2, 8, 16)
    assert acts["layers.0.attn.qkv/output0"].shape == (2, 8, 48)
    assert "layers.1.mlp.router/output0" in acts  # MoE routers are hooked too
    dgrads = torch.load(tmp_path / "dgrads" / "iter_0000002" / "rank3.pt")
    assert dgrads["layers.1.attn.proj/grad_output0"].shape == (2, 8, 16)  # last micro-batch (b=2)
    assert dgrads["word_embeddings/grad_output0"].shape == (2, 8, 16)
    tpe = [json.loads(x) for x in (tmp_path / "tokens_per_expert" / "rank3.jsonl").open()]
    assert [(r["iteration"], r["layer"]) for r in tpe] == [(2, 0), (2, 1)]
    assert all(sum(r["tokens_per_expert"]) == 2 * 2 * 8 for r in tpe)  # topk * tokens
    stats = [json.loads(x) for x in (tmp_path / "tensor_stats" / "rank3.jsonl").open()]
    assert [s["iteration"] for s in stats] == [1, 2]
    qkv = stats[1]["modules"]["layers.0.attn.qkv"]
    ref = acts["layers.0.attn.qkv/output0"]
    assert qkv["mean"] == pytest.approx(ref.mean().item(), abs=1e-5)
    assert qkv["std"] == pytest.approx(ref.std(unbiased=False).item(), rel=1e-3)
    assert qkv["absmax"] == pytest.approx(ref.abs().max().item())
    assert qkv["nonfinite"] == 0
    assert _hook_count(model) == 0  # hooks live only inside a dump iteration
    dumper.close()


def test_dgrads_only_on_data_parallel_replica_zero(tmp_path: Path) -> None:
    model = GPT(CFG)
    dumper = TensorDumper(model, tmp_path, ALL, rank=1, dp_rank=1)
    _iteration(model, dumper, 2)
    assert (tmp_path / "activations" / "iter_0000002" / "rank1.pt").exists()
    assert not (tmp_path / "dgrads").exists()


def test_close_removes_hooks_mid_iteration(tmp_path: Path) -> None:
    model = GPT(CFG)
    dumper = TensorDumper(model, tmp_path, ALL)
    dumper.begin_iteration(2)
    assert dumper.num_hooks > 0 and _hook_count(model) > 0
    dumper.close()
    assert dumper.num_hooks == 0 and _hook_count(model) == 0
    assert not model._forward_hooks
    dumper.close()  # idempotent


def test_off_is_null_and_bad_interval(tmp_path: Path) -> None:
    model = GPT(CFG)
    dumper = make_tensor_dumper(model, tmp_path, DumpConfig())
    assert isinstance(dumper, NullTensorDumper)
    _iteration(model, dumper, 2)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match=r"DumpConfig\.save_dgrads_interval"):
        DumpConfig(save_dgrads_interval=0)
    assert layer_number("layers.12.mlp.router") == 12 and layer_number("router") is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_stats_and_dumps_on_cuda_bf16(tmp_path: Path) -> None:
    model = GPT(CFG).cuda()
    dumper = TensorDumper(model, tmp_path, ALL)
    for it in (1, 2):
        dumper.begin_iteration(it)
        ids = torch.randint(0, CFG.vocab_size, (2, CFG.seq_length), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(ids, ids)
        assert isinstance(out, dict)
        out["loss"].backward()
        dumper.end_iteration()
    dumper.close()
    stats = [json.loads(x) for x in (tmp_path / "tensor_stats" / "rank0.jsonl").open()]
    qkv = stats[-1]["modules"]["layers.0.attn.qkv"]
    assert qkv["absmax"] > 0 and qkv["nonfinite"] == 0
    acts = torch.load(tmp_path / "activations" / "iter_0000002" / "rank0.pt")
    assert acts["layers.0.attn.qkv/output0"].dtype == torch.bfloat16
    assert acts["layers.0.attn.qkv/output0"].device.type == "cpu"
    assert (tmp_path / "dgrads" / "iter_0000002" / "rank0.pt").exists()


def test_from_trainer_flags() -> None:
    cfg = DumpConfig.from_flags(
        save_activations_interval=0,
        log_dgrads=True,
        log_tokens_per_expert=True,
        dump_stats_only=False,
        log_interval=10,
    )
    assert cfg.save_activations_interval is None
    assert (cfg.save_dgrads_interval, cfg.save_tokens_per_expert_interval) == (10, 10)
    stats = DumpConfig.from_flags(
        save_activations_interval=5,
        log_dgrads=True,
        log_tokens_per_expert=False,
        dump_stats_only=True,
        log_interval=10,
    )
    assert stats.tensor_stats_interval == 5
    assert stats.save_activations_interval is None and stats.save_dgrads_interval is None
