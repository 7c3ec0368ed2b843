"""Dashboard tags: Megatron's key as the leaf, one group prefix, the "vs samples" twin alongside."""

from __future__ import annotations

import doctest

from stalwart.observability import metric_names
from stalwart.observability.metric_names import grouped_name


def test_docstring_examples() -> None:
    assert doctest.testmod(metric_names).failed == 0


def test_groups_of_the_training_log_keys() -> None:
    expected = {
        "lm loss": "loss/lm loss",
        "load balancing loss vs samples": "loss/load balancing loss vs samples",
        "lm loss validation ppl": "loss/lm loss validation ppl",
        "learning-rate": "optimizer/learning-rate",
        "grad-norm vs samples": "optimizer/grad-norm vs samples",
        "batch-size": "batch/batch-size",
        "world-size": "batch/world-size",
        "iteration-time": "throughput/iteration-time",
        "throughput": "throughput/throughput",
        "optimizer-inner-step-time": "timers/optimizer-inner-step-time",
        "mem-reserved-bytes": "memory/mem-reserved-bytes",
        "power/gpu": "power/gpu",  # Megatron's own slash names stay as they are
        "goodput": "goodput/goodput",  # stalwart's own key: its own group, not loss/
    }
    assert {k: grouped_name(k) for k in expected} == expected
