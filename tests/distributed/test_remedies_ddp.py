"""The rerun machine's remedies on 2 gloo ranks with DDP, through the shell (a hand-written loop).

* A spike in rank 1's data at iteration 6: the in-place rerun reproduces it, the peer replay on
  rank 0 reproduces it too (the data, not the hardware), so the job rewinds to its checkpoint of
  iteration 3 on both ranks, trains 4-5 again and skips 6: it ends bitwise equal to the same job
  with ``iterations_to_skip=[6]``.
* A transient fault on rank 1 at iteration 4 under ``rerun_transient_policy="continue"``: the
  job goes on with the rerun's result and ends bitwise equal to the fault-free job.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from stalwart.checkpoint import CheckpointManager
from stalwart.loop import ShellConfig
from stalwart.reliability.exit import ExitConfig
from stalwart.reliability.rerun import RerunConfig, RerunDataIterator

from dist_utils import run_distributed

pytestmark = pytest.mark.distributed

ITERS, MICRO, SPIKE = 8, 2, 6


def _job(rank: int, world_size: int, root: str, scenario: str) -> dict[str, Any]:
    save = Path(root) / scenario
    save.mkdir(exist_ok=True)  # the tracker file is there
    flags: dict[str, Any] = {"result_rejected_tracker_filename": str(save / "tracker.txt")}
    if scenario in ("rewind", "skip"):
        flags.update(check_for_nan_in_loss_and_grad=False, check_for_spiky_loss=True)
    if scenario == "rewind":
        flags.update(rewind_on_spike=True)
    if scenario == "skip":
        flags.update(iterations_to_skip=[SPIKE])
    if scenario == "transient":
        flags.update(
            error_injection_rate=1,
            error_injection_type="transient_error",
            error_injection_iterations=[4],
            error_injection_ranks=[1],
            rerun_transient_policy="continue",
        )
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    gen = torch.Generator().manual_seed(rank)
    batches = [
        (torch.randn(4, 8, generator=gen), torch.randn(4, 1, generator=gen))
        for _ in range(ITERS * MICRO)
    ]
    if rank == 1 and scenario in ("rewind", "skip"):  # rank 1's data spikes at iteration 6
        x, y = batches[(SPIKE - 1) * MICRO]
        batches[(SPIKE - 1) * MICRO] = (x, 1000.0 * y)
    printed: list[str] = []
    config = ShellConfig(
        train_iters=ITERS,
        save_dir=str(save),
        rerun=RerunConfig(**flags),
        exit=ExitConfig(save_interval=3),
    )
    with config.build(rank=rank, world_size=world_size, print_fn=printed.append) as shell:
        # Sample the loss's max over 2 iterations, not Megatron's 100.
        shell.machine.recorder.checks = dataclasses.replace(
            shell.machine.recorder.checks, large_samples=4
        )
        data = RerunDataIterator(batches)
        step = shell.step(model, optimizer, _forward, data, num_microbatches=MICRO)
        ckpt = shell.checkpointer(CheckpointManager(str(save)), model, optimizer, data=data)
        torch.manual_seed(100 + rank)
        shell.start(ckpt)
        while True:
            with shell.iteration() as it:
                result = step.run(it)
            shell.record(result, batch_size=8 * MICRO)
            if shell.act(shell.decide(result), ckpt) is not None:
                break
        ckpt.close()
    return {
        "params": [p.detach().tolist() for p in model.parameters()],
        "printed": [p for p in printed if p.startswith(("spike rewind", "skipping"))],
    }


def _forward(batch: tuple[torch.Tensor, torch.Tensor], model: nn.Module) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch[0]) + 0.01 * torch.randn(4, 1), batch[1])


def _scenarios(rank: int, world_size: int, root: str) -> dict[str, Any]:
    names = ("rewind", "skip", "transient", "clean")
    return {name: _job(rank, world_size, root, name) for name in names}


def test_a_spike_attributed_by_the_peer_rewinds_and_a_transient_continues(tmp_path: Path) -> None:
    results = run_distributed(_scenarios, world_size=2, args=(str(tmp_path),))
    for rank, r in enumerate(results):
        assert r["rewind"]["params"] == r["skip"]["params"], rank
        assert r["transient"]["params"] == r["clean"]["params"], rank
        assert r["rewind"]["params"] != r["clean"]["params"], rank
    (line, skip) = results[0]["rewind"]["printed"]
    assert "at iteration 6 reproduced (peer replay)" in line
    assert "iter_0000003 (3 iterations); skipping iteration 6" in line
    assert skip == "skipping iteration 6 (spike rewind)"
    tracker = (tmp_path / "transient" / "tracker.txt").read_text()
    assert "rank=1 iteration=4 status=first_rerun_not_reproducible" in tracker
