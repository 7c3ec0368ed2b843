"""The tiny preset's host work per iteration under real CUDA graphs (run on the device machine).

The trainer's iteration micro-batches built at once into one pinned buffer and loaded with one
host-to-device copy, and the reported means computed inside the full-iteration graph, against
the old path (one batch and one copy per tensor, means by host ops): bitwise the same losses and
parameters through warm-up, capture and replays, with fewer host ops per replayed iteration.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import host_overhead  # type: ignore[import-not-found]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_the_same_training_with_less_host_work_under_real_graphs() -> None:
    args = host_overhead._parser().parse_args(["--device", "cuda", "--warmup", "6"])
    runs = {}
    for name in host_overhead.VARIANTS:
        losses: list[dict[str, torch.Tensor]] = []
        variant = host_overhead.build_variant(name, args, losses)
        variant.run(10, losses)  # replays: the graphs compute now
        ops = host_overhead.host_ops(variant, 5)
        params = [p.detach().clone() for p in variant.trainer.model.parameters()]
        runs[name] = ([{k: v.item() for k, v in d.items()} for d in losses], params, ops)
        assert variant.trainer.step.num_launched > 0
        variant.trainer.close()
    (before, p_before, ops_before), (after, p_after, ops_after) = runs["before"], runs["after"]
    assert before == after  # bitwise: every iteration's reported values
    assert all(torch.equal(p, q) for p, q in zip(p_before, p_after, strict=True))
    for name in ("aten::pin_memory", "aten::contiguous", "aten::stack", "aten::mean"):
        assert name not in ops_after["by_name"], (name, ops_after["by_name"])
    assert ops_after["top_ops"] < 0.6 * ops_before["top_ops"], (ops_before, ops_after)
