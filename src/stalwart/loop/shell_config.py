"""The shell's settings (:class:`~stalwart.loop.shell_settings.ShellSettings`) and the one way
to build the shell from them (:meth:`ShellConfig.build`).

The settings live in their own module so that the shell, its parts and the naming of its
settings import them without importing the shell back (no import cycle).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from stalwart.loop.naming import Names
from stalwart.loop.shell import Shell
from stalwart.loop.shell_settings import PROBES, ProbeConfigs, ShellSettings


@dataclass(kw_only=True, frozen=True)
class ShellConfig(ShellSettings):
    """What the shell does (every field is :class:`ShellSettings`'), and :meth:`build`."""

    def build(
        self,
        *,
        rank: int = 0,
        world_size: int = 1,
        device: torch.device | str = "cpu",
        print_fn: Callable[..., None] = print,
        attempt: int = 0,
        loss_scaler: Any = None,
        run_config: Mapping[str, Any] | None = None,
        memory_estimate: Any = None,
        names: Names = Names.LOOP,
        compile_cache: Any = None,
    ) -> Shell:
        """The shell of this rank (build it in the main thread: the signal handler). Checks
        the settings first (:meth:`check`): a refused start writes nothing.

        ``attempt``: the in-process restart's attempt (the goodput ledger's session);
        ``loss_scaler``: its state is saved and restored around a rerun; ``run_config``: the
        run's settings (W&B's config); ``memory_estimate``: the model's theoretical memory
        (``memory.json`` compares it with the measured); ``names``: how this path spells the
        settings in its messages; ``compile_cache``: an open persistent compile cache.
        """
        return Shell(
            self,
            rank=rank,
            world_size=world_size,
            device=torch.device(device),
            print_fn=print_fn,
            attempt=attempt,
            loss_scaler=loss_scaler,
            run_config=run_config,
            memory_estimate=memory_estimate,
            names=names,
            compile_cache=compile_cache,
        )


__all__ = ["PROBES", "ProbeConfigs", "ShellConfig", "ShellSettings"]
