"""Dashboard tag names: Megatron's flat metric keys by default, a ``<group>/`` prefix on request.

The sinks write Megatron's keys exactly (``lm loss``, ``learning-rate``, ``forward-backward-time``,
``mem-reserved-bytes``, ...), so a Megatron dashboard or script finds every tag it knows.
TensorBoard and W&B put every tag without a ``/`` into its own card group, so those flat keys become
some thirty one-card sections; ``--group-metric-tags`` (``SinkConfig.group_metric_tags``) writes
:func:`grouped_name` instead, which keeps Megatron's key as the leaf and adds one group prefix::

    >>> grouped_name("lm loss")
    'loss/lm loss'
    >>> grouped_name("learning-rate vs samples")
    'optimizer/learning-rate vs samples'
    >>> grouped_name("forward-backward-time")
    'timers/forward-backward-time'
    >>> grouped_name("mem-max-allocated-bytes")
    'memory/mem-max-allocated-bytes'
    >>> grouped_name("straggler/compute-ms-max")   # already grouped: unchanged
    'straggler/compute-ms-max'

    >>> grouped_name("goodput")
    'goodput/goodput'

Groups: ``loss`` (training and validation losses, perplexity; also any key no rule claims, since
the training log's other flat keys are the loss keys of the user's forward step), ``optimizer``,
``batch``, ``throughput``, ``goodput``, ``timers`` (``<name>-time``, seconds), ``memory``
(``mem-*``). The ``" vs samples"`` twin of a key lands in the same group as the key.

Keys stalwart writes that Megatron has no counterpart for are listed in `STALWART_ONLY_KEYS`
(written flat too, under these names).
"""

from __future__ import annotations

import types
from collections.abc import Mapping

VS_SAMPLES_SUFFIX = " vs samples"

LOSS_GROUP = "loss"
GROUP_OF_KEY: Mapping[str, str] = types.MappingProxyType(
    {
        "learning-rate": "optimizer",
        "loss-scale": "optimizer",
        "grad-norm": "optimizer",
        "num-zeros": "optimizer",
        "params-norm": "optimizer",
        "max_attention_logit": "optimizer",
        "batch-size": "batch",
        "world-size": "batch",
        "skipped-train-samples": "batch",
        "samples vs steps": "batch",
        "iteration-time": "throughput",
        "throughput": "throughput",
        "tokens-per-second": "throughput",
        "tokens-per-second-per-gpu": "throughput",
        "mfu-percent": "throughput",
        "goodput": "goodput",
    }
)

# Keys of stalwart's own measurements (Megatron writes none of them): the goodput share of the
# wall clock, tokens/s and MFU, and process memory where there is no CUDA allocator (CPU runs).
STALWART_ONLY_KEYS = frozenset(
    {
        "goodput",
        "tokens-per-second",
        "tokens-per-second-per-gpu",
        "mfu-percent",
        "mem-rss-bytes",
        "mem-max-rss-bytes",
    }
)


def metric_group(key: str) -> str:
    """The group of a flat Megatron key (see the module docstring)."""
    base = key.removesuffix(VS_SAMPLES_SUFFIX)
    group = GROUP_OF_KEY.get(base)
    if group is not None:
        return group
    if base.startswith("mem-"):
        return "memory"
    if base.endswith("-time"):
        return "timers"
    return LOSS_GROUP


def grouped_name(key: str) -> str:
    """``<group>/<key>``; a key that already contains ``/`` is returned unchanged."""
    if "/" in key:
        return key
    return f"{metric_group(key)}/{key}"
