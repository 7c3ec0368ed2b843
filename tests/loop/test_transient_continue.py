"""``--rerun-transient-policy continue`` under ``GuardedStep``: a transient fault costs one replay.

A forward's loss is made NaN once (a transient fault: the rerun of the same micro-batches and RNG
is clean). Under ``continue`` the rerun's result is applied and the run ends bitwise equal to the
fault-free run: eager and graphed (``GraphPlan`` over the fake graph context), with the
look-ahead on (the fault is in the first micro-batch of an iteration launched ahead: the launch
is dropped on the rejection and the rerun runs the faulty iteration on its own batches). A rerun
that rejects a call of its own exits 17 as Megatron does; a device over its budget exits 17
naming it, with the iteration's start to save.
"""

from __future__ import annotations

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
    RerunDataIterator,
    RerunStateMachine,
)
from stalwart.reliability.rerun.remedies import RemedyConfig, TransientPolicy

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "graphs"))
from graphs_fake_backend import FakeGraphContext  # type: ignore[import-not-found]

MICRO, ITERS = 2, 5


class Job:
    """A linear model whose loss draws RNG noise; the forward calls in ``nan_calls`` (0-based,
    reruns and launches counted) return NaN."""

    def __init__(
        self,
        *,
        lookahead: bool,
        graphed: bool,
        nan_calls: tuple[int, ...] = (),
        policy: TransientPolicy = TransientPolicy.CONTINUE,
        budget: int = 2,
        tracker: str | None = None,
    ) -> None:
        torch.manual_seed(0)
        self.model = nn.Linear(6, 1)
        self.machine = RerunStateMachine(
            mode="validate_results",
            device="cpu",
            remedies=RemedyConfig(policy, budget),
            result_rejected_tracker_filename=tracker,
        )
        gen = torch.Generator().manual_seed(3)
        batches = [
            {"x": torch.randn(4, 6, generator=gen), "y": torch.randn(4, 1, generator=gen)}
            for _ in range(ITERS * MICRO + 4)
        ]
        self.calls, self.nan_calls = 0, nan_calls
        params = list(self.model.parameters())
        plan: EagerPlan | GraphPlan = EagerPlan()
        if graphed:
            optimizer = make_capturable_adamw(
                params, lr=0.05, device=torch.device("cpu"), fused=True
            )
            plan = GraphPlan(
                context=FakeGraphContext(), warmup_steps=10**6, optimizer_warmup_steps=10**6
            )
        else:
            optimizer = torch.optim.AdamW(params, lr=0.05, fused=True)
        self.step = GuardedStep(
            model=self.model,
            optimizer=optimizer,
            forward_step=self._forward,
            machine=self.machine,
            data=RerunDataIterator(batches),
            num_microbatches=MICRO,
            plan=plan,
            clip_grad=1.0,
            lookahead=lookahead,
        )
        if graphed:  # the fake graph never captures: allow the whole-pass launch in warm-up
            self.step._lookahead.ready = lambda: True

    def _forward(self, batch: dict[str, torch.Tensor], model: nn.Module) -> Any:
        noise = 0.01 * torch.randn(batch["y"].shape)
        loss = nn.functional.mse_loss(model(batch["x"]) + noise, batch["y"])
        if self.calls in self.nan_calls:
            loss = loss * float("nan")
        self.calls += 1
        return {"loss": loss, "lm loss": loss.detach()}

    def train(self) -> list[StepResult]:
        torch.manual_seed(123)
        results = []
        for number in range(1, ITERS + 1):
            results.append(self.step.run(number, launch_next=number < ITERS))
            if results[-1].verdict.exit:
                break
        return results

    def params(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]


def _same(a: Job, b: Job) -> None:
    assert all(torch.equal(x, y) for x, y in zip(a.params(), b.params(), strict=True))


