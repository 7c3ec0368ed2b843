"""FLOPs of any model, counted once with torch's counter: agrees with the analytic GPT formula,
counts attention on the CPU, and leaves no trace on training."""

from __future__ import annotations

import doctest
import functools

import pytest
import torch
from torch import nn

from stalwart.models import GPT, num_floating_point_operations
from stalwart.observability import flop_count
from stalwart.observability.flop_count import count_training_flops

from train_utils import make_config

LLAMA = ["--preset", "llama-tiny", "--num-layers", "2", "--num-attention-heads", "4",
         "--num-query-groups", "2", "--ffn-hidden-size", "96"]  # fmt: skip


def _gpt_loss(batch: dict[str, torch.Tensor], model: nn.Module) -> torch.Tensor:
    return model(batch["input_ids"], batch["labels"])["loss"]


def test_docstring_example_runs() -> None:
    assert doctest.testmod(flop_count, raise_on_error=True).attempted >= 4


@pytest.mark.parametrize("flags", [[], LLAMA], ids=["gpt", "llama-gqa-swiglu"])
def test_counted_agrees_with_the_analytic_formula_within_5_percent(flags: list[str]) -> None:
    config = make_config(*flags).model
    torch.manual_seed(0)
    model = GPT(config)
    ids = torch.randint(0, config.vocab_size, (4, config.seq_length))
    counted = count_training_flops(model, _gpt_loss, {"input_ids": ids, "labels": ids})
    analytic = num_floating_point_operations(config, 4)
    assert abs(counted.per_microbatch / analytic - 1) < 0.05, (counted, analytic)
    # Backward is ~2x forward (the attention backward is 2.5x in torch's formula).
    assert 2.9 < counted.per_microbatch / counted.forward < 3.1


def test_cpu_attention_is_counted() -> None:
    """torch's registry lacks the CPU flash kernel; without the extra mapping this is 0."""
    b, heads, s, d = 2, 3, 16, 8
    q, k, v = (torch.randn(b, heads, s, d, requires_grad=True) for _ in range(3))
    forward = flop_count.count_flops(
        lambda: nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    )
    assert forward == 2 * (2 * b * heads * s * s * d)  # Q K^T and the weighted values


def test_counting_leaves_training_bitwise_unchanged() -> None:
    def train(count: bool) -> list[torch.Tensor]:
        torch.manual_seed(3)
        model = nn.Sequential(
            nn.Linear(8, 16), nn.Dropout(0.2), nn.BatchNorm1d(16), nn.Linear(16, 1)
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        batch = torch.randn(6, 8)
        if count:
            counted = count_training_flops(model, lambda x, m: m(x).square().mean(), batch)
            assert counted.per_microbatch > 0
        for _ in range(3):
            opt.zero_grad()
            model(batch).square().mean().backward()
            opt.step()
        return [p.detach().clone() for p in model.state_dict().values()]

    for plain, counted in zip(train(False), train(True), strict=True):
        assert torch.equal(plain, counted)


def test_per_iteration_scales_and_rejects_bad_sizes() -> None:
    counted = flop_count.CountedFlops(per_microbatch=10, forward=3)
    assert counted.per_iteration(num_microbatches=4, data_parallel_size=2) == 80.0
    with pytest.raises(ValueError, match="must be >= 1"):
        counted.per_iteration(num_microbatches=0)


def test_grouped_query_attention_counts_per_query_head() -> None:
    """The kernel that reads shared key/value heads (bf16) counts what the repeated heads
    (fp32) count: torch's own formula asserts equal heads and failed on the GPU's flash path."""
    from stalwart.models.functional import causal_attention

    q, k, v = torch.randn(2, 4, 16, 8), torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)

    def attention_pass(dtype: torch.dtype) -> None:
        qq, kk, vv = (t.to(dtype).requires_grad_() for t in (q, k, v))
        causal_attention(qq, kk, vv, 0.0).sum().backward()

    counts = [
        flop_count.count_flops(functools.partial(attention_pass, dtype))
        for dtype in (torch.float32, torch.bfloat16)
    ]
    # 2 (fwd) + 5 (bwd) [b*h*s*s*d] matmul-FLOP units: 7 * 2 * 2*4*16*16*8 = 229376
    assert counts == [229376, 229376]
