"""``--cross-entropy-loss-fusion`` (issue 19): the output layer and its loss as one op whose
forward writes the logits' gradient in place (``stalwart.models.fused_cross_entropy``).

On CPU the op runs its plain-torch path (the CUDA kernel has the same contract and is checked
against it in ``tests/gpu/test_cross_entropy_fusion_gpu.py``): the loss and every gradient
match the unfused ``F.cross_entropy(F.linear(...))`` (fp32: to float rounding; bf16: to bf16
rounding), with ignored labels, tied and untied output layers, MoE, dropout, bf16 compute weights
and gradient accumulation fusion; evaluation (no grad) takes the unfused path bitwise; a bad
label gives a NaN loss; the FLOP counter sees the fused matmul; the trainer's flag trains the
same run to rounding and the memory estimate drops the fp32 log-softmax and the backward's
``[tokens, vocab]`` transient.
"""

from __future__ import annotations

import doctest
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from stalwart.cli.main import main
from stalwart.loop import ComputeWeights
from stalwart.models import GPT, GPTConfig, fused_cross_entropy, linear_cross_entropy
from stalwart.models.memory_model import activation_breakdown
from stalwart.observability.flop_count import count_flops

BASE: dict[str, Any] = dict(
    num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=64
)


def test_docstring_example() -> None:
    assert doctest.testmod(fused_cross_entropy, raise_on_error=True).attempted >= 10


def _both(x: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, scale: float = 0.25) -> Any:
    """(loss, grad x, grad w) fused and unfused, the loss's incoming gradient ``scale``."""
    out = []
    for fused in (True, False):
        xs, ws = x.detach().requires_grad_(), w.detach().requires_grad_()
        if fused:
            loss = linear_cross_entropy(xs, ws, labels)
        else:
            loss = F.cross_entropy(F.linear(xs, ws).float(), labels)
        (loss * scale).backward()
        out.append((loss.detach(), xs.grad, ws.grad))
    return out


@pytest.mark.parametrize("scale", [0.25, 1.0 / 3.0])
def test_loss_and_gradients_match_unfused_fp32(scale: float) -> None:
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(40, 8, generator=gen), torch.randn(30, 8, generator=gen)
    labels = torch.randint(0, 30, (40,), generator=gen)
    labels[::7] = -100
    (loss, gx, gw), (ref, rx, rw) = _both(x, w, labels, scale)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(gx, rx, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gw, rw, rtol=1e-5, atol=1e-7)
    assert gx[::7].abs().max() == 0  # ignored tokens get no gradient


def test_bf16_autocast_gradients_match_to_bf16_rounding() -> None:
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(64, 16, generator=gen), torch.randn(50, 16, generator=gen) * 0.3
    labels = torch.randint(0, 50, (64,), generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (loss, gx, gw), (ref, rx, rw) = _both(x, w, labels)
    assert loss.dtype == torch.float32 and gw.dtype == torch.float32
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=0)  # the same bf16 logits, fp32 loss
    for a, b in ((gx, rx), (gw, rw)):
        assert ((a - b).norm() / b.norm()).item() < 1e-2


def test_every_label_ignored_gives_nan_as_unfused() -> None:
    x, w = torch.randn(4, 8), torch.randn(10, 8)
    labels = torch.full((4,), -100)
    (loss, _, _), (ref, _, _) = _both(x, w, labels)
    assert torch.isnan(loss) and torch.isnan(ref)


def test_a_label_out_of_range_gives_a_nan_loss() -> None:
    """Unfused, ``F.cross_entropy`` raises (a device assert on CUDA); fused, the loss is NaN,
    which the rerun state machine's loss check then sees."""
    x, w = torch.randn(4, 8), torch.randn(10, 8)
    for bad in (10, -3):
        labels = torch.tensor([1, bad, 2, 3])
        assert torch.isnan(linear_cross_entropy(x, w, labels))
        with pytest.raises((IndexError, RuntimeError)):
            F.cross_entropy(F.linear(x, w), labels)


