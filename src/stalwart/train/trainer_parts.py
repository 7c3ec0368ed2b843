"""The trainer's small parts: how a run ended (`TrainOutcome`, re-exported by
:mod:`stalwart.train.trainer`), the config's checkpoint part and two step helpers."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from stalwart.config.run import RunConfig
from stalwart.reliability.exit import ExitReason


@dataclass
class TrainOutcome:
    """How ``train()`` ended: the process exit code and why."""

    exit_code: int
    reason: ExitReason
    iteration: int
    detail: str = ""


class ConfigPart:
    """The run's config in the checkpoint (read back by ``check_model_matches`` and export)."""

    def __init__(self, config: RunConfig) -> None:
        self.config = config

    def state_dict(self) -> dict[str, Any]:
        return self.config.to_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state  # the config given now wins


@contextlib.contextmanager
def then_release(section: Any, release: Callable[[], None]) -> Iterator[None]:
    """An eval step's watchdog section, then ``--empty-unused-memory-level``'s release."""
    with section:
        yield
    release()


def params_norm(model: torch.nn.Module) -> torch.Tensor:
    """L2 norm of all parameters (device tensor, ``--log-params-norm``)."""
    norms = torch._foreach_norm([p.detach() for p in model.parameters()])
    return torch.linalg.vector_norm(torch.stack(norms))
