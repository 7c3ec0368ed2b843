"""The shell books an iteration that compiled as goodput's compile time on every path, not only
in the reference trainer: a hand-written loop and Lightning with a ``torch.compile``d model
(the eager backend: Dynamo traces, no C compiler needed) book their first iteration as
``compile`` (cold: nothing came from a cache), the next ones as productive."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from stalwart.loop import ShellConfig
from stalwart.reliability.rerun import RerunDataIterator

ITERS = 3


def _spans(run: Path) -> list[tuple[str, int, str | None]]:
    records = [json.loads(x) for x in (run / "goodput.jsonl").read_text().splitlines()]
    return [(r["b"], r.get("it", 0), r.get("src")) for r in records if r.get("k") == "span"]


def _model() -> Any:
    torch._dynamo.reset()  # another test's compiled code of these classes would be reused
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def test_a_loop_books_its_compiling_iteration_as_compile(tmp_path: Path) -> None:
    model = _model()
    compiled = torch.compile(model, backend="eager")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    data = RerunDataIterator(iter([torch.randn(4, 4) for _ in range(ITERS)]))
    with ShellConfig(train_iters=ITERS, save_dir=str(tmp_path)).build() as shell:
        step = shell.step(compiled, optimizer, lambda b, m: m(b).square().mean(), data)
        shell.start()
        for _ in range(ITERS):
            with shell.iteration() as it:
                result = step.run(it, launch_next=False)
            shell.record(result, batch_size=4)
            decision = shell.decide(result)
        shell.finish(decision)
    spans = _spans(tmp_path)
    assert ("compile", 1, "cold") in spans, spans
    assert [s for s in spans if s[0] == "compile" and s[2] == "cold"] == [("compile", 1, "cold")]


def test_lightning_books_its_compiling_iteration_as_compile(tmp_path: Path) -> None:
    L = pytest.importorskip("lightning.pytorch")
    from stalwart.integrations.lightning import GuardedModule, StalwartCallback

    class Compiled(GuardedModule, L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _model()
            self.compiled = torch.compile(self.model, backend="eager")

        def forward_step(self, batch: torch.Tensor) -> torch.Tensor:
            return self.compiled(batch).square().mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.model.parameters(), lr=1e-2)

    trainer = L.Trainer(
        max_steps=ITERS,
        accelerator="cpu",
        devices=1,
        callbacks=[StalwartCallback(str(tmp_path))],
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Compiled(), torch.utils.data.DataLoader(torch.randn(12, 4), batch_size=4))
    assert ("compile", 1, "cold") in _spans(tmp_path), _spans(tmp_path)
