"""A Llama model with recompute through the full-iteration graph's state machine (CPU fake backend).

The fake context runs the captured body once, like real capture runs Python once; the GPU tests
(tests/gpu/test_graphs.py, llama-tiny cases) replay it for real.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from stalwart.graphs import FullIterationGraph, StagePhase
from stalwart.models import GPT, preset_model_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "graphs"))
from graphs_fake_backend import FakeGraphContext  # type: ignore[import-not-found]

SHAPES = {"num_layers": 2, "seq_length": 32, "vocab_size": 512}


def _forward_backward(
    *, data_iterator: Iterator[dict[str, torch.Tensor]], num_microbatches: int, model: GPT, **_: Any
) -> list[dict[str, torch.Tensor]]:
    losses = []
    for _ in range(num_microbatches):
        batch = next(data_iterator)
        out = model(batch["input_ids"], batch["labels"])
        assert isinstance(out, dict)
        (out["loss"] / num_microbatches).backward()
        losses.append({"lm loss": out["lm loss"]})
    return losses


def _batches(n: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    tokens = [torch.randint(0, 512, (2, 33), generator=gen) for _ in range(n)]
    return [{"input_ids": t[:, :-1], "labels": t[:, 1:]} for t in tokens]


@pytest.mark.parametrize(
    "recompute",
    [
        {},
        {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1},
        {"recompute_granularity": "selective"},
    ],
)
def test_llama_with_recompute_warms_up_captures_and_keeps_grad_addresses(
    recompute: dict[str, Any],
) -> None:
    torch.manual_seed(0)
    model = GPT(preset_model_config("llama-tiny", **SHAPES, **recompute))
    torch.manual_seed(0)
    eager = GPT(preset_model_config("llama-tiny", **SHAPES))
    params = list(model.parameters())
    graph = FullIterationGraph(
        _forward_backward, context=FakeGraphContext(), warmup_steps=2, grad_params=params
    )
    batches = _batches(2)
    addresses = None
    for step in range(3):  # two warm-ups, then the capture
        graph(data_iterator=iter(batches), num_microbatches=2, model=model)
        current = [p.grad.data_ptr() for p in params if p.grad is not None]
        assert len(current) == len(params)
        addresses = addresses or current
        assert current == addresses, f"a .grad tensor was replaced at call {step}"
    assert graph.phase() is StagePhase.CAPTURED
    # The graph zeroed the grads in place before the captured pass: they are one pass's grads.
    _forward_backward(data_iterator=iter(batches), num_microbatches=2, model=eager)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert p.grad is not None and q.grad is not None
        assert torch.equal(p.grad, q.grad), name
