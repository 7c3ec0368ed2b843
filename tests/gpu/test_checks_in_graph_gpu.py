"""On the device: the spiky-loss and large-gradient checks inside a captured full-iteration graph.

The forward scales its loss by 1000 at one micro-batch, chosen by a device counter the captured
graph itself advances (``calls``) against a device target set between iterations, so the spike
happens inside a *replay* (no Python runs there), after the graph and the optimizer graph were
captured. Each check alone (``--check-for-spiky-loss``; ``--check-for-large-grads``): the device
check rejects the pass, the gated optimizer replay skips itself on the device, the rerun (a clean
replay: the counter moved on) is not reproducible, so the verdict is a transient, non-fatal one
and training continues with the rerun's gradients. The parameters and the optimizer's step
counters then equal, bitwise, those of the same run without the spike: the spiked pass's update
never happened.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from gpu_only import GPU_ONLY
from stalwart.graphs import make_capturable_adamw
from stalwart.loop import GraphPlan, GuardedStep
from stalwart.reliability.rerun import CheckConfig, RerunDataIterator, RerunStateMachine

pytestmark = GPU_ONLY

NUM_MICROBATCHES = 2
ITERS = 9
SPIKE_IT = 6  # 0-based: logged iteration 7, after warm-up (2) and capture (iteration 3)
CHECKS = {
    "spiky_loss": (CheckConfig(nan_and_inf=True, spiky_loss=True, large_samples=4), "Spiky loss"),
    "large_grads": (
        CheckConfig(nan_and_inf=True, large_grads=True, large_samples=2),
        "large grads",
    ),
}


def _run(check: str, spike: bool, tracker: Path, lookahead: bool) -> dict[str, Any]:
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = nn.Linear(16, 1).to(device)
    params = list(model.parameters())
    optimizer = make_capturable_adamw(params, lr=1e-2, device=device, fused=True)
    calls = torch.zeros((), device=device, dtype=torch.int64)  # forwards executed (device)
    target = torch.full((), -1, device=device, dtype=torch.int64)  # the forward that spikes

    def forward(batch: dict[str, torch.Tensor], m: nn.Module) -> dict[str, torch.Tensor]:
        calls.add_(1)
        factor = 1.0 + 999.0 * (calls == target).float()  # captured: read on every replay
        loss = nn.functional.mse_loss(m(batch["x"]), batch["y"]) * factor
        return {"loss": loss, "lm loss": loss.detach()}

    machine = RerunStateMachine(
        mode="validate_results", checks=CHECKS[check][0], device=device,
        result_rejected_tracker_filename=str(tracker),
    )  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    batches = [{"x": torch.randn(4, 16, generator=gen).to(device),
                "y": torch.randn(4, 1, generator=gen).to(device)}
               for _ in range(NUM_MICROBATCHES * (ITERS + 2))]  # fmt: skip
    step = GuardedStep(
        model=model, optimizer=optimizer, forward_step=forward, machine=machine,
        data=RerunDataIterator(batches), num_microbatches=NUM_MICROBATCHES,
        plan=GraphPlan(warmup_steps=2, optimizer_warmup_steps=2), clip_grad=1.0,
        lookahead=lookahead,
    )  # fmt: skip
    results, captured = [], False
    for it in range(ITERS):
        if it == SPIKE_IT:
            step.settle()  # a launched pass would already have run this iteration's forwards
            captured = step.runners.lookahead_ready()  # the full-iteration graph is captured
            if spike:
                target.fill_(int(calls.item()) + 1)  # its first micro-batch, first pass
        results.append(step.run(it + 1, launch_next=it + 1 < ITERS))
    torch.cuda.synchronize()
    out = {
        "params": [p.detach().clone() for p in params],
        "steps": [float(optimizer.state[p]["step"]) for p in params],
        "results": results,
        "captured": captured,
    }
    step.close()
    return out


@pytest.mark.parametrize("lookahead", [True, False], ids=["lookahead", "no-lookahead"])
@pytest.mark.parametrize("check", sorted(CHECKS))
def test_a_spike_in_a_replayed_graph_is_rerun_and_its_update_skipped(
    tmp_path: Path, check: str, lookahead: bool
) -> None:
    spiked = _run(check, True, tmp_path / "spiked.txt", lookahead)
    clean = _run(check, False, tmp_path / "clean.txt", lookahead)
    assert spiked["captured"], "the spike must happen in a replay of the captured graph"
    assert all(not r.verdict.exit and not r.skipped for r in spiked["results"])
    lines = (tmp_path / "spiked.txt").read_text().splitlines()
    assert [line.split(" status=")[1].split()[0] for line in lines] == [
        "initial_run", "first_rerun_not_reproducible"
    ], lines  # fmt: skip
    assert all(f"iteration={SPIKE_IT + 1} " in ln and CHECKS[check][1] in ln for ln in lines)
    assert not (tmp_path / "clean.txt").exists() or not (tmp_path / "clean.txt").read_text()
    for a, b in zip(spiked["params"], clean["params"], strict=True):
        assert torch.equal(a, b)  # the spiked pass's gated replay skipped itself on the device
    assert spiked["steps"] == clean["steps"] == [float(ITERS)] * len(spiked["steps"])
