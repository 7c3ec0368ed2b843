"""The device-gated optimizer step in ``train_step`` (graph mode's overlapped validation read).

On CPU the optimizer "graph" stays in eager warm-up (``FakeGraphContext``), so every step runs
fused AdamW for real and reads the same skip gate the captured graph would: the tests check the
decisions (when the gated step is launched, when the host-decided step runs instead, joins) and
that the final parameters equal the plain host-decided path bitwise.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from stalwart.graphs import OptimizerGraph, make_capturable_adamw
from stalwart.reliability.rerun import (
    EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
    RerunConfig,
    RerunDataIterator,
    make_state_machine,
)
from stalwart.train.graphed import GraphValidation
from stalwart.train.precision import NullLossScaler
from stalwart.train.step import StepParts, forward_backward, train_step

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "graphs"))
from graphs_fake_backend import FakeGraphContext  # type: ignore[import-not-found]

NUM_MICROBATCHES = 2
NUM_ITERS = 4


def _batches() -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [
        {"x": torch.randn(4, 6, generator=gen), "y": torch.randn(4, 1, generator=gen)}
        for _ in range(NUM_ITERS * NUM_MICROBATCHES)
    ]


class _Run:
    """A linear model trained through ``train_step`` with graph-mode validation on CPU."""

    def __init__(self, rerun: RerunConfig, *, gated: bool) -> None:
        torch.manual_seed(0)
        self.model = nn.Linear(6, 1)
        params = list(self.model.parameters())
        self.machine = make_state_machine(rerun)
        self.validation = GraphValidation(torch.device("cpu"), NUM_MICROBATCHES, True)
        self.machine.attach_buffer(self.validation.buffer)
        optimizer = make_capturable_adamw(params, lr=0.05, device=torch.device("cpu"), fused=True)
        self.context = FakeGraphContext()
        self.opt_graph = OptimizerGraph(
            optimizer,
            context=self.context,
            clip_grad=1.0,
            warmup_steps=10**6,  # stay eager: every step really runs on CPU
            skip_gate=self.validation.skip_gate,
        )
        self.calls: list[str] = []
        self.parts = StepParts(
            model=self.model,
            optimizer=optimizer,
            forward_step_func=self._forward_step,
            num_microbatches=NUM_MICROBATCHES,
            clip_grad=1.0,
            loss_scaler=NullLossScaler(),
            rerun=self.machine,
            forward_backward_func=self._forward_backward,
            clip_and_step=self._host_step,
            gated_step=self._gated_step if gated else None,
            join_gated_step=self._join if gated else None,
        )
        self.iterator: RerunDataIterator[Any] = RerunDataIterator(_batches())

    def _forward_step(self, data_iterator: Any, model: nn.Module) -> dict[str, torch.Tensor]:
        batch = next(data_iterator)
        loss = nn.functional.mse_loss(model(batch["x"]), batch["y"])
        self.validation.record_loss(loss)
        return {"loss": loss, "lm loss": loss.detach()}

    def _forward_backward(self, **kwargs: Any) -> list[dict[str, torch.Tensor]]:
        self.calls.append("fb")
        self.validation.begin_pass()
        reported = forward_backward(**kwargs)
        self.validation.record_grads(list(self.model.parameters()))
        self.validation.update_skip_gate()
        return reported

    def _host_step(self, params: list[nn.Parameter], clip_grad: float) -> torch.Tensor | None:
        self.calls.append("host_step")
        return self.opt_graph.step()

    def _gated_step(self) -> torch.Tensor | None:
        self.calls.append("gated_step")
        return self.opt_graph.step(gated=True, overlap=True)

    def _join(self) -> None:
        self.calls.append("join")
        self.opt_graph.join()

    def train(self, num_iters: int = NUM_ITERS) -> list[Any]:
        results = []
        for iteration in range(num_iters):
            self.machine.set_iteration(iteration)
            result = train_step(self.parts, self.iterator)
            results.append(result)
            if result.should_exit:
                break
        return results

    def params(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]


def test_gated_step_replaces_the_host_step_and_matches_it_bitwise() -> None:
    gated, plain = _Run(RerunConfig(), gated=True), _Run(RerunConfig(), gated=False)
    gated_results, plain_results = gated.train(), plain.train()
    assert gated.calls == ["fb", "gated_step", "join"] * NUM_ITERS
    assert plain.calls == ["fb", "host_step"] * NUM_ITERS
    for a, b in zip(gated.params(), plain.params()):
        assert torch.equal(a, b)
    for a, b in zip(gated_results, plain_results):
        assert a.grad_norm is not None and torch.equal(a.grad_norm, b.grad_norm)
        assert not a.skipped


def test_rejected_pass_skips_on_the_device_and_the_rerun_decides(tmp_path: Path) -> None:
    config = RerunConfig(
        error_injection_rate=1,
        error_injection_type="transient_error",
        error_injection_iterations=[3],  # numbered from 1, as logged
        result_rejected_tracker_filename=str(tmp_path / "tracker.txt"),
    )
    run = _Run(config, gated=True)
    results = run.train()
    assert len(results) == 3 and results[-1].should_exit
    assert results[-1].exit_code == EXIT_CODE_FAILED_ON_RESULT_VALIDATION
    # Iteration 3: the gated step was launched (and skipped itself), joined before the rerun
    # pass; the rerun pass launches nothing; the exit means no host step either.
    assert run.calls[-4:] == ["fb", "gated_step", "join", "fb"]
    assert run.calls.count("host_step") == 0
    # Parameters and step counters are those after iteration 2.
    reference = _Run(RerunConfig(), gated=False)
    reference.train(2)
    for a, b in zip(run.params(), reference.params()):
        assert torch.equal(a, b)
    state = run.opt_graph.optimizer.state
    assert all(s["step"].item() == 2.0 for s in state.values())
    assert "iteration=3" in (tmp_path / "tracker.txt").read_text()


def test_determinism_stats_mode_never_steps_before_the_read() -> None:
    config = RerunConfig(rerun_mode="report_determinism_stats")
    gated, plain = _Run(config, gated=True), _Run(config, gated=False)
    gated.train(2)
    plain.train(2)
    assert "gated_step" not in gated.calls
    assert gated.calls.count("host_step") == 2 and gated.calls.count("fb") == 4
    for a, b in zip(gated.params(), plain.params()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["validate_results", "disabled"])
def test_machine_allows_the_early_step_only_in_the_initial_pass(mode: str) -> None:
    run = _Run(RerunConfig(rerun_mode=mode), gated=True)
    assert not run.machine.allows_step_before_validation()  # no iteration started
    run.machine.set_iteration(0)
    assert run.machine.should_run_forward_backward(run.iterator)
    assert run.machine.allows_step_before_validation()


def test_eval_losses_are_checked_on_the_host_in_graph_mode() -> None:
    from stalwart.train.graphed import check_eval_losses

    machine = make_state_machine(RerunConfig())
    check_eval_losses(machine, {"lm loss": 2.5}, RerunConfig())
    with pytest.raises(RuntimeError, match="NaN"):
        check_eval_losses(machine, {"lm loss": float("nan")}, RerunConfig())
    with pytest.raises(RuntimeError):
        check_eval_losses(machine, {"lm loss": float("inf")}, RerunConfig())


def test_inprocess_restart_of_a_graphed_nccl_job_is_refused() -> None:
    from stalwart.train.graphed import check_inprocess_with_graphs

    from train_utils import make_config

    both = make_config(
        "--inprocess-restart", "--save", "/tmp/x", "--cuda-graph-impl", "full_iteration"
    )
    with pytest.raises(ValueError, match="--inprocess-restart with --cuda-graph-impl"):
        check_inprocess_with_graphs(both, "cuda", 2)
    check_inprocess_with_graphs(both, "cuda", 1)  # one rank: no communicator to abort
    check_inprocess_with_graphs(both, "cpu", 2)
    check_inprocess_with_graphs(make_config("--inprocess-restart", "--save", "/tmp/x"), "cuda", 2)