def _model_grads(fused: bool, **overrides: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**(BASE | overrides), cross_entropy_loss_fusion=fused))
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 64, (3, 17), generator=gen)
    labels = ids[:, 1:].clone()
    labels[0, :5] = -100
    torch.manual_seed(3)  # the same dropout masks in both runs
    out = model(ids[:, :-1], labels)
    (out["loss"] / 2).backward()
    return out["loss"].detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "overrides",
    [{}, {"untie_embeddings_and_output_weights": True}, {"dropout": 0.1},
     {"num_experts": 4, "moe_router_topk": 2}],
    ids=["tied", "untied", "dropout", "moe"],
)  # fmt: skip
def test_gpt_gradients_match_the_unfused_model(overrides: dict[str, Any]) -> None:
    loss, grads = _model_grads(True, **overrides)
    ref, ref_grads = _model_grads(False, **overrides)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=0)
    assert grads.keys() == ref_grads.keys()
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("untie", [False, True], ids=["tied", "untied"])
def test_with_compute_weights_and_accumulation_fusion(untie: bool) -> None:
    """bf16 copies + gradient accumulation fusion: the output layer's weight gradient goes
    into the fp32 ``.grad`` through the fused loss's backward, over 2 micro-batches."""
    grads = []
    for fused in (False, True):
        torch.manual_seed(0)
        cfg = GPTConfig(**BASE, untie_embeddings_and_output_weights=untie,
                        cross_entropy_loss_fusion=fused)  # fmt: skip
        model = GPT(cfg)
        weights = ComputeWeights(model, compiled=False, fuse_grad_accumulation=True)
        gen = torch.Generator().manual_seed(1)
        weights.refresh()
        for index in range(2):
            ids = torch.randint(0, 64, (2, 17), generator=gen)
            with torch.autocast("cpu", dtype=torch.bfloat16), weights.using():
                (model(ids[:, :-1], ids[:, 1:])["loss"] / 2).backward()
            weights.accumulate(overwrite=index == 0)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, plain in grads[0].items():
        error = (grads[1][name] - plain).norm() / plain.norm().clamp_min(1e-12)
        assert error < 1e-2, (name, error.item())
    output = "output_layer.weight" if untie else "word_embeddings.weight"
    assert grads[1][output].abs().sum() > 0


def test_evaluation_takes_the_unfused_path_bitwise() -> None:
    torch.manual_seed(0)
    fused = GPT(GPTConfig(**BASE, cross_entropy_loss_fusion=True))
    torch.manual_seed(0)
    plain = GPT(GPTConfig(**BASE))
    ids = torch.randint(0, 64, (2, 17))
    with torch.no_grad():
        assert torch.equal(fused(ids[:, :-1], ids[:, 1:])["loss"],
                           plain(ids[:, :-1], ids[:, 1:])["loss"])  # fmt: skip


def test_the_flop_counter_sees_the_fused_matmul() -> None:
    x, w = torch.randn(8, 16, requires_grad=True), torch.randn(32, 16, requires_grad=True)
    labels = torch.randint(0, 32, (8,))
    fused = count_flops(lambda: linear_cross_entropy(x, w, labels).backward())
    plain = count_flops(lambda: F.cross_entropy(F.linear(x, w), labels).backward())
    assert fused == plain == 3 * 2 * 8 * 16 * 32


def test_memory_estimate_drops_the_logits_copies() -> None:
    plain = GPTConfig(**BASE)
    fused = GPTConfig(**BASE, cross_entropy_loss_fusion=True)
    t, v, h = 2 * 16, 64, 32
    a = activation_breakdown(plain, micro_batch_size=2, bf16=True)
    b = activation_breakdown(fused, micro_batch_size=2, bf16=True)
    assert a["head"] - b["head"] == (4 - 2) * t * v  # bf16 gradient kept, not fp32 log-probs
    assert a["loss_backward_transient"] == 8 * t * v
    assert b["loss_backward_transient"] == 2 * 2 * t * h


def _train(tmp_path: Path, name: str, *extra: str) -> list[dict[str, Any]]:
    metrics = tmp_path / f"{name}.jsonl"
    argv = ["train", "--preset", "tiny", "--use-cpu", "--num-layers", "1", "--seq-length", "32",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "6",
            "--log-interval", "1", "--no-progress-bar", "--metrics-file", str(metrics), *extra]  # fmt: skip
    assert main(argv) == 0
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def test_the_trainer_flag_trains_the_same_run(tmp_path: Path) -> None:
    plain = _train(tmp_path, "plain")
    fused = _train(tmp_path, "fused", "--cross-entropy-loss-fusion")
    losses = [r["lm loss"] for r in plain if "lm loss" in r]
    fused_losses = [r["lm loss"] for r in fused if "lm loss" in r]
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert fused_losses == pytest.approx(losses, rel=1e-4)


def test_fp16_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """The gradient is written before the loss scale: fp16 would underflow it."""
    x, w = torch.randn(4, 8, dtype=torch.float16), torch.randn(10, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match="not fp16"):
        linear_cross_entropy(x, w, torch.tensor([1, 2, 3, 4]))
    argv = ["train", "--preset", "tiny", "--use-cpu", "--fp16", "--cross-entropy-loss-fusion"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--cross-entropy-loss-fusion is not supported with --fp16" in err[0]


def test_the_flag_reaches_the_model_and_dispatches_the_fused_op() -> None:
    """The CLI flag -> the run config -> the GPT -> one fused op and no log-softmax (with a
    backward to follow; without one the plain loss)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from train_utils import make_config  # type: ignore[import-not-found]

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.names.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    for flag, fused in ((["--cross-entropy-loss-fusion"], True), ([], False)):
        model = GPT(make_config(*flag).model)
        ids = torch.randint(0, 64, (2, 17))
        with Ops() as ops:
            model(ids[:, :-1], ids[:, 1:])["loss"].backward()
        assert ("stalwart.linear_cross_entropy" in ops.names) is fused
        assert ("aten._log_softmax" in ops.names) is not fused
