"""Clipping inside the fused AdamW step (``--clip-grad-in-optimizer``, issue 19) on CPU.

``clip_in_optimizer_step`` puts ``1 / clip_coefficient`` into fused AdamW's ``grad_scale``
(the kernel divides each gradient by it as it reads it) instead of a separate multiply over all
gradients. A tiny GPT trains under ``GuardedStep`` with and without it on every optimizer path
(eager gated step, the optimizer graph's body, the step inside the full-iteration graph; the
graphs on the fake backend, in eager warm-up: the very functions a capture records), same seed
and data, and the runs are compared:

* the logged gradient norms: bitwise equal in the first iteration (same gradients), within
  1e-3 relative after it;
* parameters within 2e-6 absolute after one step with clipping active (``g / (1 / c)`` and
  ``g * c`` differ by float32 rounding); after 3 steps, the updates within 5% of their norm
  (Adam turns a rounding difference in a near-zero gradient into a step of about lr);
  bitwise when the norm stays under ``--clip-grad`` (the scale is exactly 1.0);
* a step the device rejects (NaN loss, ``found_inf``) leaves everything untouched with the
  scale installed too.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from stalwart.cli.args import parse_train_args
from stalwart.config.run import build_run_config
from stalwart.graphs import clip_in_optimizer_step, clip_scale_of, make_capturable_adamw
from stalwart.loop import GuardedStep
from stalwart.models import GPT
from stalwart.reliability.rerun import RerunConfig, RerunDataIterator

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "graphs"))
from poisoned_forward import PoisonedForward  # type: ignore[import-not-found]
from tiny_jobs import CFG, OPTIMIZER_PATHS, optimizer_plan, token_batches  # type: ignore[import-not-found]

ITERS, MICRO = 3, 2


class Job:
    def __init__(self, path: str, *, fused_clip: bool, clip: float = 0.5, nan_call: int = -1):
        torch.manual_seed(0)
        self.model = GPT(CFG)
        self.optimizer = make_capturable_adamw(
            list(self.model.parameters()), lr=1e-2, device=torch.device("cpu"), fused=True
        )
        if fused_clip:
            clip_in_optimizer_step(self.optimizer)
        self.forward = PoisonedForward(nan_call)
        self.step = GuardedStep(
            model=self.model, optimizer=self.optimizer, forward_step=self.forward,
            machine=RerunConfig().build("cpu"), data=RerunDataIterator(token_batches(4 * ITERS * MICRO)),
            num_microbatches=MICRO, plan=optimizer_plan(path), clip_grad=clip, lookahead=False,
            autocast=lambda: torch.autocast("cpu", dtype=torch.bfloat16),
        )  # fmt: skip

    def train(self, iters: int = ITERS) -> list[Any]:
        results = []
        for it in range(iters):
            results.append(self.step.run(it + 1, launch_next=False))
            if results[-1].verdict.exit:
                break
        return results

    def params(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]


PATHS = OPTIMIZER_PATHS


def _norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in tensors]))


@pytest.mark.parametrize("path", PATHS)
def test_clip_in_step_matches_the_separate_clip(path: str) -> None:
    # One step from the same state: the two clips differ by float32 rounding alone.
    separate, fused = Job(path, fused_clip=False), Job(path, fused_clip=True)
    a, b = separate.train(1), fused.train(1)
    assert float(a[0].grad_norm) > 0.5  # clipping really happened
    assert torch.equal(a[0].grad_norm, b[0].grad_norm)
    for x, y in zip(separate.params(), fused.params(), strict=True):
        torch.testing.assert_close(y, x, rtol=0, atol=2e-6)
    # Over several steps the runs drift apart chaotically, not by a bound on rounding: Adam's
    # step for an element whose gradient is near zero is about +-lr whatever its size, so a
    # rounding difference that flips such a gradient's sign moves that element by ~lr (seen: one
    # element 9e-3 apart after 2 steps at lr 1e-2 on a CPU whose bf16 matmuls use AMX, where an
    # element-wise 2e-6 bound had held on another CPU). The runs are compared as whole updates.
    start = Job(path, fused_clip=False).params()
    separate, fused = Job(path, fused_clip=False), Job(path, fused_clip=True)
    a, b = separate.train(), fused.train()
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(y.losses["lm loss"], x.losses["lm loss"], rtol=1e-5, atol=0)
        torch.testing.assert_close(y.grad_norm, x.grad_norm, rtol=1e-3, atol=0)
    moved = [p - p0 for p, p0 in zip(separate.params(), start, strict=True)]
    apart = [q - p for p, q in zip(separate.params(), fused.params(), strict=True)]
    assert float(_norm(apart) / _norm(moved)) < 5e-2
    scale = clip_scale_of(fused.optimizer)
    assert scale is not None and float(scale) > 1.0  # the last step divided by it


@pytest.mark.parametrize("path", PATHS)
def test_clip_in_step_is_bitwise_when_nothing_is_clipped(path: str) -> None:
    separate, fused = Job(path, fused_clip=False, clip=1e6), Job(path, fused_clip=True, clip=1e6)
    a, b = separate.train(), fused.train()
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.grad_norm, y.grad_norm)
    for x, y in zip(separate.params(), fused.params(), strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("path", ["eager", "optimizer_in_graph"])
def test_a_rejected_step_touches_nothing_with_the_scale(path: str) -> None:
    """Iteration 2's first forward is NaN: the gated step (found_inf) skips on the device, the
    rerun is clean and the job exits; the parameters are those after iteration 1."""
    rejected = Job(path, fused_clip=True, nan_call=2 * MICRO)
    results = rejected.train()
    assert results[-1].verdict.exit
    clean = Job(path, fused_clip=True)
    clean.train(iters=2)
    for x, y in zip(rejected.params(), clean.params(), strict=True):
        assert torch.equal(x, y)


def test_clip_in_optimizer_step_needs_fused_adamw() -> None:
    p = nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match="needs fused Adam/AdamW"):
        clip_in_optimizer_step(torch.optim.AdamW([p], lr=0.1, foreach=True))
    with pytest.raises(ValueError, match="needs fused Adam/AdamW"):
        clip_in_optimizer_step(torch.optim.SGD([p], lr=0.1))
    plain = torch.optim.AdamW([p], lr=0.1, fused=True)
    assert clip_scale_of(plain) is None


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--clip-grad", "0"], "--clip-grad-in-optimizer needs --clip-grad > 0"),
        (["--use-torch-fsdp2"], "--clip-grad-in-optimizer is not supported with --use-torch"),
    ],
)
def test_the_flag_refuses_what_it_cannot_fuse(flags: list[str], needle: str) -> None:
    argv = ["--preset", "tiny", "--clip-grad-in-optimizer", *flags]
    with pytest.raises(ValueError, match="^" + needle):
        build_run_config(parse_train_args(argv), argv)


def test_the_trainer_installs_the_scale() -> None:
    from stalwart.train import build

    argv = ["--preset", "tiny", "--use-cpu", "--clip-grad-in-optimizer"]
    config = build_run_config(parse_train_args(argv), argv)
    optimizer = build.build_optimizer(GPT(CFG), config)
    assert clip_scale_of(optimizer) is not None
    argv = ["--preset", "tiny", "--use-cpu"]
    plain = build.build_optimizer(GPT(CFG), build_run_config(parse_train_args(argv), argv))
    assert clip_scale_of(plain) is None


# ---------------------------------------------------------------- --inductor-config (issue 19)
@pytest.mark.parametrize(
    ("items", "needle"),
    [
        (["triton.mix_order_reduction"], "--inductor-config takes KEY=VALUE"),
        (["no_such_option=1"], "--inductor-config no_such_option: not an Inductor option"),
        (["triton.mix_order_reduction=__import__('os')"], "must be a Python literal"),
        (["triton.mix_order_reduction=1"], "Inductor's option is a bool"),
        (["triton.mix_order_reduction=[1]"], "only bool, int, float, str or None"),
        (["triton.cudagraphs=True"], "set by stalwart itself"),
        (["max_autotune=True", "max_autotune=False"], "given twice"),
    ],
)
def test_inductor_config_refuses_bad_input(items: list[str], needle: str) -> None:
    argv = ["--preset", "tiny", "--compile"]
    for item in items:
        argv += ["--inductor-config", item]
    with pytest.raises(ValueError, match=needle):
        build_run_config(parse_train_args(argv), argv)


def test_inductor_config_needs_compile() -> None:
    argv = ["--preset", "tiny", "--inductor-config", "triton.mix_order_reduction=False"]
    with pytest.raises(ValueError, match=r"^--inductor-config needs --compile"):
        build_run_config(parse_train_args(argv), argv)


def test_inductor_config_reaches_the_model_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    from stalwart.distributed.process_group import DistributedContext
    from stalwart.reliability.faults import NullFaultInjector
    from stalwart.train import build

    seen: list[dict[str, Any]] = []
    monkeypatch.setattr(GPT, "compile", lambda self, **kw: seen.append(kw))
    argv = ["--preset", "tiny", "--use-cpu", "--compile",
            "--inductor-config", "triton.mix_order_reduction=False",
            "--inductor-config", "triton.mix_order_reduction_split_size=64"]  # fmt: skip
    config = build_run_config(parse_train_args(argv), argv)
    build.build_model(config, DistributedContext(), NullFaultInjector())
    assert seen == [{"dynamic": False, "options": {
        "triton.mix_order_reduction": False, "triton.mix_order_reduction_split_size": 64}}]  # fmt: skip
