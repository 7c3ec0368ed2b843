"""The standard timer names (Megatron's spelling), the level at which each is real, and how
they nest."""

from __future__ import annotations

import types
from collections.abc import Mapping

# Standard timer names (Megatron spelling) and the level at which each one is real.
INTERVAL_TIME = "interval-time"
SAVE_CHECKPOINT = "save-checkpoint"
SAVE_CHECKPOINT_NON_PERSISTENT = "save-checkpoint-non-persistent"
LOAD_CHECKPOINT = "load-checkpoint"
EVALUATE = "evaluate"
FORWARD_BACKWARD = "forward-backward"
ALL_GRADS_SYNC = "all-grads-sync"
PARAMS_ALL_GATHER = "params-all-gather"
OPTIMIZER_COPY_TO_MAIN_GRAD = "optimizer-copy-to-main-grad"
OPTIMIZER_UNSCALE_AND_CHECK_INF = "optimizer-unscale-and-check-inf"
OPTIMIZER_CLIP_MAIN_GRAD = "optimizer-clip-main-grad"
OPTIMIZER_COUNT_ZEROS = "optimizer-count-zeros"
OPTIMIZER_INNER_STEP = "optimizer-inner-step"
OPTIMIZER_COPY_MAIN_TO_MODEL_PARAMS = "optimizer-copy-main-to-model-params"
OPTIMIZER = "optimizer"
BATCH_GENERATOR = "batch-generator"
FORWARD_COMPUTE = "forward-compute"
BACKWARD_COMPUTE = "backward-compute"

STANDARD_TIMER_LEVELS: Mapping[str, int] = types.MappingProxyType(
    {
        INTERVAL_TIME: 0,
        SAVE_CHECKPOINT: 0,
        SAVE_CHECKPOINT_NON_PERSISTENT: 0,
        LOAD_CHECKPOINT: 0,
        EVALUATE: 0,
        FORWARD_BACKWARD: 1,
        ALL_GRADS_SYNC: 1,
        PARAMS_ALL_GATHER: 1,
        OPTIMIZER_COPY_TO_MAIN_GRAD: 1,
        OPTIMIZER_UNSCALE_AND_CHECK_INF: 1,
        OPTIMIZER_CLIP_MAIN_GRAD: 1,
        OPTIMIZER_COUNT_ZEROS: 1,
        OPTIMIZER_INNER_STEP: 1,
        OPTIMIZER_COPY_MAIN_TO_MODEL_PARAMS: 1,
        OPTIMIZER: 1,
        BATCH_GENERATOR: 2,
        FORWARD_COMPUTE: 2,
        BACKWARD_COMPUTE: 2,
    }
)

# Which standard timer runs inside which (``--timing-log-level 2`` times both): a breakdown must
# stack a parent's own time, not the parent on top of its children.
TIMER_PARENTS: Mapping[str, str] = types.MappingProxyType(
    {
        BATCH_GENERATOR: FORWARD_BACKWARD,
        FORWARD_COMPUTE: FORWARD_BACKWARD,
        BACKWARD_COMPUTE: FORWARD_BACKWARD,
        OPTIMIZER_COPY_TO_MAIN_GRAD: OPTIMIZER,
        OPTIMIZER_UNSCALE_AND_CHECK_INF: OPTIMIZER,
        OPTIMIZER_CLIP_MAIN_GRAD: OPTIMIZER,
        OPTIMIZER_COUNT_ZEROS: OPTIMIZER,
        OPTIMIZER_INNER_STEP: OPTIMIZER,
        OPTIMIZER_COPY_MAIN_TO_MODEL_PARAMS: OPTIMIZER,
    }
)

# The per-iteration timers the training log reports, in Megatron's order (level filtered at use).
TRAINING_TIMERS: tuple[str, ...] = (
    FORWARD_BACKWARD,
    ALL_GRADS_SYNC,
    PARAMS_ALL_GATHER,
    OPTIMIZER_COPY_TO_MAIN_GRAD,
    OPTIMIZER_UNSCALE_AND_CHECK_INF,
    OPTIMIZER_CLIP_MAIN_GRAD,
    OPTIMIZER_COUNT_ZEROS,
    OPTIMIZER_INNER_STEP,
    OPTIMIZER_COPY_MAIN_TO_MODEL_PARAMS,
    OPTIMIZER,
    BATCH_GENERATOR,
    FORWARD_COMPUTE,
    BACKWARD_COMPUTE,
)
