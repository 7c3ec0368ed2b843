"""stalwart's per-iteration values as a framework's own loggers take them.

At each log step the training log returns its metrics-file record (host values: the log step
has read them already, so offering them costs no device read). :func:`offered_metrics` picks the
values a framework's dashboards want from it under ``stalwart/<name>`` (the metrics file's
names), and the adapters hand them over: Lightning to ``trainer.loggers`` and its progress bar
(the interval's loss as ``loss``), the Hugging Face ``Trainer`` in the ``logs`` its
``TensorBoardCallback`` and ``WandbCallback`` receive.

    >>> offered_metrics({"iteration": 20, "loss": 2.5, "lr": 1e-3, "grad_norm": None})
    {'stalwart/loss': 2.5, 'stalwart/lr': 0.001}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

PREFIX = "stalwart/"

# The metrics file's names of what is offered: the interval's mean loss, the learning rate and
# gradient norm of its last iteration, its time and throughput, its skipped and NaN iterations
# (the checks' verdicts), goodput so far.
OFFERED = (
    "loss",
    "lr",
    "grad_norm",
    "loss_scale",
    "elapsed_ms",
    "tokens_per_second",
    "throughput_tflops_per_gpu",
    "mfu_percent",
    "skipped_iterations",
    "nan_iterations",
    "goodput",
)


def offered_metrics(record: Mapping[str, Any]) -> dict[str, float]:
    """``stalwart/<name>`` -> value for each of :data:`OFFERED` that the record has a number for."""
    out = {}
    for name in OFFERED:
        value = record.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[PREFIX + name] = float(value)
    return out


__all__ = ["OFFERED", "PREFIX", "offered_metrics"]
