"""Periodic evaluation on the held-out split (``--eval-interval``, ``--eval-iters``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from stalwart.train.step import ForwardStepFunc, average_reported, forward_backward


def evaluate(
    *,
    model: nn.Module,
    forward_step_func: ForwardStepFunc,
    data_iterator: Iterator[dict[str, torch.Tensor]],
    num_microbatches: int,
    eval_iters: int,
    disable_validation: Callable[
        [], contextlib.AbstractContextManager[Any]
    ] = contextlib.nullcontext,
    step_section: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    forward_backward_func: Callable[..., list[dict[str, torch.Tensor]]] = forward_backward,
) -> dict[str, float]:
    """Mean of every reported loss over ``eval_iters`` forward-only iterations.

    Validation checks are disabled for the duration (``disable_validation``: the rerun state
    machine's context manager), and each eval iteration runs inside ``step_section`` (the hang
    watchdog's step section). The model is put back in train mode on every exit path.

    Returns:
        Host floats (one deliberate sync at the end of evaluation).
    """
    totals: dict[str, torch.Tensor] = {}
    model.eval()
    try:
        with disable_validation():
            for _ in range(eval_iters):
                with step_section():
                    reported = forward_backward_func(
                        forward_step_func=forward_step_func,
                        data_iterator=data_iterator,
                        model=model,
                        num_microbatches=num_microbatches,
                        forward_only=True,
                    )
                for key, value in average_reported(reported).items():
                    totals[key] = totals.get(key, torch.zeros_like(value)) + value
    finally:
        model.train()
    # Deliberate sync: evaluation results are printed and written to the sinks.
    return {k: float(v.item()) / max(eval_iters, 1) for k, v in totals.items()}
