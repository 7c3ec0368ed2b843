"""A tiny training loop that follows the rerun protocol (shared by the rerun tests).

No tests here; the module is imported by test_rerun_*.py (also from spawned gloo ranks).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from stalwart.reliability.rerun import (
    RerunConfig,
    RerunDataIterator,
    RerunErrorInjector,
    RerunStateMachine,
)
from stalwart.reliability.rerun.checks.grads import local_grad_norm
from stalwart.reliability.rerun.checks.rules import grad_checks, loss_checks
from stalwart.rng_state import capture_rng_state, restore_rng_state

MICRO = 2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.2)  # consumes the torch CPU RNG: replay must restore it
        self.lin = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.drop(x))


def make_batches(
    n_iters: int, seed: int = 0, nan_at: Collection[int] = (), spike_at: Collection[int] = ()
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for it in range(n_iters):
        for m in range(MICRO):
            x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
            if it in nan_at and m == 0:
                x[0, 0] = float("nan")
            if it in spike_at and m == 0:
                y = y * 1000.0
            out.append((x, y))
    return out


class SyncCounter:
    """Counts tensor -> host reads (tolist/item/bool/float/int) while active."""

    NAMES = ("tolist", "item", "__bool__", "__float__", "__int__")

    def __init__(self, monkeypatch: Any) -> None:
        self.count = 0
        self.active = True
        for name in self.NAMES:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._wrap(original))

    def _wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self.active:
                self.count += 1
            return original(t, *args, **kwargs)

        return wrapper

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self.active = False
        try:
            yield
        finally:
            self.active = True


@dataclass
class Outcome:
    code: int
    checkpoint: dict[str, Any] | None
    iteration: int
    passes: int
    model: Net


LossCheck = Callable[[RerunStateMachine, torch.Tensor, RerunConfig], None]


def check_loss(sm: RerunStateMachine, loss: torch.Tensor, config: RerunConfig) -> None:
    """The default loss check: ``config``'s loss checks, recorded by the machine's recorder."""
    sm.recorder.check_all_on_device(loss, (loss_checks(config.checks),))


def train(
    sm: RerunStateMachine,
    model: Net,
    opt: torch.optim.Optimizer,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    config: RerunConfig,
    *,
    start: int = 0,
    stop: int = 5,
    skip: Collection[int] = (),  # numbered from 1 like the tracker file and the log
    loss_check: LossCheck = check_loss,
    grad_check: bool = True,
    counter: SyncCounter | None = None,
    ddp: nn.Module | None = None,
) -> Outcome:
    """Iterations ``start..stop-1``; returns on the machine's exit request like the trainer would."""
    data = RerunDataIterator(batches[start * MICRO :])
    fwd = ddp if ddp is not None else model
    passes = 0
    for it in range(start, stop):
        if it + 1 in skip:
            for _ in range(MICRO):
                next(data)
            continue
        while sm.should_run_forward_backward(data, iteration=it):
            passes += 1
            opt.zero_grad(set_to_none=True)
            for _ in range(MICRO):
                x, y = next(data)
                loss = F.mse_loss(fwd(x), y)
                loss_check(sm, loss, config)
                (loss / MICRO).backward()
            if grad_check and ddp is None and config.checks.grads:  # config's gradient checks
                norm = local_grad_norm(model.parameters())
                sm.recorder.check_all_on_device(norm, (grad_checks(config.checks, None),))
        should_ckpt, should_exit, code = sm.should_checkpoint_and_exit()
        if should_exit:
            saved = None
            if should_ckpt:
                saved = {
                    "iteration": it,  # the failed iteration: the loader restarts there
                    "model": copy.deepcopy(model.state_dict()),
                    "optim": copy.deepcopy(opt.state_dict()),
                    "rng": capture_rng_state(),
                    "rerun": sm.state_dict(),
                }
            return Outcome(code, saved, it, passes, model)
        with counter.paused() if counter is not None else contextlib.nullcontext():
            opt.step()
    return Outcome(0, None, stop, passes, model)


def fresh(seed: int = 0, lr: float = 0.1) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net()
    return model, torch.optim.SGD(model.parameters(), lr=lr)


def restart(
    saved: dict[str, Any], config: RerunConfig, injector: RerunErrorInjector | None = None
) -> tuple[RerunStateMachine, Net, torch.optim.Optimizer, int]:
    """Simulate a new job resuming from ``saved`` (fresh objects, state loaded)."""
    model, opt = fresh()
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optim"])
    restore_rng_state(saved["rng"])
    sm = RerunStateMachine(
        mode=config.mode,
        error_injector=injector,
        result_rejected_tracker_filename=config.result_rejected_tracker_filename,
    )
    sm.load_state_dict(saved["rerun"])
    return sm, model, opt, int(saved["iteration"])


def params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]
