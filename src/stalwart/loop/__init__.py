"""The guarded step for any training loop (rerun passes, plans, gated optimizer, look-ahead),
the shell around it (:class:`Shell`: ledger, watchdog, exit, probes, log) and the checkpoint
state a loop registers instead of packing it by hand.

The reference trainer (``stalwart.train``) is the first user of this package, not its owner;
the README's "Using the parts in your own loop" is the second.
"""

from __future__ import annotations

from stalwart.loop.checkpointing import Checkpointer, LoopState, RngState, Stateful
from stalwart.loop.compute_weights import ComputeWeights
from stalwart.loop.iterations import Iteration
from stalwart.loop.lookahead import LookAhead
from stalwart.loop.microbatches import (
    ForwardStep,
    MicroBatches,
    PassValues,
    average_reported,
    with_means,
)
from stalwart.loop.naming import Names
from stalwart.loop.plans import EagerPlan, GraphPlan, Plan
from stalwart.loop.precision import DynamicLossScaler, NullLossScaler, autocast_context
from stalwart.loop.shell import Shell
from stalwart.loop.shell_config import ShellConfig
from stalwart.loop.step import GuardedStep, StepResult

__all__ = [
    "Checkpointer",
    "ComputeWeights",
    "DynamicLossScaler",
    "EagerPlan",
    "ForwardStep",
    "GraphPlan",
    "GuardedStep",
    "Iteration",
    "LookAhead",
    "LoopState",
    "MicroBatches",
    "Names",
    "NullLossScaler",
    "PassValues",
    "Plan",
    "RngState",
    "Shell",
    "ShellConfig",
    "Stateful",
    "StepResult",
    "autocast_context",
    "average_reported",
    "with_means",
]
