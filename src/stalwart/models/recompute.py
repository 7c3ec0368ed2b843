"""Activation recompute as Megatron has it, on ``torch.utils.checkpoint`` (non-reentrant).

* ``--recompute-granularity selective``: every layer recomputes its attention core (RoPE and
  ``softmax(QK^T)V``) in backward instead of keeping the rotated queries/keys and the softmax
  statistics (or, on the math SDPA backend, the ``[s, s]`` probabilities).
* ``--recompute-granularity full --recompute-method uniform --recompute-num-layers N``: the layers
  are split into groups of ``N`` consecutive layers; a group keeps only its input and is run again
  in backward. ``N`` must divide the number of layers.
* ``--recompute-method block --recompute-num-layers N``: the first ``N`` layers are recomputed one
  by one; the others keep their activations.

Dropout inside a recomputed region draws the same mask again: the checkpoint saves the CPU and
device RNG states at forward and restores them for the recompute, so a run with recompute is
bitwise the run without it. Without dropout the RNG state is not touched at all, which is what
lets recompute run inside a captured CUDA graph (reading the generator state cannot be captured;
``stalwart.graphs.check_graph_config`` rejects dropout in recomputed modules under graphs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.utils.checkpoint import checkpoint

from stalwart.models.config import GPTConfig, RecomputeGranularity, RecomputeMethod

# Megatron's --recompute-modules names of what selective recompute runs again.
SELECTIVE_RECOMPUTE_MODULES = ("core_attn",)


class LayerUnit(NamedTuple):
    """Layers ``[start, stop)`` run as one unit; ``recompute``: checkpointed as a whole."""

    start: int
    stop: int
    recompute: bool


def layer_units(config: GPTConfig) -> tuple[LayerUnit, ...]:
    """How the layers are grouped for full recompute (one non-recomputed unit per layer otherwise).

    Example::

        >>> from stalwart.models import GPTConfig
        >>> cfg = GPTConfig(num_layers=4, hidden_size=8, num_attention_heads=2, seq_length=4,
        ...                 vocab_size=16, recompute_granularity="full",
        ...                 recompute_method="block", recompute_num_layers=1)
        >>> [u.recompute for u in layer_units(cfg)]
        [True, False, False, False]
    """
    n_layers, count = config.num_layers, config.recompute_num_layers
    if config.recompute_granularity is not RecomputeGranularity.FULL or count is None:
        return tuple(LayerUnit(i, i + 1, False) for i in range(n_layers))
    if config.recompute_method is RecomputeMethod.UNIFORM:
        return tuple(LayerUnit(i, i + count, True) for i in range(0, n_layers, count))
    return tuple(LayerUnit(i, i + 1, i < count) for i in range(n_layers))


def recomputed(fn: Callable[..., Any], *args: Any, preserve_rng_state: bool) -> Any:
    """``fn(*args)`` keeping only ``args`` for backward, which runs ``fn`` again.

    Outside autograd (evaluation, ``torch.no_grad``) it is a plain call. ``preserve_rng_state``
    must be True when ``fn`` draws random numbers (dropout): the recompute then replays them.
    """
    if not torch.is_grad_enabled():
        return fn(*args)
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state)
