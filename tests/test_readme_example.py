"""The hand-written-loop example in README.md runs as written (with a toy model and data)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def test_readme_loop_example_trains() -> None:
    (block,) = _python_blocks()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    saved: list[int] = []
    namespace = {
        "model": lambda x: model(x).pow(2),
        "opt": torch.optim.SGD(model.parameters(), lr=0.1),
        "my_batches": [torch.randn(8, 4) for _ in range(20)],
        "n": 20,
        "bs": 8,
        "lr": 0.1,
        "save_my_checkpoint": saved.append,
    }
    before = model.weight.detach().clone()
    exec(compile(block, str(README), "exec"), namespace)
    assert not torch.equal(before, model.weight)  # it trained
    assert namespace["sm"].get_mode().value == "validate_results"
    assert saved == []  # no fault, no rerun checkpoint
