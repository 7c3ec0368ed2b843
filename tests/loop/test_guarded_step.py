"""``GuardedStep`` on CPU: the look-ahead is exact, eager and graphed, under reruns and faults.

Eager: fused AdamW reads the machine's skip gate (found_inf on CPU), the next iteration's first
micro-batch runs before the read. Graphed: a ``GraphPlan`` over ``FakeGraphContext`` stays in
eager warm-up (every call really runs), and the look-ahead is allowed during warm-up here so the
whole-pass launch of a graph is what runs. Checked against the same step with the look-ahead
off: losses, grad norms and parameters bitwise, each pass launched once, the read sees the right
pass, a fault found after the next iteration was launched reruns the faulty one on its own
micro-batches and RNG and exits exactly as without the launch.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from stalwart.graphs import make_capturable_adamw
from stalwart.loop import EagerPlan, GraphPlan, GuardedStep, StepResult
from stalwart.reliability.rerun import (
    EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
    CheckConfig,
    RerunConfig,
    RerunDataIterator,
    RerunErrorInjector,
    RerunStateMachine,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "graphs"))
from graphs_fake_backend import FakeGraphContext  # type: ignore[import-not-found]

NUM_MICROBATCHES = 2
NUM_ITERS = 5
EAGER_FOREVER = 10**6


def _batches() -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [
        {"x": torch.randn(4, 6, generator=gen), "y": torch.randn(4, 1, generator=gen)}
        for _ in range(NUM_ITERS * NUM_MICROBATCHES + 4)
    ]


class Run:
    """A linear model with RNG noise in its loss; ``poison_call`` makes that forward's loss NaN
    (a transient fault: the rerun is clean), ``spike_call`` multiplies it by 1000."""

    def __init__(
        self,
        *,
        lookahead: bool,
        graphed: bool = False,
        rerun: RerunConfig | None = None,
        poison_call: int = -1,
        spike_call: int = -1,
        injector: RerunErrorInjector | None = None,
        checks: CheckConfig | None = None,
    ) -> None:
        torch.manual_seed(0)
        self.model = nn.Linear(6, 1)
        params = list(self.model.parameters())
        config = rerun or RerunConfig()
        self.machine = RerunStateMachine(
            mode=config.mode,
            error_injector=injector,
            result_rejected_tracker_filename=config.result_rejected_tracker_filename,
            checks=checks or config.checks,
            device="cpu",
        )
        self.data: RerunDataIterator[Any] = RerunDataIterator(_batches())
        self.calls, self.seen = 0, []
        self.poison_call, self.spike_call = poison_call, spike_call
        plan: EagerPlan | GraphPlan = EagerPlan()
        if graphed:
            optimizer = make_capturable_adamw(
                params, lr=0.05, device=torch.device("cpu"), fused=True
            )
            plan = GraphPlan(
                context=FakeGraphContext(),
                warmup_steps=EAGER_FOREVER,
                optimizer_warmup_steps=EAGER_FOREVER,
            )
        else:
            optimizer = torch.optim.AdamW(params, lr=0.05, fused=True)
        self.step = GuardedStep(
            model=self.model, optimizer=optimizer, forward_step=self._forward,
            machine=self.machine, data=self.data, num_microbatches=NUM_MICROBATCHES,
            plan=plan, clip_grad=1.0, lookahead=lookahead,
        )  # fmt: skip
        if graphed:  # the fake graph never captures: allow the whole-pass launch in warm-up
            self.step._lookahead.ready = lambda: True

    def _forward(self, batch: dict[str, torch.Tensor], model: nn.Module) -> Any:
        self.seen.append(batch["x"])
        noise = 0.01 * torch.randn(batch["y"].shape)  # RNG: launches must not shift draws
        loss = nn.functional.mse_loss(model(batch["x"]) + noise, batch["y"])
        if self.calls == self.poison_call:
            loss = loss * float("nan")
        if self.calls == self.spike_call:
            loss = loss * 1000.0
        self.calls += 1
        return {"loss": loss, "lm loss": loss.detach()}

    def train(self, num_iters: int = NUM_ITERS) -> list[StepResult]:
        torch.manual_seed(123)  # the noise draws start from the same state in every run
        results = []
        for it in range(num_iters):
            result = self.step.run(it + 1, launch_next=it + 1 < num_iters)
            results.append(result)
            if result.verdict.exit:
                break
        return results

    def params(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]


def _same_results(a: list[StepResult], b: list[StepResult]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.losses.keys() == y.losses.keys()
        assert all(torch.equal(x.losses[k], y.losses[k]) for k in x.losses)
        assert (x.grad_norm is None) == (y.grad_norm is None)
        if x.grad_norm is not None:
            assert torch.equal(x.grad_norm, y.grad_norm)
        assert x.verdict == y.verdict


def _same_params(a: Run, b: Run) -> None:
    for x, y in zip(a.params(), b.params(), strict=True):
        assert torch.equal(x, y)


def _passes(seen: list[torch.Tensor], per_pass: int = NUM_MICROBATCHES) -> list[list[torch.Tensor]]:
    return [seen[i : i + per_pass] for i in range(0, len(seen), per_pass)]


@pytest.mark.parametrize("graphed", [False, True])
def test_lookahead_gives_the_same_run_bitwise_with_each_pass_launched_once(graphed: bool) -> None:
    ahead, plain = Run(lookahead=True, graphed=graphed), Run(lookahead=False, graphed=graphed)
    ahead_results, plain_results = ahead.train(), plain.train()
    assert ahead.calls == plain.calls == NUM_ITERS * NUM_MICROBATCHES  # the launch is the pass
    assert ahead.step.num_launched == ahead.step.num_used == NUM_ITERS - 1
    assert plain.step.num_launched == 0
    _same_results(ahead_results, plain_results)
    _same_params(ahead, plain)
    # The data order is the loader's: each micro-batch consumed once, in order.
    assert all(torch.equal(a, b) for a, b in zip(ahead.seen, plain.seen, strict=True))


@pytest.mark.parametrize("graphed", [False, True])
def test_the_next_batches_are_read_before_the_optimizer_step_is_queued(graphed: bool) -> None:
    """The launch's micro-batches are built while the device still runs the pass (before the
    short optimizer step), not between the step and the launch; the run stays the same."""
    events: list[str] = []
    ahead, plain = Run(lookahead=True, graphed=graphed), Run(lookahead=False, graphed=graphed)

    def logged(items: list[dict[str, torch.Tensor]]) -> Any:
        for item in items:
            events.append("pull")
            yield item

    ahead.data.iterable = logged(_batches())
    step = ahead.step.optimizer.step

    def logged_step(*args: Any, **kwargs: Any) -> Any:
        events.append("step")
        return step(*args, **kwargs)

    ahead.step.optimizer.step = logged_step  # type: ignore[method-assign]
    begin_ahead = ahead.machine.begin_ahead

    def logged_begin(*args: Any, **kwargs: Any) -> Any:
        events.append("begin ahead")
        return begin_ahead(*args, **kwargs)

    ahead.machine.begin_ahead = logged_begin  # type: ignore[method-assign]
    _same_results(ahead.train(), plain.train())
    _same_params(ahead, plain)
    # A graph's launch is staged (the next pass begun, its inputs loaded) before the step and
    # only replayed after it; an eager launch runs its micro-batch after the step.
    order = [e for e in events if e != "pull"]
    per_iter = ["begin ahead", "step"] if graphed else ["step", "begin ahead"]
    assert order == per_iter * (NUM_ITERS - 1) + ["step"], order
    events[:] = [e for e in events if e != "begin ahead"]
    per_launch = NUM_MICROBATCHES if graphed else 1
    # Iteration 0 pulls its own batches, then the launch's; every later step comes after
    # the next launch's batches were pulled.
    steps = [i for i, e in enumerate(events) if e == "step"]
    pulls_before = [events[:i].count("pull") for i in steps]
    own = [NUM_MICROBATCHES * (k + 1) for k in range(NUM_ITERS)]
    expected = [o + (per_launch if k + 1 < NUM_ITERS else 0) for k, o in enumerate(own)]
    assert pulls_before == expected, events


def _rerun_values(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The rerun's result as the machine's verdict logs it ("nan != <rerun value>")."""
    found = re.findall(r"\(nan != ([^)]+)\)", caplog.text)
    caplog.clear()
    return found


