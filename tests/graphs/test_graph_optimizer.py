from __future__ import annotations

import pytest
import torch
from graphs_fake_backend import FakeGraphContext  # type: ignore[import-not-found]

from stalwart.graphs import (
    OptimizerGraph,
    StagePhase,
    clip_coefficient,
    clip_grads_,
    grad_norm,
    set_learning_rate,
)


def _params_with_grads(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(5, 3, generator=gen)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 10
    return params


def test_grad_norm_and_clip_match_torch() -> None:
    ours, ref = _params_with_grads(), _params_with_grads()
    expected = torch.nn.utils.clip_grad_norm_(ref, 1.0)
    total = clip_grads_(ours, 1.0)
    torch.testing.assert_close(total, expected)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.grad, b.grad)
    torch.testing.assert_close(grad_norm(ours), torch.tensor(1.0), atol=1e-5, rtol=1e-5)


def test_clip_coefficient_is_capped_at_one_and_propagates_nan() -> None:
    assert clip_coefficient(torch.tensor(0.5), 1.0).item() == 1.0
    assert clip_coefficient(torch.tensor(4.0), 1.0).item() == pytest.approx(0.25, rel=1e-5)
    assert torch.isnan(clip_coefficient(torch.tensor(float("nan")), 1.0))


def test_set_learning_rate_updates_tensor_in_place() -> None:
    lr = torch.tensor(1.0)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=lr)
    set_learning_rate(opt, 0.25)
    assert opt.param_groups[0]["lr"] is lr and lr.item() == 0.25
    plain = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0)
    set_learning_rate(plain, 0.5)
    assert plain.param_groups[0]["lr"] == 0.5


class CountingOptimizer(torch.optim.Optimizer):
    def __init__(self, params: list[torch.nn.Parameter], capturable: bool = True) -> None:
        super().__init__(params, {"lr": torch.tensor(0.1), "capturable": capturable})
        self.steps = 0

    def step(self, closure: object = None) -> None:  # type: ignore[override]
        self.steps += 1
        for group in self.param_groups:
            for p in group["params"]:
                p.data.add_(p.grad, alpha=-group["lr"].item())


def test_optimizer_graph_warms_up_captures_and_replays() -> None:
    ctx = FakeGraphContext()
    opt = CountingOptimizer(_params_with_grads())
    graph = OptimizerGraph(opt, context=ctx, clip_grad=1.0, warmup_steps=2)
    norms = [graph.step(lr=0.1) for _ in range(2)]
    assert opt.steps == 2 and graph.phase is StagePhase.WARMUP and norms[0] is not None
    static_norm = graph.step(lr=0.05)
    assert graph.phase is StagePhase.CAPTURED and ctx.num_replays == 1
    assert opt.param_groups[0]["lr"].item() == pytest.approx(0.05)
    assert graph.step(lr=0.01) is static_norm and opt.steps == 3 and ctx.num_replays == 2
    ctx.teardown()
    assert graph.phase is StagePhase.WARMUP


def test_optimizer_graph_rejects_non_graphable_optimizers() -> None:
    ctx = FakeGraphContext()
    with pytest.raises(ValueError, match="capturable=False"):
        OptimizerGraph(CountingOptimizer(_params_with_grads(), capturable=False), context=ctx)
    sgd = torch.optim.SGD(_params_with_grads(), lr=0.1)
    sgd.param_groups[0]["capturable"] = True
    with pytest.raises(ValueError, match="learning rate as a device tensor"):
        OptimizerGraph(sgd, context=ctx)
    with pytest.raises(ValueError, match="warmup_steps must be an integer >= 2"):
        OptimizerGraph(CountingOptimizer(_params_with_grads()), context=ctx, warmup_steps=1)
    with pytest.raises(ValueError, match="--clip-grad"):
        OptimizerGraph(CountingOptimizer(_params_with_grads()), context=ctx, clip_grad=-1.0)


def _fused_adamw(params: list[torch.nn.Parameter]) -> torch.optim.AdamW:
    from stalwart.graphs import make_capturable_adamw

    return make_capturable_adamw(params, lr=0.1, device=torch.device("cpu"), fused=True)


def test_skip_gate_skips_the_step_on_the_device_and_rolls_back_the_counter() -> None:
    params = _params_with_grads()
    before = [p.detach().clone() for p in params]
    gate = torch.ones((), dtype=torch.float32)
    opt = _fused_adamw(params)
    graph = OptimizerGraph(opt, context=FakeGraphContext(), clip_grad=1.0, skip_gate=gate)
    graph.step(gated=True)  # eager warm-up step: the fused kernel reads the gate
    for p, b in zip(params, before):
        assert torch.equal(p.detach(), b)
        assert opt.state[p]["step"].item() == 0.0 and not opt.state[p]["exp_avg"].any()
    gate.zero_()
    graph.step(gated=True)
    assert all(not torch.equal(p.detach(), b) for p, b in zip(params, before))
    assert all(opt.state[p]["step"].item() == 1.0 for p in params)


def test_host_decided_step_clears_the_gate() -> None:
    gated, plain = _params_with_grads(), _params_with_grads()
    gate = torch.ones((), dtype=torch.float32)
    graph = OptimizerGraph(_fused_adamw(gated), context=FakeGraphContext(), skip_gate=gate)
    reference = OptimizerGraph(_fused_adamw(plain), context=FakeGraphContext())
    graph.step()  # gated=False: the host decided to step, a stale gate must not block it
    reference.step()
    assert gate.item() == 0.0
    for a, b in zip(gated, plain):
        assert torch.equal(a.detach(), b.detach())


def test_skip_gate_needs_fused_adamw_and_gated_needs_a_gate() -> None:
    ctx = FakeGraphContext()
    gate = torch.zeros((), dtype=torch.float32)
    foreach = torch.optim.AdamW(
        _params_with_grads(), lr=torch.tensor(0.1), capturable=True, foreach=True
    )
    with pytest.raises(ValueError, match="fused AdamW"):
        OptimizerGraph(foreach, context=ctx, skip_gate=gate)
    with pytest.raises(ValueError, match="float32"):
        OptimizerGraph(_fused_adamw(_params_with_grads()), context=ctx, skip_gate=gate.double())
    plain = OptimizerGraph(_fused_adamw(_params_with_grads()), context=ctx)
    with pytest.raises(ValueError, match="skip_gate"):
        plain.step(gated=True)


def test_overlapped_replay_runs_on_the_second_stream_and_joins() -> None:
    ctx = FakeGraphContext()
    gate = torch.zeros((), dtype=torch.float32)
    graph = OptimizerGraph(_fused_adamw(_params_with_grads()), context=ctx, skip_gate=gate)
    for _ in range(3):  # two warm-up steps and the capture never overlap
        graph.step(gated=True, overlap=True)
    assert graph.phase is StagePhase.CAPTURED and ctx.num_overlapped == 0
    graph.step(gated=True, overlap=True)
    graph.join()
    assert ctx.num_overlapped == 1 and ctx.num_joins == 1 and ctx.num_replays == 2
