"""Speculative launch of the next forward-backward (``stalwart.train.speculative``) on CPU.

The harness of ``test_gated_step``: ``train_step`` with the rerun state machine, graph-mode
validation in a ``ValidationBuffer`` and a gated fused AdamW that stays in eager warm-up. The
speculative launcher runs eagerly here (``ready`` always true), which is what a replay does on the
device. Checked: the same results bitwise as without speculation, each pass launched once, the
read sees the right pass, and a fault found after the next iteration was launched reruns the
faulty one on its own batches and exits exactly as without speculation.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from stalwart.reliability.rerun import (
    EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
    RerunConfig,
    RerunDataIterator,
)
from stalwart.train.speculative import SpeculativeForwardBackward
from stalwart.train.step import train_step
from train.test_gated_step import NUM_ITERS, NUM_MICROBATCHES, _Run


class _SpeculativeRun(_Run):
    """``_Run`` whose forward-backward may be launched one iteration ahead; ``poison_call``
    makes that fb call's losses NaN (a transient fault: the rerun is clean)."""

    def __init__(self, rerun: RerunConfig, *, speculate: bool, poison_call: int = -1) -> None:
        super().__init__(rerun, gated=True)
        self.poison_call = poison_call
        self.num_fb = 0
        self.poison = torch.zeros(())
        self.seen: list[torch.Tensor] = []
        self.speculation = SpeculativeForwardBackward(
            self._counted_forward_backward, self.iterator, [self.validation.buffer]
        )
        # As in graph mode: gradients are zeroed inside the forward-backward, in place.
        self.parts.zero_grad = lambda: None
        if speculate:
            self.parts.forward_backward_func = self.speculation
        else:
            self.parts.forward_backward_func = self._counted_forward_backward

    def _forward_step(self, data_iterator: Any, model: nn.Module) -> dict[str, torch.Tensor]:
        batch = next(data_iterator)
        self.seen.append(batch["x"])
        noise = 0.01 * torch.randn(batch["y"].shape)  # RNG: launches must not shift draws
        loss = nn.functional.mse_loss(model(batch["x"]) + noise, batch["y"]) + self.poison
        self.validation.record_loss(loss)
        return {"loss": loss, "lm loss": loss.detach()}

    def _counted_forward_backward(self, **kwargs: Any) -> list[dict[str, torch.Tensor]]:
        self.poison.fill_(float("nan") if self.num_fb == self.poison_call else 0.0)
        self.num_fb += 1
        for param in self.model.parameters():
            if param.grad is not None:
                param.grad.zero_()
        return self._forward_backward(**kwargs)

    def train(self, num_iters: int = NUM_ITERS) -> list[Any]:
        torch.manual_seed(123)  # the noise draws start from the same state in every run
        results = []
        for iteration in range(num_iters):
            self.machine.set_iteration(iteration)
            speculate = self.parts.forward_backward_func is self.speculation
            self.parts.speculate = None
            if speculate and iteration + 1 < num_iters:
                self.parts.speculate = lambda kw: self.speculation.launch_next(kw, NUM_MICROBATCHES)
            result = train_step(self.parts, self.iterator)
            results.append(result)
            if result.should_exit:
                break
        return results