@pytest.mark.parametrize("graphed", [False, True])
def test_fault_read_after_the_next_launch_reruns_the_faulty_iteration(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, graphed: bool
) -> None:
    def config(name: str) -> RerunConfig:
        return RerunConfig(result_rejected_tracker_filename=str(tmp_path / name))

    # Forward call 4 is iteration 3's first micro-batch: launched ahead during iteration 2.
    ahead = Run(lookahead=True, graphed=graphed, rerun=config("ahead.txt"), poison_call=4)
    plain = Run(lookahead=False, graphed=graphed, rerun=config("plain.txt"), poison_call=4)
    ahead_results = ahead.train()
    ahead_rerun = _rerun_values(caplog)
    plain_results = plain.train()
    # The rerun restored iteration 3's RNG state: the same noise, the same rerun loss.
    assert ahead_rerun == _rerun_values(caplog) and len(ahead_rerun) == 1
    for results in (ahead_results, plain_results):
        assert len(results) == 3 and results[-1].verdict.exit
        assert results[-1].verdict.exit_code == EXIT_CODE_FAILED_ON_RESULT_VALIDATION
        assert results[-1].skipped and results[-1].grad_norm is None
    _same_results(ahead_results, plain_results)
    _same_params(ahead, plain)
    # Ahead, iteration 4's launch (ahead of iteration 3's read) is discarded, never used, and
    # the rerun pass replayed iteration 3's own micro-batches.
    launched = 1 if not graphed else NUM_MICROBATCHES
    assert ahead.calls == plain.calls + launched
    per_pass = _passes(ahead.seen)
    rerun_pass = ahead.seen[-NUM_MICROBATCHES:]
    assert all(torch.equal(a, b) for a, b in zip(rerun_pass, per_pass[2], strict=True))
    for name in ("ahead.txt", "plain.txt"):
        assert "iteration=3" in (tmp_path / name).read_text()


