"""Capture is bracketed by barriers (Megatron): all ranks capture together, none replays early."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from stalwart.distributed import collectives
from stalwart.graphs.pool import GraphContext


class CpuContext(GraphContext):
    """The real ``capture`` with the CUDA seams stubbed (stream, pool, synchronize)."""

    def __init__(self, log: list[str], **kwargs: Any) -> None:
        self.log = log
        super().__init__(torch.device("cpu"), **kwargs)

    def _check_device(self) -> None:
        pass

    def _new_stream(self) -> Any:
        return object()

    def _new_pool(self) -> Any:
        return object()

    def synchronize(self) -> None:
        self.log.append("sync")


@pytest.fixture
def fake_cuda_graph(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    log: list[str] = []

    @contextlib.contextmanager
    def graph(*args: Any, **kwargs: Any) -> Iterator[None]:
        log.append("capture-begin")
        yield
        log.append("capture-end")

    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(collectives, "barrier", lambda group=None: log.append("world-barrier"))
    return log


def test_default_world_barrier_before_and_after_capture(fake_cuda_graph: list[str]) -> None:
    ctx = CpuContext(fake_cuda_graph)
    with ctx.capture(object()):
        fake_cuda_graph.append("body")
    assert fake_cuda_graph == [
        "world-barrier",
        "sync",
        "capture-begin",
        "body",
        "capture-end",
        "sync",
        "world-barrier",
    ]


def test_explicit_barrier_replaces_the_world_one(fake_cuda_graph: list[str]) -> None:
    ctx = CpuContext(fake_cuda_graph, barrier=lambda: fake_cuda_graph.append("group-barrier"))
    with ctx.capture(object()):
        pass
    assert fake_cuda_graph.count("group-barrier") == 2 and "world-barrier" not in fake_cuda_graph
