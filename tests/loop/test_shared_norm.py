"""The clip takes the gradient check's norm instead of reading every gradient again (issue 14).

Without DDP, the gradient check after the backward computes the global norm of the float32
gradients exactly as the clip does (``torch._foreach_norm``, then the norm of the stacked
norms). ``GradCheckState.norm_of`` hands it to the optimizer half of every plan (the eager
gated step, the optimizer graph's body, the step inside the full-iteration graph; the graphs on
the fake backend, in eager warm-up: the very functions a capture records). A tiny GPT trains
with the norm shared and with the sharing turned off (``norm_of`` returning None), same seed
and data, clipping active, and the runs must agree bitwise: logged norms, losses, parameters.
Per iteration the shared run calls ``_foreach_norm`` once instead of twice.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tiny_jobs import (  # type: ignore[import-not-found]
    CFG,
    OPTIMIZER_PATHS,
    OpCount,
    optimizer_plan,
    token_batches,
)
from torch import nn

from stalwart.graphs import clip_in_optimizer_step, make_capturable_adamw
from stalwart.loop import GuardedStep
from stalwart.loop.precision import DynamicLossScaler
from stalwart.models import GPT
from stalwart.reliability.rerun import GradCheckState, RerunConfig, RerunDataIterator

ITERS, MICRO = 3, 2


def _train(path: str, *, fused_clip: bool = False) -> tuple[list[Any], list[torch.Tensor], int]:
    """Results, final parameters and ``_foreach_norm`` calls in the last iteration."""
    torch.manual_seed(0)
    model = GPT(CFG)
    optimizer = make_capturable_adamw(
        list(model.parameters()), lr=1e-2, device=torch.device("cpu"), fused=True
    )
    if fused_clip:
        clip_in_optimizer_step(optimizer)
    step = GuardedStep(
        model=model, optimizer=optimizer, forward_step=lambda b, m: m(b["ids"], labels=b["labels"]),
        machine=RerunConfig().build("cpu"), data=RerunDataIterator(token_batches(4 * ITERS * MICRO)),
        num_microbatches=MICRO, plan=optimizer_plan(path), clip_grad=0.5, lookahead=False,
    )  # fmt: skip
    results = [step.run(it + 1, launch_next=False) for it in range(ITERS - 1)]
    count = OpCount()
    with count:
        results.append(step.run(ITERS, launch_next=False))
    step.close()
    assert not any(r.verdict.exit for r in results)
    return (
        results,
        [p.detach().clone() for p in model.parameters()],
        count.ops["aten._foreach_norm"],
    )


@pytest.mark.parametrize("fused_clip", [False, True], ids=["separate_clip", "clip_in_step"])
@pytest.mark.parametrize("path", OPTIMIZER_PATHS)
def test_shared_norm_is_bitwise_the_clips_own(
    path: str, fused_clip: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared, shared_params, shared_norms = _train(path, fused_clip=fused_clip)
    monkeypatch.setattr(GradCheckState, "norm_of", lambda self, params: None)
    own, own_params, own_norms = _train(path, fused_clip=fused_clip)
    assert (shared_norms, own_norms) == (1, 2)  # the clip no longer reads every gradient
    assert float(own[0].grad_norm) > 0.5  # clipping really happened
    for a, b in zip(own, shared, strict=True):
        assert torch.equal(a.grad_norm, b.grad_norm)
        assert torch.equal(a.losses["lm loss"], b.losses["lm loss"])
    for a, b in zip(own_params, shared_params, strict=True):
        assert torch.equal(a, b)
    # The logged norm is a copy: the next pass's check rewrites the shared tensor in place.
    assert len({r.grad_norm.data_ptr() for r in shared}) == len(shared)


def test_norm_of_needs_the_same_parameters_in_the_same_order() -> None:
    machine = RerunConfig().build("cpu")
    params = [nn.Parameter(torch.full((4,), float(i + 1))) for i in range(3)]
    for p in params:
        p.grad = p.detach().clone()
    state = GradCheckState(machine.recorder, params)
    assert state.norm_of(params) is None  # nothing checked yet
    machine.should_run_forward_backward(iteration=0)
    state.check_after_backward()
    norm = state.norm_of(params)
    assert norm is not None and torch.equal(norm, torch.linalg.vector_norm(torch.cat(params)))
    assert state.norm_of(params[::-1]) is None  # another order rounds differently
    assert state.norm_of(params[:2]) is None
    low = [nn.Parameter(p.detach().bfloat16()) for p in params]
    for p in low:
        p.grad = p.detach().clone()
    bf16 = GradCheckState(machine.recorder, low)
    bf16.check_after_backward()
    assert bf16.norm_of(low) is None  # a bf16 norm: the clip computes its own in float32


def test_scaled_gradients_keep_the_clips_own_norm() -> None:
    """fp16 loss scaling: the check sees scaled gradients, the clip unscaled ones."""
    model = nn.Linear(4, 4)
    step = GuardedStep(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), fused=True),
        forward_step=lambda x, m: m(x).sum(), machine=RerunConfig().build("cpu"),
        data=RerunDataIterator([torch.ones(2, 4)] * 4), num_microbatches=1, clip_grad=1.0,
        loss_scaler=DynamicLossScaler(initial_scale=2.0**16),
    )  # fmt: skip
    assert step.runners.optimizer.norm_source is None  # type: ignore[attr-defined]
    plain = GuardedStep(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), fused=True),
        forward_step=lambda x, m: m(x).sum(), machine=RerunConfig().build("cpu"),
        data=RerunDataIterator([torch.ones(2, 4)] * 4), num_microbatches=1, clip_grad=1.0,
    )  # fmt: skip
    assert isinstance(plain.runners.optimizer.norm_source, GradCheckState)  # type: ignore[attr-defined]
