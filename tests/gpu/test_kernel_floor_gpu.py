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
    def __init__(self, cfg: GPTConfig, *, floor: bool, nan_iteration: int = -1) -> None:
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
        self.weights = ComputeWeights(self.model) if floor else None
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
            results.append(self.step.run(it, launch_next=False))
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
