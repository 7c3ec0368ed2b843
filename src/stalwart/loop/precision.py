"""Mixed precision for the guarded step: autocast and a dynamic loss scaler for ``--fp16``.

bf16 needs no scaling. fp16 uses :class:`DynamicLossScaler` (Megatron semantics: start at
``--initial-loss-scale``, halve on overflow after ``--hysteresis`` overflows, double after
``--loss-scale-window`` clean iterations, never below ``--min-loss-scale``). An overflow skips the
optimizer step and counts as a skipped iteration.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch


def autocast_context(
    device: torch.device, dtype: torch.dtype | None
) -> contextlib.AbstractContextManager[Any]:
    """Autocast to ``dtype`` (bf16/fp16) on ``device``; a null context for None (fp32)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


class NullLossScaler:
    """fp32/bf16: no scaling, never skips."""

    scale: float = 1.0
    dynamic = False  # an overflow decides on the host (DynamicLossScaler)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def unscale_and_check(self, params: Iterable[torch.nn.Parameter]) -> torch.Tensor | None:
        del params
        return None

    def update(self, found_inf: bool) -> None:
        del found_inf

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state


class DynamicLossScaler(NullLossScaler):
    """Dynamic loss scaling for fp16 with Megatron's hysteresis semantics."""

    dynamic = True

    def __init__(
        self,
        initial_scale: float,
        min_scale: float = 1.0,
        growth_interval: int = 1000,
        hysteresis: int = 2,
    ) -> None:
        self.scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self._hysteresis_left = hysteresis
        self._clean_iterations = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale_and_check(self, params: Iterable[torch.nn.Parameter]) -> torch.Tensor | None:
        """Divide gradients by the scale in place; return a device flag set on any inf/NaN."""
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return None
        found_inf = torch.zeros(1, device=grads[0].device)
        inv = torch.full((1,), 1.0 / self.scale, device=grads[0].device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv)
        return found_inf

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._clean_iterations = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.scale / 2.0, self.min_scale)
                self._hysteresis_left = self.hysteresis
            return
        self._clean_iterations += 1
        if self._clean_iterations >= self.growth_interval:
            self.scale *= 2.0
            self._clean_iterations = 0
            self._hysteresis_left = self.hysteresis

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "hysteresis_left": self._hysteresis_left,
            "clean_iterations": self._clean_iterations,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            self.scale = float(state["scale"])
            self._hysteresis_left = int(state["hysteresis_left"])
            self._clean_iterations = int(state["clean_iterations"])