def test_non_fatal_spike_after_a_launch_continues_exactly(tmp_path: Path) -> None:
    # A window of 4 samples (2 iterations), then forward call 6 (iteration 4's first
    # micro-batch, launched ahead during iteration 3) spikes: rerun, continue, same steps.
    checks = CheckConfig(nan_and_inf=True, spiky_loss=True, large_samples=4)
    tracker = RerunConfig(result_rejected_tracker_filename=str(tmp_path / "t.txt"))
    ahead = Run(lookahead=True, checks=checks, spike_call=6, rerun=tracker)
    plain = Run(lookahead=False, checks=checks, spike_call=6)
    ahead_results, plain_results = ahead.train(), plain.train()
    _same_results(ahead_results, plain_results)
    _same_params(ahead, plain)
    assert all(not r.verdict.exit for r in ahead_results)
    assert "Spiky loss" in (tmp_path / "t.txt").read_text()
    # The spiked pass ran twice in both (initial + rerun); ahead, the next iteration's first
    # micro-batch, launched before the read found the spike, was discarded and run again.
    assert ahead.calls == plain.calls + 1


def test_injected_faults_turn_the_lookahead_off_and_stay_exact(tmp_path: Path) -> None:
    def run(lookahead: bool) -> Run:
        injector = RerunErrorInjector(1, "transient_error", at_iterations={2})
        return Run(lookahead=lookahead, injector=injector)

    ahead, plain = run(True), run(False)
    ahead_results, plain_results = ahead.train(), plain.train()
    assert ahead.step.num_launched == 0  # the injector decides per pass, as a pass begins
    _same_results(ahead_results, plain_results)
    _same_params(ahead, plain)
    assert ahead_results[-1].verdict.exit_code == EXIT_CODE_FAILED_ON_RESULT_VALIDATION
    # Parameters are those after iteration 2: the rejected step skipped itself on the device.
    reference = Run(lookahead=False)
    reference.train(2)
    _same_params(ahead, reference)