@pytest.mark.parametrize(("lookahead", "graphed"), [(False, False), (True, False), (True, True)])
def test_a_transient_fault_costs_one_replay_and_ends_bitwise_equal(
    lookahead: bool, graphed: bool, tmp_path: Path
) -> None:
    clean = Job(lookahead=lookahead, graphed=graphed)
    clean.train()
    # Call 4: iteration 3's first micro-batch (launched ahead during iteration 2 with the
    # look-ahead on: its launch is dropped when the rejection is read).
    faulty = Job(lookahead=lookahead, graphed=graphed, nan_calls=(4,), tracker=str(tmp_path / "t"))
    results = faulty.train()
    assert len(results) == ITERS and not any(r.verdict.exit for r in results)
    _same(faulty, clean)
    replay = MICRO  # the rerun pass
    dropped = 0 if not lookahead else (MICRO if graphed else 1)  # the dropped launch, re-run
    assert faulty.calls == clean.calls + replay + dropped
    statuses = [
        x.split(" status=")[1].split()[0] for x in (tmp_path / "t").read_text().splitlines()
    ]
    assert statuses == ["initial_run", "first_rerun_not_reproducible"]
    assert faulty.machine.remedies.counts == {"/".join(_identity()): 1}


def test_under_exit_the_same_fault_exits_17_without_a_checkpoint() -> None:
    job = Job(lookahead=True, graphed=False, nan_calls=(4,), policy=TransientPolicy.EXIT)
    last = job.train()[-1].verdict
    assert (last.exit_code, last.checkpoint) == (EXIT_CODE_FAILED_ON_RESULT_VALIDATION, False)
    assert job.machine.remedies.counts == {}  # exit counts nothing


def test_a_rerun_that_rejects_a_call_of_its_own_exits_17_as_megatron() -> None:
    # Call 4 (iteration 3, first micro-batch) in the initial pass, call 7 (its second
    # micro-batch) in the rerun: the faulty call is not reproduced, but the rerun is not clean.
    job = Job(lookahead=False, graphed=False, nan_calls=(4, 7))
    results = job.train()
    assert len(results) == 3
    assert results[-1].verdict.exit_code == EXIT_CODE_FAILED_ON_RESULT_VALIDATION
    assert not results[-1].verdict.checkpoint


def test_a_device_over_its_budget_exits_17_naming_it_and_saves_the_iteration_start() -> None:
    # Budget 1: the transient at iteration 2 goes on, the one at iteration 4 is one too many.
    clean = Job(lookahead=False, graphed=False, policy=TransientPolicy.EXIT)
    job = Job(lookahead=False, graphed=False, nan_calls=(2, 8), budget=1)
    results = job.train()
    assert len(results) == 4 and not results[1].verdict.exit
    verdict = results[-1].verdict
    assert (verdict.exit_code, verdict.checkpoint) == (EXIT_CODE_FAILED_ON_RESULT_VALIDATION, True)
    diagnosis = verdict.diagnosis
    assert diagnosis is not None and diagnosis.diagnosis == "repeated_transient_errors"
    assert [s.identity for s in diagnosis.suspects] == [_identity()]
    assert diagnosis.source.value == "transient_budget" and diagnosis.checkpoint_iteration == 3
    # Iterations 1-3 trained (the transient at 2 with its rerun's result), 4 not stepped.
    torch.manual_seed(123)
    for number in range(1, 4):
        clean.step.run(number, launch_next=False)
    _same(job, clean)


def test_the_counts_are_checkpointed_and_merged_by_device() -> None:
    job = Job(lookahead=False, graphed=False, nan_calls=(2,))
    job.train()
    state = job.machine.state_dict()
    fresh = Job(lookahead=False, graphed=False)
    fresh.machine.remedies.counts = {"other/dev": 5, "/".join(_identity()): 3}
    fresh.machine.load_state_dict(state)
    # The highest count of each device wins (a rewind to an older checkpoint forgets none).
    assert fresh.machine.remedies.counts == {"other/dev": 5, "/".join(_identity()): 3}
    newer = Job(lookahead=False, graphed=False)
    newer.machine.load_state_dict(state)
    assert newer.machine.remedies.counts == {"/".join(_identity()): 1}


def _identity() -> tuple[str, str]:
    from stalwart.reliability.rerun import device_identity

    return device_identity()