def _passes(seen: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The inputs of each forward-backward pass, in call order."""
    return [seen[i : i + NUM_MICROBATCHES] for i in range(0, len(seen), NUM_MICROBATCHES)]


def test_speculation_gives_the_same_run_bitwise_with_each_pass_launched_once() -> None:
    ahead = _SpeculativeRun(RerunConfig(), speculate=True)
    plain = _SpeculativeRun(RerunConfig(), speculate=False)
    ahead_results, plain_results = ahead.train(), plain.train()
    assert ahead.num_fb == plain.num_fb == NUM_ITERS  # the speculative launch is the pass
    assert ahead.speculation.num_launched == ahead.speculation.num_used == NUM_ITERS - 1
    for a, b in zip(ahead.params(), plain.params(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(ahead_results, plain_results, strict=True):
        assert a.losses.keys() == b.losses.keys()
        assert all(torch.equal(a.losses[k], b.losses[k]) for k in a.losses)
        assert a.grad_norm is not None and b.grad_norm is not None
        assert torch.equal(a.grad_norm, b.grad_norm)
    # The data order is the loader's: each micro-batch consumed once, in order.
    assert all(torch.equal(a, b) for a, b in zip(ahead.seen, plain.seen, strict=True))


def _rerun_values(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The rerun's result as the machine's verdict logs it ("nan != <rerun value>")."""
    found = re.findall(r"\(nan != ([^)]+)\)", caplog.text)
    caplog.clear()
    return found


def test_fault_read_after_the_next_launch_reruns_the_faulty_iteration(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def config(name: str) -> RerunConfig:
        return RerunConfig(result_rejected_tracker_filename=str(tmp_path / name))

    # fb call 2 is iteration 3's pass in both runs (launched during iteration 2 when ahead).
    ahead = _SpeculativeRun(config("ahead.txt"), speculate=True, poison_call=2)
    plain = _SpeculativeRun(config("plain.txt"), speculate=False, poison_call=2)
    ahead_results = ahead.train()
    ahead_rerun = _rerun_values(caplog)
    plain_results = plain.train()
    # The rerun restored iteration 3's RNG state: the same noise, the same rerun loss.
    assert ahead_rerun == _rerun_values(caplog) and len(ahead_rerun) == 1
    for results in (ahead_results, plain_results):
        assert len(results) == 3 and results[-1].should_exit
        assert results[-1].exit_code == EXIT_CODE_FAILED_ON_RESULT_VALIDATION
    # Ahead: passes 1, 2, 3 (launched ahead), 4 (launched before 3 was read), rerun of 3 on
    # its own batches. Plain: 1, 2, 3, rerun of 3. Iteration 4's launch is never used.
    assert (ahead.num_fb, plain.num_fb) == (5, 4)
    assert ahead.speculation.num_used == 2
    ahead_passes, plain_passes = _passes(ahead.seen), _passes(plain.seen)
    for i, j in [(0, 0), (1, 1), (2, 2), (4, 3)]:
        assert all(torch.equal(a, b) for a, b in zip(ahead_passes[i], plain_passes[j]))
    for a, b in zip(ahead.params(), plain.params(), strict=True):
        assert torch.equal(a, b)
    for name in ("ahead.txt", "plain.txt"):
        assert "iteration=3" in (tmp_path / name).read_text()


def test_a_rerun_after_a_launch_discards_it_and_replays_its_own_batches() -> None:
    # Fault in iteration 2's pass (fb call 1), read after iteration 3 was launched ahead.
    ahead = _SpeculativeRun(RerunConfig(), speculate=True, poison_call=1)
    results = ahead.train()
    assert len(results) == 2 and results[-1].exit_code == EXIT_CODE_FAILED_ON_RESULT_VALIDATION
    # Calls: iteration 1 (normal), 2 (launched ahead), 3 (launched ahead), rerun of 2.
    assert ahead.num_fb == 4 and ahead.speculation.num_used == 1
    per_pass = _passes(ahead.seen)
    assert all(torch.equal(a, b) for a, b in zip(per_pass[3], per_pass[1], strict=True))
    assert not any(torch.equal(a, b) for a, b in zip(per_pass[3], per_pass[2], strict=True))
    reference = _SpeculativeRun(RerunConfig(), speculate=False)
    reference.train(1)
    for a, b in zip(ahead.params(), reference.params(), strict=True):
        assert torch.equal(a, b)


def test_peeked_batches_come_next_and_a_rerun_does_not_see_them() -> None:
    iterator: RerunDataIterator[int] = RerunDataIterator(iter(range(100)))
    iterator.advance()
    assert [next(iterator), next(iterator)] == [0, 1]
    assert iterator.peek(2) == [2, 3]
    iterator.rewind()
    assert [next(iterator), next(iterator)] == [0, 1]
    iterator.advance()
    assert [next(iterator), next(iterator)] == [2, 3]
    iterator.rewind()
    assert [next(iterator), next(iterator)] == [2, 3]
    iterator.advance()
    assert [next(iterator), next(iterator)] == [4, 5]
