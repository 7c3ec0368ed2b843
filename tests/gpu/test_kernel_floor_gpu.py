"""The kernel-floor ingredients captured for real (run on the device machine).

The optimizer step inside the full-iteration graph, with bf16 compute weights (compiled foreach
copy and add, captured in the same graph) and the bf16 residual stream, against the plain eager
guarded step on the same seed and data: every loss within the rerun gradient tolerance (1e-3
relative; the bf16 residual within 2e-2), the graph captured and replayed with its own step, and
a NaN while the graph holds the step skips it on the device like the eager gated step.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from stalwart.graphs import GraphMode, StagePhase, make_capturable_adamw
from stalwart.loop import ComputeWeights, EagerPlan, GraphPlan, GuardedStep
from stalwart.models import GPT, GPTConfig
from stalwart.reliability.rerun import RerunConfig, RerunDataIterator

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ITERS, MICRO = 10, 4


@pytest.fixture(autouse=True)
def _deterministic() -> Iterator[None]:
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.cuda.synchronize()


def _config(**overrides: Any) -> GPTConfig:
    base: dict[str, Any] = dict(
        num_layers=2, hidden_size=128, num_attention_heads=4, seq_length=64, vocab_size=512
    )
    return GPTConfig(**(base | overrides))


class Job:
    def __init__(
        self, cfg: GPTConfig, *, floor: bool, nan_iteration: int = -1, fuse: bool = False
    ) -> None:
        device = torch.device("cuda")
        torch.manual_seed(0)
        self.model = GPT(cfg).to(device)
        optimizer = make_capturable_adamw(
            list(self.model.parameters()), lr=1e-3, device=device, fused=True
        )
        gen = torch.Generator().manual_seed(5)
        batches = []
        for _ in range(3 * ITERS * MICRO):
            tokens = torch.randint(0, cfg.vocab_size, (4, cfg.seq_length + 1), generator=gen)
            batches.append({"ids": tokens[:, :-1].to(device), "labels": tokens[:, 1:].to(device)})
        self.weights = ComputeWeights(self.model, fuse_grad_accumulation=fuse) if floor else None
        plan = GraphPlan(warmup_steps=2, optimizer_in_graph=True) if floor else EagerPlan()
        # A device scalar, so the fault reaches a replayed graph (no Python runs in a replay).
        self.poison = torch.ones((), device=device)
        self.nan_iteration = nan_iteration
        self.step = GuardedStep(
            model=self.model, optimizer=optimizer, forward_step=self._forward,
            machine=RerunConfig().build(device), data=RerunDataIterator(batches),
            num_microbatches=MICRO, plan=plan, clip_grad=1.0, lookahead=False,
            autocast=lambda: torch.autocast("cuda", dtype=torch.bfloat16),
            compute_weights=self.weights,
        )  # fmt: skip

    def _forward(self, batch: dict[str, torch.Tensor], model: nn.Module) -> Any:
        out = model(batch["ids"], batch["labels"])
        return dict(out, loss=out["loss"] * self.poison)

    def train(self) -> list[Any]:
        results = []
        for it in range(ITERS):
            if it == self.nan_iteration:  # every pass of it: a reproducible fault (exit 16)
                self.poison.fill_(float("nan"))
            results.append(self.step.run(it + 1, launch_next=False))
            if results[-1].verdict.exit:
                break
        torch.cuda.synchronize()
        return results


@pytest.mark.parametrize("residual", [False, True], ids=["fp32-residual", "bf16-residual"])
def test_in_graph_step_and_compute_weights_match_eager(residual: bool) -> None:
    plain = Job(_config(), floor=False)
    floor = Job(_config(bf16_residual_connection=residual), floor=True)
    a, b = plain.train(), floor.train()
    rtol = 2e-2 if residual else 1e-3
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(y.losses["lm loss"], x.losses["lm loss"], rtol=rtol, atol=0)
    runner = floor.step.runners.optimizer
    assert runner._in_pass  # the last iterations' steps were the graph's
    fb = floor.step.runners.evaluate
    assert fb.phase(GraphMode.TRAINING) is StagePhase.CAPTURED
    assert floor.weights is not None and floor.weights.compiled


def test_nan_while_the_graph_holds_the_step_skips_it_on_the_device() -> None:
    nan_iteration = 4  # captured by then (2 warm-up passes), the step in the graph
    eager = Job(_config(), floor=False, nan_iteration=nan_iteration)
    floor = Job(_config(), floor=True, nan_iteration=nan_iteration)
    a, b = eager.train(), floor.train()
    assert len(a) == len(b) == 5 and a[-1].verdict == b[-1].verdict and b[-1].verdict.exit
    # A step taken on the NaN gradients would make the parameters NaN; the comparison with the
    # eager run allows Adam's lr-sized steps on near-zero gradients (4 steps of lr 1e-3).
    assert torch.isfinite(torch.cat([p.flatten() for p in floor.model.parameters()])).all()
    for x, y in zip(eager.model.parameters(), floor.model.parameters(), strict=True):
        torch.testing.assert_close(y, x, rtol=0, atol=4e-3)


def test_gradient_accumulation_fusion_in_the_graph_matches_eager() -> None:
    """``--gradient-accumulation-fusion`` captured: the weight-gradient GEMMs write fp32 into
    the fp32 grads (cuBLAS, beta 1) and the lookup adds its rows; the losses stay within the
    rerun tolerance of the plain eager step, the parameters close to it."""
    plain = Job(_config(), floor=False)
    fused = Job(_config(), floor=True, fuse=True)
    assert fused.weights is not None and fused.weights.fp32_gemm  # the fp32-output GEMM runs
    a, b = plain.train(), fused.train()
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(y.losses["lm loss"], x.losses["lm loss"], rtol=1e-3, atol=0)
    assert fused.step.runners.evaluate.phase(GraphMode.TRAINING) is StagePhase.CAPTURED


@pytest.mark.parametrize("untie", [False, True], ids=["tied", "untied"])
def test_fused_loss_in_the_graph_matches_eager(untie: bool) -> None:
    """``--cross-entropy-loss-fusion`` (the Triton kernel) captured with the bf16 copies and
    gradient accumulation fusion: losses within the rerun tolerance of the plain eager step."""
    plain = Job(_config(untie_embeddings_and_output_weights=untie), floor=False)
    cfg = _config(untie_embeddings_and_output_weights=untie, cross_entropy_loss_fusion=True)
    fused = Job(cfg, floor=True, fuse=True)
    a, b = plain.train(), fused.train()
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(y.losses["lm loss"], x.losses["lm loss"], rtol=1e-3, atol=0)
    assert fused.step.runners.evaluate.phase(GraphMode.TRAINING) is StagePhase.CAPTURED


@pytest.mark.parametrize("untie", [False, True], ids=["tied", "untied"])
def test_fused_gradients_match_the_copies_gradients(untie: bool) -> None:
    """One pass of 4 micro-batches, eager, the same seed and data: every fp32 gradient with the
    fusion is the unfused one up to bf16 rounding (the fused GEMM sums in fp32; the unfused
    rounds each micro-batch's weight gradient to bf16 first)."""
    grads = []
    for fuse in (False, True):
        torch.manual_seed(0)
        cfg = _config(untie_embeddings_and_output_weights=untie)
        model = GPT(cfg).cuda()
        weights = ComputeWeights(model, fuse_grad_accumulation=fuse)
        assert weights.fp32_gemm is fuse
        gen = torch.Generator().manual_seed(3)
        weights.refresh()
        for index in range(MICRO):
            ids = torch.randint(0, cfg.vocab_size, (4, cfg.seq_length + 1), generator=gen).cuda()
            with torch.autocast("cuda", dtype=torch.bfloat16), weights.using():
                (model(ids[:, :-1], ids[:, 1:])["loss"] / MICRO).backward()
            weights.accumulate(overwrite=index == 0)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, plain in grads[0].items():
        error = (grads[1][name] - plain).norm() / plain.norm().clamp_min(1e-12)
        assert error < 1e-2, (name, error.item())
