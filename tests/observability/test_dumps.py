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
        dumper.begin_microbatch(i, i == 1)
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
    # A loop without per-micro-batch calls: the router's last counts, as one micro-batch.
    assert [(r["iter"], r["layer"], len(r["tpe"])) for r in tpe] == [(2, 0, 1), (2, 1, 1)]
    assert all(sum(r["tpe"][0]) == 2 * 2 * 8 for r in tpe)  # topk * tokens
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
    # Megatron's flag names (--save-dgrads-interval exists now), not the field names.
    with pytest.raises(ValueError, match=r"--save-dgrads-interval must be"):
        DumpConfig(save_dgrads_interval=0)
    with pytest.raises(ValueError, match=r"--save-tokens-per-expert-interval must be"):
        DumpConfig(save_tokens_per_expert_interval=-2)
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


WEIGHTS = DumpConfig(
    save_wgrads_interval=2, save_params_interval=3, save_tokens_per_expert_interval=2
)


def _full_iteration(
    model: GPT, dumper: TensorDumper | NullTensorDumper, opt: torch.optim.Optimizer, it: int
) -> dict[str, torch.Tensor]:
    """Micro-batches of 3 and 2 sequences with the per-micro-batch calls, clip, optimizer step.

    Returns the gradients as they were after the backward passes (before clipping)."""
    dumper.begin_iteration(it)
    opt.zero_grad(set_to_none=True)
    for i, b in enumerate((3, 2)):
        dumper.begin_microbatch(i, i == 1)
        ids = torch.randint(0, CFG.vocab_size, (b, CFG.seq_length))
        out = model(ids, ids)
        assert isinstance(out, dict)
        (out["loss"] / 2).backward()
        dumper.end_microbatch()
    before_clip = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)  # in place: must not leak into dumps
    opt.step()
    dumper.end_iteration()
    return before_clip


def test_wgrads_params_and_tokens_per_expert_at_their_intervals(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dumper = make_tensor_dumper(model, tmp_path, WEIGHTS, rank=2, dp_rank=0)
    grads = {it: _full_iteration(model, dumper, opt, it) for it in range(1, 7)}
    dumper.close()
    wdirs = sorted(p.name for p in (tmp_path / "wgrads").iterdir())
    assert wdirs == ["iter_0000002", "iter_0000004", "iter_0000006"]
    assert sorted(p.name for p in (tmp_path / "params").iterdir()) == [
        "iter_0000003",
        "iter_0000006",
    ]
    wgrads = torch.load(tmp_path / "wgrads" / "iter_0000004" / "rank2.pt", weights_only=True)
    assert set(wgrads) == {n for n, p in model.named_parameters() if p.requires_grad}
    for name, grad in wgrads.items():
        assert torch.equal(grad, grads[4][name]), name  # accumulated, before clipping
    params = torch.load(tmp_path / "params" / "iter_0000006" / "rank2.pt", weights_only=True)
    for name, p in model.named_parameters():
        assert torch.equal(params[name], p.detach()), name  # after the last optimizer step
    records = [json.loads(x) for x in (tmp_path / "tokens_per_expert" / "rank2.jsonl").open()]
    assert [(r["iter"], r["layer"]) for r in records] == [
        (it, layer) for it in (2, 4, 6) for layer in (0, 1)
    ]
    for r in records:
        assert set(r) == {"iter", "block", "layer", "tpe"} and r["block"] == "decoder"
        assert len(r["tpe"]) == 2 and all(len(mb) == CFG.num_experts for mb in r["tpe"])
        # topk * tokens of each micro-batch: 3 then 2 sequences of 8 tokens.
        assert [sum(mb) for mb in r["tpe"]] == [2 * 3 * 8, 2 * 2 * 8]


def test_rerun_pass_replaces_the_first_pass_records(tmp_path: Path) -> None:
    model = GPT(CFG)
    dumper = TensorDumper(model, tmp_path, WEIGHTS)
    dumper.begin_iteration(2)
    for _ in range(2):  # the rerun state machine replays the iteration's micro-batches
        for i in range(2):
            dumper.begin_microbatch(i, i == 1)
            ids = torch.randint(0, CFG.vocab_size, (2, CFG.seq_length))
            out = model(ids, ids)
            assert isinstance(out, dict)
            out["loss"].backward()
            dumper.end_microbatch()
    dumper.end_iteration()
    (r0, r1) = [json.loads(x) for x in (tmp_path / "tokens_per_expert" / "rank0.jsonl").open()]
    assert len(r0["tpe"]) == len(r1["tpe"]) == 2


def test_weights_only_on_replica_zero_and_flag_validation(tmp_path: Path) -> None:
    model = GPT(CFG)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dumper = TensorDumper(model, tmp_path, WEIGHTS, rank=1, dp_rank=1)
    for it in (1, 2, 3):
        _full_iteration(model, dumper, opt, it)
    assert not (tmp_path / "wgrads").exists() and not (tmp_path / "params").exists()
    assert (tmp_path / "tokens_per_expert" / "rank1.jsonl").exists()  # per rank, as Megatron
    cfg = DumpConfig.from_flags(
        save_activations_interval=0,
        log_dgrads=False,
        log_tokens_per_expert=False,
        dump_stats_only=False,
        log_interval=10,
        save_wgrads_interval=7,
        save_params_interval=0,
    )
    assert (cfg.save_wgrads_interval, cfg.save_params_interval) == (7, None) and cfg.any_enabled
    for flag, kwargs in (
        ("--save-wgrads-interval", {"save_wgrads_interval": -1}),
        ("--save-params-interval", {"save_params_interval": True}),
    ):
        with pytest.raises(ValueError, match=flag):
            DumpConfig.from_flags(
                save_activations_interval=0,
                log_dgrads=False,
                log_tokens_per_expert=False,
                dump_stats_only=False,
                log_interval=10,
                **kwargs,
            )
    with pytest.raises(ValueError, match="--save-params-interval"):
        DumpConfig(save_params_interval=0)
