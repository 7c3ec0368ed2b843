"""Pieces the loop tests share: a tiny GPT's token batches, a plan for each optimizer path (the
graphs on the fake backend, in eager warm-up forever: the very functions a capture records),
and a counter of the aten ops that reach the dispatcher."""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from stalwart.loop import EagerPlan, GraphPlan
from stalwart.models import GPTConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "graphs"))
from graphs_fake_backend import FakeGraphContext  # type: ignore[import-not-found]

EAGER_FOREVER = 10**6
CFG = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=2, seq_length=16, vocab_size=64)
OPTIMIZER_PATHS = ["eager", "optimizer_graph", "optimizer_in_graph"]


def token_batches(n: int, cfg: GPTConfig = CFG) -> list[dict[str, torch.Tensor]]:
    """``n`` batches of 2 random sequences (seed 5): ``ids`` and next-token ``labels``."""
    gen = torch.Generator().manual_seed(5)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1), generator=gen)
        out.append({"ids": tokens[:, :-1], "labels": tokens[:, 1:]})
    return out


def optimizer_plan(path: str) -> EagerPlan | GraphPlan:
    """The plan of one of :data:`OPTIMIZER_PATHS`: the eager gated step, the optimizer graph's
    body, the step inside the full-iteration graph."""
    if path == "eager":
        return EagerPlan()
    if path == "optimizer_graph":
        return GraphPlan(full_iteration=False, context=FakeGraphContext(),
                         optimizer_warmup_steps=EAGER_FOREVER)  # fmt: skip
    return GraphPlan(context=FakeGraphContext(), warmup_steps=EAGER_FOREVER,
                     optimizer_in_graph=True)  # fmt: skip


class OpCount(TorchDispatchMode):
    """Counts every aten op dispatched inside the ``with`` block, by overload packet name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))
