"""The host's work per iteration of the graphed guarded step at tiny (issue 19, tiny >= 3x).

On the H200 the graphed trainer at tiny is host-bound: the device waited for the host to build
the next iteration's batches (slice, contiguous, pin per tensor, one copy each into the static
inputs) and to average the reported values (stack, mean per iteration). With the fake graph
backend (a replay runs nothing) every host op left per iteration is outside the graphs: this pins
that the trainer now builds an iteration's micro-batches at once, loads them with one copy and
takes the means computed inside the graph, with the same results (``bench/host_overhead.py``
measures the time).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from stalwart.loop import PassValues, average_reported, with_means

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import host_overhead  # type: ignore[import-not-found]

WARMUP = 4  # 3 eager warm-up iterations, then the capture (the fake runs its body once)


def _args() -> argparse.Namespace:
    return host_overhead._parser().parse_args(
        ["--micro-batch-size", "4", "--warmup", str(WARMUP), "--profile-iters", "3"]
    )


@pytest.fixture(scope="module")
def variants() -> Any:
    args = _args()
    built: dict[str, tuple[Any, list[dict[str, torch.Tensor]]]] = {}
    for name in host_overhead.VARIANTS:
        losses: list[dict[str, torch.Tensor]] = []
        built[name] = (host_overhead.build_variant(name, args, losses), losses)
    yield built, args
    for variant, _ in built.values():
        variant.trainer.close()


def test_the_same_losses_and_parameters_before_and_after(variants: Any) -> None:
    built, _ = variants
    (before, before_losses), (after, after_losses) = built["before"], built["after"]
    assert len(before_losses) == len(after_losses) == WARMUP
    for a, b in zip(before_losses, after_losses, strict=True):
        assert a.keys() == b.keys()
        for key in a:  # bitwise: the same micro-batches, the same means
            assert torch.equal(a[key], b[key]), key
    for p, q in zip(before.trainer.model.parameters(), after.trainer.model.parameters()):
        assert torch.equal(p, q)
    # The trainer's sampler built each iteration's micro-batches as views of one buffer.
    assert after.trainer.sampler.chunk_microbatches == 4
    assert before.trainer.sampler.chunk_microbatches == 1


def test_fewer_host_ops_per_iteration_once_captured(variants: Any) -> None:
    built, args = variants
    before = host_overhead.host_ops(built["before"][0], args.profile_iters)
    after = host_overhead.host_ops(built["after"][0], args.profile_iters)
    for name in ("aten::contiguous", "aten::lift_fresh", "aten::stack", "aten::mean"):
        assert before["by_name"].get(name, 0) > 0, name  # the measure sees the old work
        assert name not in after["by_name"], (name, after["by_name"])
    # One copy into the static inputs (the CPU fake: one foreach copy before; a device copies
    # each of the 8 tensors), the batches built with no torch op per slice.
    assert after["by_name"].get("aten::copy_", 0) == 1
    assert "aten::_foreach_copy_" not in after["by_name"]
    assert after["top_ops"] < 0.6 * before["top_ops"], (before["top_ops"], after["top_ops"])
    assert after["all_ops"] < before["all_ops"] / 2, (before["all_ops"], after["all_ops"])


def test_means_computed_in_the_pass_are_the_host_means() -> None:
    gen = torch.Generator().manual_seed(0)
    reported = [
        {"loss": torch.rand((), generator=gen), "lm loss": torch.rand((), generator=gen),
         "aux": torch.rand((), generator=gen, dtype=torch.float64)}
        for _ in range(5)
    ]  # fmt: skip
    passed = with_means(lambda **_: reported)(data_iterator=None, num_microbatches=5)
    assert isinstance(passed, PassValues) and list(passed) == reported
    fast, plain = average_reported(passed), average_reported(list(reported))
    assert fast.keys() == plain.keys() == {"lm loss", "aux"}
    assert all(torch.equal(fast[k], plain[k]) for k in plain)
    passed.means.zero_()  # the graph's next replay: the values returned were copies
    assert all(torch.equal(fast[k], plain[k]) for k in plain)
    only_loss = [{"loss": r["loss"]} for r in reported]
    assert torch.equal(average_reported(with_means(lambda **_: only_loss)())["loss"],
                       torch.stack([r["loss"] for r in reported]).mean())  # fmt: skip