def test_settle_drops_the_launch_and_the_next_run_is_unchanged() -> None:
    settled, plain = Run(lookahead=True), Run(lookahead=False)
    torch.manual_seed(123)
    settled_results = []
    for it in range(NUM_ITERS):
        settled_results.append(settled.step.run(it + 1, launch_next=it + 1 < NUM_ITERS))
        settled.step.settle()  # e.g. a checkpoint or an evaluation between iterations
    _same_results(settled_results, plain.train())
    _same_params(settled, plain)
    assert settled.step.num_used == 0 and settled.step.num_launched == NUM_ITERS - 1


def test_determinism_stats_mode_never_steps_before_the_read() -> None:
    config = RerunConfig(rerun_mode="report_determinism_stats")
    ahead, plain = Run(lookahead=True, rerun=config), Run(lookahead=False, rerun=config)
    _same_results(ahead.train(2), plain.train(2))
    assert ahead.step.num_launched == 0 and ahead.calls == 2 * 2 * NUM_MICROBATCHES
    _same_params(ahead, plain)


def test_machine_allows_the_early_step_only_in_the_initial_pass() -> None:
    machine = RerunStateMachine(mode="validate_results")
    data: RerunDataIterator[int] = RerunDataIterator(range(10))
    assert not machine.can_gate_step()  # no iteration started
    assert machine.should_run_forward_backward(data, iteration=0)
    assert machine.can_gate_step()
    machine.validate_result(torch.tensor(1.0), lambda v: False, "host-only check")
    assert not machine.can_gate_step()  # the gate cannot decide a host-evaluated check


def test_a_non_fused_optimizer_steps_after_the_read_and_never_launches() -> None:
    torch.manual_seed(0)
    model = nn.Linear(6, 1)
    step = GuardedStep(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        forward_step=lambda b, m: nn.functional.mse_loss(m(b["x"]), b["y"]),
        machine=RerunConfig().build("cpu"), data=RerunDataIterator(_batches()),
        num_microbatches=NUM_MICROBATCHES,
    )  # fmt: skip
    assert not step.runners.optimizer.gated and not step.lookahead_enabled
    before = [p.detach().clone() for p in model.parameters()]
    for it in range(3):
        assert not step.run(it + 1).verdict.exit
    assert step.num_launched == 0
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_evaluation_settles_and_checks_in_disabled_mode() -> None:
    run = Run(lookahead=True)
    run.step.run(1, launch_next=True)
    assert run.step._lookahead.pending is not None
    losses = run.step.evaluate(iter(_batches()), 2)
    assert run.step._lookahead.pending is None and set(losses) == {"lm loss"}
    bad = [{"x": torch.full((4, 6), float("nan")), "y": torch.zeros(4, 1)}] * 4
    with pytest.raises(RuntimeError, match="NaN"):
        run.step.evaluate(iter(bad), 1)


@pytest.mark.parametrize("lookahead", [True, False])
def test_a_large_gradient_is_detected_rerun_and_trained_on_with_the_clean_gradients(
    tmp_path: Path, lookahead: bool
) -> None:
    """``--check-for-large-grads`` alone (the loss spike check off): forward call 6 (iteration
    4's first micro-batch) scales its loss by 1000, so the iteration's gradient norm is far above
    the window's maximum (2 samples: iterations 1-2). Non-fatal: the pass is rerun (clean, not
    reproducible: transient), training continues with the rerun's gradients, so the parameters
    equal those of a run without the spike, bitwise; the tracker names the check."""
    checks = CheckConfig(nan_and_inf=True, large_grads=True, large_samples=2)
    tracker = tmp_path / "t.txt"
    spiked = Run(lookahead=lookahead, checks=checks, spike_call=6,
                 rerun=RerunConfig(result_rejected_tracker_filename=str(tracker)))  # fmt: skip
    clean = Run(lookahead=lookahead, checks=checks)
    spiked_results, clean_results = spiked.train(), clean.train()
    assert len(spiked_results) == len(clean_results) == NUM_ITERS
    assert all(not r.verdict.exit and not r.skipped for r in spiked_results)
    _same_params(spiked, clean)
    lines = tracker.read_text().splitlines()
    assert [line.split(" status=")[1].split()[0] for line in lines] == [
        "initial_run", "first_rerun_not_reproducible"
    ]  # fmt: skip
    assert all("iteration=4 " in line and "large grads" in line for line in lines), lines
    assert spiked.calls >= clean.calls + NUM_MICROBATCHES  # the rerun pass
