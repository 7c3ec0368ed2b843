"""``--gradient-accumulation-fusion`` (issue 19): the compute copies' weight gradients added
straight into the fp32 ``.grad`` by the backward (``stalwart.models.fused_grad``).

On CPU the fused weight gradient is computed in bf16 and added, which is the unfused path's
arithmetic: every Linear weight's gradient is bitwise the unfused one over several
micro-batches of a pass, tied or untied; the word embeddings (their lookup now adds rows instead of a
dense gradient) agree to float rounding; the losses are bitwise equal. Evaluation (no grad)
leaves the hooks unset; a model without hooks is refused; the flag needs the copies.
"""

from __future__ import annotations

import doctest

import pytest
import torch
from torch import nn

from stalwart.cli.main import main
from stalwart.loop import ComputeWeights
from stalwart.models import GPT, GPTConfig, fused_grad

MICRO = 3


def _run(fuse: bool, untie: bool) -> tuple[list[float], dict[str, torch.Tensor], ComputeWeights]:
    torch.manual_seed(0)
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                    vocab_size=64, untie_embeddings_and_output_weights=untie)  # fmt: skip
    model = GPT(cfg)
    weights = ComputeWeights(model, compiled=False, fuse_grad_accumulation=fuse)
    gen = torch.Generator().manual_seed(1)
    losses = []
    weights.refresh()
    for index in range(MICRO):
        ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1), generator=gen)
        with torch.autocast("cpu", dtype=torch.bfloat16), weights.using():
            out = model(ids[:, :-1], ids[:, 1:])
            (out["loss"] / MICRO).backward()
        weights.accumulate(overwrite=index == 0)
        losses.append(out["loss"].item())
    return losses, {n: p.grad.clone() for n, p in model.named_parameters()}, weights


@pytest.mark.parametrize("untie", [False, True], ids=["tied", "untied"])
def test_fused_weight_gradients_are_the_unfused_ones(untie: bool) -> None:
    losses, grads, _ = _run(False, untie)
    fused_losses, fused_grads, weights = _run(True, untie)
    assert fused_losses == losses
    # 2 layers x (qkv, proj, fc1, fc2) and the output layer (tied: the copy of the embeddings).
    assert sum(weights.fused) == 9 and len(weights.fused_uses) == 1
    for name, grad in grads.items():
        if name == "word_embeddings.weight":  # the lookup's rows, added in another order
            torch.testing.assert_close(fused_grads[name], grad, rtol=1e-5, atol=1e-7)
        else:
            assert torch.equal(fused_grads[name], grad), name


def test_no_grad_forward_sets_no_hook() -> None:
    model = GPT(GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=8,
                          vocab_size=32))  # fmt: skip
    weights = ComputeWeights(model, compiled=False, fuse_grad_accumulation=True)
    weights.refresh()
    ids = torch.zeros(1, 8, dtype=torch.long)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), weights.using():
        assert model.layers[0].attn.qkv.weight_main_grad is None  # type: ignore[union-attr]
        model(ids)
    assert all(p.grad is None for p in model.parameters())  # evaluation allocates nothing
    with torch.autocast("cpu", dtype=torch.bfloat16), weights.using():
        assert model.embedding_main_grad is model.word_embeddings.weight.grad is not None
    assert model.embedding_main_grad is None  # reset after the micro-batch


def test_a_model_without_hooks_is_refused() -> None:
    with pytest.raises(ValueError, match=r"fused_grad\.Linear"):
        ComputeWeights(nn.Sequential(nn.Linear(4, 4)), fuse_grad_accumulation=True)


def test_the_flag_needs_compute_weights(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        ["train", "--preset", "tiny", "--use-cpu", "--bf16", "--gradient-accumulation-fusion"]
    )
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--gradient-accumulation-fusion needs --bf16-compute-weights" in err[0]


def test_docstring_example() -> None:
    assert doctest.testmod(fused_grad, raise_on_error=True).attempted >= 5
