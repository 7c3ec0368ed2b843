"""Where a guarded adapter step's host time goes: the main thread's CPU time of the guarded
step's parts and of the adapters' hooks, per timed step (``bench/adapter_overhead.py
--breakdown``).

Each part is a function wrapped (in the stalwart version that runs the variant: see
``source_versions``) by an accumulator of ``time.thread_time_ns``; the accumulators count only
between ``enable`` and ``disable`` (the timed steps). A part's figure includes its children
(the guarded step includes the micro-batches, which include the backward) and about a
microsecond of the wrapper per call.
"""

from __future__ import annotations

import functools
import importlib
import time
from collections.abc import Callable
from typing import Any

# label: (module, attribute path); the hooks of one adapter only exist in its module.
PARTS: dict[str, tuple[str, str]] = {
    "guarded step (GuardedStep.run)": ("stalwart.loop.step", "GuardedStep.run"),
    "  micro-batches (forward, backward, checks)": (
        "stalwart.loop.microbatches", "MicroBatches.__call__"),
    "    autograd backward": ("torch.autograd", "backward"),
    "    loss checks recorded": ("stalwart.loop.microbatches", "MicroBatches._check_losses"),
    "    gradient check after the backward": (
        "stalwart.reliability.rerun.checks.grads", "GradCheckState.check_after_backward"),
    "    skip gate": ("stalwart.loop.microbatches", "MicroBatches._update_gate"),
    "    gradients zeroed": ("stalwart.loop.microbatches", "MicroBatches._zero_grad"),
    "  rerun machine: pass begin and the read": (
        "stalwart.reliability.rerun.machine", "RerunStateMachine.should_run_forward_backward"),
    "  rerun machine: verdict": ("stalwart.reliability.rerun.machine", "RerunStateMachine.verdict"),
    "  reported means": ("stalwart.loop.step", "average_reported"),
    "  optimizer step (clip, step)": ("stalwart.loop.optimizer", "EagerOptimizer.step"),
    "    torch AdamW.step": ("torch.optim", "AdamW.step"),
    "framework step (FrameworkStep.run)": ("stalwart.integrations.framework_step", "FrameworkStep.run"),
    "HF step: StalwartTrainer.training_step": ("stalwart.integrations.hf", "StalwartTrainer.training_step"),
    "Lightning step: GuardedModule.training_step": (
        "stalwart.integrations.lightning", "GuardedModule.training_step"),
    "HF hook: on_step_begin": ("stalwart.integrations.hf", "StalwartCallback.on_step_begin"),
    "HF hook: on_step_end": ("stalwart.integrations.hf", "StalwartCallback.on_step_end"),
    "Lightning hook: on_train_batch_start": (
        "stalwart.integrations.lightning", "StalwartCallback.on_train_batch_start"),
    "Lightning hook: on_train_batch_end": (
        "stalwart.integrations.lightning", "StalwartCallback.on_train_batch_end"),
    "  training log (on_iteration)": ("stalwart.observability.train_log", "TrainingLog.on_iteration"),
    "  shell: the iteration recorded (Shell.record)": ("stalwart.loop.shell", "Shell.record"),
    "  shell: exit decision (Shell.decide)": ("stalwart.loop.shell", "Shell.decide"),
}  # fmt: skip


class Breakdown:
    """Thread time per part while enabled (``enable``/``disable`` as ``cProfile``)."""

    def __init__(self) -> None:
        self.ns: dict[str, int] = {}
        self.on = False
        self._wrapped: set[tuple[int, str]] = set()

    def enable(self) -> None:
        self.on = True

    def disable(self) -> None:
        self.on = False

    def instrument(self) -> None:
        """Wrap every part found in the stalwart version imported now (once per version)."""
        for label, (module_name, path) in PARTS.items():
            try:
                owner: Any = importlib.import_module(module_name)
            except ImportError:  # an adapter whose framework is not installed
                continue
            *outer, name = path.split(".")
            for attr in outer:
                owner = getattr(owner, attr)
            if (id(owner), name) in self._wrapped:
                continue
            self._wrapped.add((id(owner), name))
            setattr(owner, name, self._timed(label, getattr(owner, name)))

    def _timed(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return fn(*args, **kwargs)
            start = time.thread_time_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                self.ns[label] = self.ns.get(label, 0) + time.thread_time_ns() - start

        return timed

    def per_step_us(self, steps: int) -> dict[str, float]:
        return {label: self.ns[label] / 1e3 / steps for label in PARTS if label in self.ns}
