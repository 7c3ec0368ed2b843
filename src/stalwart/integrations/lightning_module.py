"""The ``LightningModule`` side of stalwart's Lightning adapter: :class:`GuardedModule`, whose
training step runs under the rerun state machine (`stalwart.integrations.lightning` has the
callback and the module docstring; it re-exports the mixin).

The step's host work is kept off Lightning's per-batch path where it repeats: the
step-interval LR schedulers are collected once (:class:`StepSchedulers`), the result is kept
on the framework step (a plain object) as well as in ``stalwart_result``.
"""

from __future__ import annotations

from typing import Any

import torch

from stalwart.integrations.framework_step import FrameworkStep
from stalwart.loop import StepResult


class StepSchedulers:
    """The step-interval LR schedulers Lightning leaves to a manually optimized module
    (``ReduceLROnPlateau`` is not one: it needs a metric), collected once at the first step."""

    def __init__(self, trainer: Any) -> None:
        self.every = [
            (config.scheduler, max(int(config.frequency), 1))
            for config in trainer.lr_scheduler_configs
            if config.interval == "step" and not config.reduce_on_plateau
        ]
        self.counted = any(frequency > 1 for _, frequency in self.every)

    def step(self, module: Any) -> None:
        """After an accepted or skipped iteration (Lightning's ``global_step`` counts it)."""
        if not self.every:
            return
        count = module.trainer.global_step if self.counted else 0
        for scheduler, frequency in self.every:
            if count % frequency == 0:
                scheduler.step()


class GuardedModule:
    """Mixin for a ``LightningModule`` whose training step runs under the rerun state machine
    (see the module docstring). Implement :meth:`forward_step`; keep ``configure_optimizers``."""

    stalwart_clip_grad: float = 0.0  # global gradient-norm clip of the guarded step (0: none)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """``class M(L.LightningModule, GuardedModule)`` would take Lightning's
        ``training_step`` (and Lightning's misleading "no training_step" error): name the order."""
        super().__init_subclass__(**kwargs)
        for base in cls.__mro__:
            if base is GuardedModule:
                break
            if "training_step" in vars(base) and not issubclass(base, GuardedModule):
                raise TypeError(
                    f"class {cls.__name__}: put GuardedModule before {base.__name__} in its "
                    f"bases, e.g. class {cls.__name__}(GuardedModule, L.LightningModule)"
                )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False
        self.stalwart_step: FrameworkStep | None = None  # set by StalwartCallback
        self.stalwart_result: StepResult | None = None
        self._stalwart_schedulers: StepSchedulers | None = None

    def forward_step(self, batch: Any) -> torch.Tensor | dict[str, torch.Tensor]:
        """The loss of one micro-batch, or a dict with ``"loss"`` and values to report."""
        raise NotImplementedError("GuardedModule: implement forward_step(batch) -> loss")

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        del batch_idx
        if self.stalwart_step is None:
            raise RuntimeError(
                "GuardedModule: add stalwart.integrations.lightning.StalwartCallback to the "
                "Trainer's callbacks"
            )
        step = self.stalwart_step
        result = step.run([batch])
        # Not nn.Module's __setattr__ (it looks for a parameter, buffer or module each time).
        self.__dict__["stalwart_result"] = result
        if not result.verdict.exit:
            if step.skipped:
                _count_a_step(self)  # a skipped iteration is one of max_steps all the same
            schedulers = self._stalwart_schedulers  # the callback's, from this fit's trainer
            if schedulers is None:
                trainer = self.trainer  # type: ignore[attr-defined]
                schedulers = self.__dict__["_stalwart_schedulers"] = StepSchedulers(trainer)
            schedulers.step(self)
        loss = result.losses.get("lm loss")
        return None if loss is None else {"loss": loss}


def _count_a_step(module: Any) -> None:
    """Lightning counts an iteration by its optimizer step (``global_step``): a skipped one
    steps nothing, so count it as Lightning's own step does (its progress hooks only)."""
    optimizer = module.optimizers()
    optimizer._on_before_step()
    optimizer._on_after_step()


__all__ = ["GuardedModule", "StepSchedulers"]
