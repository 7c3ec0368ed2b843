"""The trainer's small parts: how a run ended (`TrainOutcome`, re-exported by
:mod:`stalwart.train.trainer`) and the config's checkpoint part."""

from __future__ import annotations

import copy
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
    """The run's config in the checkpoint (read back by ``check_model_matches`` and export).

    The config is frozen, so its dict is built once: a save every few iterations (a local
    snapshot) would otherwise walk every dataclass of it each time (~30 ms on a busy CPU)."""

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self._state: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        if self._state is None:
            self._state = self.config.to_dict()
        return copy.deepcopy(self._state)  # a caller may change what it gets

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state  # the config given now wins
