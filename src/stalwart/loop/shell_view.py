"""What the shell's exit path and spike rewind read off the shell (:class:`ShellView`;
:class:`~stalwart.loop.Shell` is the one), typed here so that those modules do not import the
shell that owns them (no import cycle)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from torch import nn

from stalwart.loop.checkpointing import LoopState
from stalwart.loop.iterations import Iterations
from stalwart.loop.naming import Names
from stalwart.loop.shell_settings import ShellSettings
from stalwart.loop.step import GuardedStep
from stalwart.observability.run_dir import EventKind
from stalwart.observability.save_timing import SaveTiming
from stalwart.observability.train_log import TrainingLog


class ShellView(Protocol):
    """The shell's settings, parts and counts that its exit path and its spike rewind use
    (their meanings: :class:`~stalwart.loop.Shell`'s attributes of the same names)."""

    config: ShellSettings
    names: Names
    rank: int
    print: Callable[..., None]
    iterations: Iterations
    ledger: Any
    sections: Any
    machine: Any
    agreement: Any
    saves: SaveTiming
    energy: Any
    progress: Any

    @property
    def completed(self) -> int: ...

    @property
    def state(self) -> LoopState: ...

    @property
    def watched(self) -> nn.Module | None: ...

    @property
    def built_log(self) -> TrainingLog | None: ...

    @property
    def guarded(self) -> GuardedStep | None: ...

    @property
    def flops_per_iteration(self) -> float | None: ...

    def event(self, kind: EventKind, detail: str, *, iteration: int | None = None) -> None: ...


__all__ = ["ShellView"]
