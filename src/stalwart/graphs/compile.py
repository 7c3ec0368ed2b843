"""``torch.compile`` for models that run inside a full-iteration CUDA graph.

Inductor's own CUDA graphs (``mode="reduce-overhead"``, cudagraph trees) cannot nest inside our
capture, so the model is compiled with the default mode and ``triton.cudagraphs=False`` passed as
a per-compile option (no process-global inductor config is changed).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from stalwart.graphs.checks import GRAPHABLE_COMPILE_MODES


def compile_for_graph(model: nn.Module, *, mode: str = "default", dynamic: bool = False) -> Any:
    """Compile ``model`` so it can be captured inside :class:`FullIterationGraph`.

    ``dynamic=False``: the graph has static shapes anyway; dynamic shapes only add guards.
    Raises ``ValueError`` for modes that bring their own CUDA graphs.
    """
    if mode not in GRAPHABLE_COMPILE_MODES:
        raise ValueError(
            f"--compile mode {mode!r} cannot run inside a full-iteration CUDA graph; allowed: "
            f"{', '.join(GRAPHABLE_COMPILE_MODES)}"
        )
    import torch

    options: dict[str, str | int | bool | Callable[..., Any]] = {"triton.cudagraphs": False}
    if mode == "max-autotune-no-cudagraphs":
        options["max_autotune"] = True
    return torch.compile(model, dynamic=dynamic, options=options)
