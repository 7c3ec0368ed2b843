"""The trainer's small parts: how a run ended (`TrainOutcome`, re-exported by
:mod:`stalwart.train.trainer`) and the config's checkpoint part."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
