"""``GuardedStep`` wrapping a model that is not the reference GPT: a small CNN on dict batches
without a ``labels`` key. Checked: it trains, the look-ahead is exact, a NaN is caught and
rerun, and a checkpoint through ``Checkpointer`` resumes bitwise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from stalwart.checkpoint import CheckpointManager
from stalwart.loop import Checkpointer, GuardedStep, LoopState, RngState
from stalwart.reliability.rerun import RerunConfig, RerunDataIterator

ITERS = 6


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.drop = nn.Dropout(0.1)  # draws from the RNG: replays must restore it
        self.head = nn.Linear(4 * 8 * 8, 3)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(torch.relu(self.conv(image))).flatten(1))


def _batches(nan_at: int = -1) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(11)
    out = []
    for i in range(2 * ITERS + 2):
        image = torch.randn(5, 1, 8, 8, generator=gen)
        if i == nan_at:
            image[0, 0, 0, 0] = float("nan")
        out.append({"image": image, "target": torch.randint(0, 3, (5,), generator=gen)})
    return out


def forward_step(batch: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    logits = model(batch["image"])
    loss = nn.functional.cross_entropy(logits, batch["target"])
    accuracy = (logits.argmax(-1) == batch["target"]).float().mean()
    return {"loss": loss, "accuracy": accuracy}


class Job:
    def __init__(self, save: Path | None = None, *, lookahead: bool = True, nan_at: int = -1):
        torch.manual_seed(0)
        self.model = SmallCNN()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2, fused=True)
        self.machine = RerunConfig().build("cpu")
        self.data: RerunDataIterator[Any] = RerunDataIterator(_batches(nan_at))
        self.step = GuardedStep(
            model=self.model, optimizer=self.optimizer, forward_step=forward_step,
            machine=self.machine, data=self.data, num_microbatches=2, clip_grad=1.0,
            lookahead=lookahead,
        )  # fmt: skip
        self.state = LoopState()
        self.ckpt = None
        if save is not None:
            self.ckpt = Checkpointer(
                CheckpointManager(str(save)), self.model, self.optimizer,
                common={"step": self.step, "loop": self.state, "data": self.data},
                per_rank={"rng": RngState(self.machine.rng), "rerun": self.machine},
            )  # fmt: skip
            self.ckpt.load()

    def train(self, until: int = ITERS) -> list[Any]:
        if self.state.iteration == 0:
            torch.manual_seed(123)  # the dropout draws start alike in every job
        results = []
        while self.state.iteration < until:
            result = self.step.run(
                self.state.iteration + 1, launch_next=self.state.iteration + 1 < until
            )
            results.append(result)
            if result.verdict.exit:
                break
            self.state.iteration += 1
        return results

    def params(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]


def test_a_cnn_on_dict_batches_trains_and_the_lookahead_is_exact() -> None:
    ahead, plain = Job(lookahead=True), Job(lookahead=False)
    before = ahead.params()
    a, b = ahead.train(), plain.train()
    assert ahead.step.num_used == ITERS - 1
    assert set(a[0].losses) == {"accuracy"}  # the reported values, averaged
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.losses["accuracy"], y.losses["accuracy"])
        assert x.grad_norm is not None and torch.equal(x.grad_norm, y.grad_norm)
    assert all(torch.equal(x, y) for x, y in zip(ahead.params(), plain.params(), strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(before, ahead.params(), strict=True))


def test_a_nan_in_the_data_is_caught_reproduced_and_never_stepped() -> None:
    job = Job(nan_at=6)  # iteration 4's first micro-batch: reproducible, exit 16
    results = job.train()
    assert len(results) == 4 and results[-1].verdict.exit_code == 16
    assert results[-1].verdict.checkpoint
    reference = Job()
    reference.train(3)
    assert all(torch.equal(x, y) for x, y in zip(job.params(), reference.params(), strict=True))


def test_checkpoint_parts_resume_bitwise(tmp_path: Path) -> None:
    first = Job(tmp_path / "ckpt")
    first.train(3)
    assert first.ckpt is not None
    first.ckpt.save(first.state.iteration)  # with the next iteration launched ahead
    resumed = Job(tmp_path / "ckpt")
    assert resumed.state.iteration == 3
    resumed.train()
    uninterrupted = Job()
    uninterrupted.train()
    assert all(
        torch.equal(x, y) for x, y in zip(resumed.params(), uninterrupted.params(), strict=True)
    )
