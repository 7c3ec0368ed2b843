"""PipelinedGraphLoop on CPU: the graphs stay in eager warm-up (FakeGraphContext), so every
forward-backward and fused AdamW step really runs and reads the same skip gate a captured graph
would. Checked: resolutions arrive one iteration late, accepted runs end bitwise equal to the
plain sequential loop, a rejected iteration leaves the parameters untouched, is replayed on its
own inputs and RNG state, and the discarded next iteration runs again identically."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from graphs_fake_backend import FakeGraphContext  # type: ignore[import-not-found]
from torch import nn

from stalwart.graphs import (
    DeviceFlags,
    FullIterationGraph,
    OptimizerGraph,
    PipelinedGraphLoop,
    make_capturable_adamw,
)

NUM_MICROBATCHES = 2
NUM_ITERS = 5
EAGER_FOREVER = 10**6  # stay in warm-up: every call runs for real on CPU


def _data() -> list[list[dict[str, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(7)
    return [
        [
            {"x": torch.randn(4, 6, generator=gen), "y": torch.randn(4, 1, generator=gen)}
            for _ in range(NUM_MICROBATCHES)
        ]
        for _ in range(NUM_ITERS)
    ]


class _Setup:
    """A linear model with RNG noise in its loss, in-graph checks and a gated fused AdamW."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        device = torch.device("cpu")
        self.model = nn.Linear(6, 1)
        params = list(self.model.parameters())
        self.flags = DeviceFlags(["loss"], device)
        self.gate = torch.zeros((), device=device)
        self.poison = torch.zeros(())  # set to NaN to inject a fault into the next launch
        context = FakeGraphContext()
        self.graph = FullIterationGraph(
            self._forward_backward,
            context=context,
            warmup_steps=EAGER_FOREVER,
            grad_params=params,
            validation_buffer=self.flags,
        )
        optimizer = make_capturable_adamw(params, lr=0.05, device=device, fused=True)
        self.optimizer = OptimizerGraph(
            optimizer,
            context=context,
            clip_grad=1.0,
            warmup_steps=EAGER_FOREVER,
            skip_gate=self.gate,
        )
        self.launched_inputs: list[torch.Tensor] = []

    def _forward_backward(self, *, data_iterator: Any, num_microbatches: int, **unused: Any) -> Any:
        losses = []
        for _ in range(num_microbatches):
            batch = next(data_iterator)
            self.launched_inputs.append(batch["x"].clone())
            noise = 0.01 * torch.randn(batch["y"].shape)  # the rerun must see the same draw
            loss = nn.functional.mse_loss(self.model(batch["x"]) + noise, batch["y"])
            loss = loss + self.poison
            self.flags.record_nonfinite("loss", loss)
            (loss / num_microbatches).backward()
            losses.append(loss.detach())
        self.flags.update_skip_gate_(self.gate)
        return losses

    def sequential(self, data: list[Any], skip: frozenset[int] = frozenset()) -> list[Any]:
        """The plain loop: forward-backward, then a host-decided step (none for ``skip``)."""
        losses = []
        for iteration, batches in enumerate(data):
            out = self.graph(data_iterator=iter(batches), num_microbatches=len(batches))
            losses.append([t.clone() for t in out])
            if iteration not in skip:
                self.optimizer.step()
        return losses

    def params(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_resolutions_arrive_one_late_and_match_the_sequential_loop_bitwise() -> None:
    data = _data()
    reference = _Setup()
    reference_losses = reference.sequential(data)
    setup = _Setup()
    loop = PipelinedGraphLoop(setup.graph, setup.optimizer, setup.flags)
    resolutions = [loop.step(batches) for batches in data]
    resolutions.append(loop.flush())
    assert resolutions[0] is None
    assert [r.iteration for r in resolutions[1:] if r is not None] == list(range(NUM_ITERS))
    for resolution, losses in zip(resolutions[1:], reference_losses, strict=True):
        assert resolution is not None and resolution.accepted
        assert resolution.reproducible is None and resolution.rerun_report is None
        assert _equal(resolution.outputs, losses)
    assert _equal(setup.params(), reference.params())
    assert loop.next_iteration == NUM_ITERS and loop.flush() is None


@pytest.mark.parametrize("persistent", [False, True])
def test_rejected_iteration_is_replayed_and_the_next_one_runs_again(persistent: bool) -> None:
    data = _data()
    setup = _Setup()
    loop = PipelinedGraphLoop(setup.graph, setup.optimizer, setup.flags)
    assert loop.step(data[0]) is None
    assert loop.step(data[1]).accepted  # type: ignore[union-attr]
    setup.poison.fill_(float("nan"))
    assert loop.step(data[2]).accepted  # type: ignore[union-attr]  # resolves 1
    if not persistent:
        setup.poison.zero_()  # a transient fault: gone by the rerun
    before = setup.params()
    inputs_before = len(setup.launched_inputs)
    resolution = loop.step(data[3])
    assert resolution is not None and resolution.iteration == 2 and not resolution.accepted
    assert resolution.report.failed == ["loss"]
    assert resolution.reproducible is persistent
    # The gated step of iteration 2 skipped itself; iteration 3 ran and was discarded.
    assert _equal(setup.params(), before)
    assert loop.next_iteration == 3
    replayed = setup.launched_inputs[inputs_before + NUM_MICROBATCHES :]
    assert _equal(replayed, [batch["x"] for batch in data[2]])  # the rerun used 2's inputs

    if persistent:
        return
    # The rerun drew the same noise as the first pass: its losses equal a clean run's.
    reference = _Setup()
    clean_losses = reference.sequential(data[:3], skip=frozenset())
    assert _equal(resolution.rerun_outputs, clean_losses[2])
    # Going on after a transient fault: iteration 3 again, then 4; 2 stays skipped.
    assert loop.step(data[3]) is None
    assert loop.step(data[4]).accepted  # type: ignore[union-attr]
    last = loop.flush()
    assert last is not None and last.iteration == 4 and last.accepted
    skipping = _Setup()
    skipping.sequential(data, skip=frozenset({2}))
    assert _equal(setup.params(), skipping.params())


def test_needs_a_gated_optimizer_graph() -> None:
    setup = _Setup()
    ungated = OptimizerGraph(
        make_capturable_adamw(list(setup.model.parameters()), lr=0.1, device=torch.device("cpu")),
        context=FakeGraphContext(),
    )
    with pytest.raises(ValueError, match="skip_gate"):
        PipelinedGraphLoop(setup.graph, ungated, setup.flags)
