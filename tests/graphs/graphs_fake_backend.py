"""A CPU stand-in for GraphContext: capture runs the body once (like real capture runs Python
once), replay only counts. Lets the warm-up -> capture -> replay state machines run on CPU."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from stalwart.graphs.pool import GraphContext


class FakeGraph:
    def __init__(self, owner: FakeGraphContext) -> None:
        self.owner = owner
        self.num_replays = 0
        self.generators: list[torch.Generator] = []
        self.body_s = 0.0  # how long the captured body took

    def replay(self) -> None:
        self.num_replays += 1
        self.owner.num_replays += 1
        if self.owner.timed_replay:
            time.sleep(self.body_s)  # the device work the graph holds takes its time again


class FakeGraphContext(GraphContext):
    def __init__(self, fail_capture: bool = False, timed_replay: bool = False) -> None:
        # timed_replay: a replay lasts as long as its capture's body did (host-clock timers see
        # a graph's work as they would a real replay's, synchronized).
        self.timed_replay = timed_replay
        self.num_captures = 0
        self.num_replays = 0
        self.num_side_stream = 0
        self.num_overlapped = 0
        self.num_joins = 0
        self.capturing = False
        self.fail_capture = fail_capture
        self.graphs: list[FakeGraph] = []
        super().__init__(torch.device("cpu"))

    def _check_device(self) -> None:
        pass

    def _new_stream(self) -> Any:
        return object()

    def _new_pool(self) -> Any:
        return object()

    def new_graph(self) -> Any:
        self._require_open()
        graph = FakeGraph(self)
        self.graphs.append(graph)
        return graph

    def synchronize(self) -> None:
        pass

    @contextlib.contextmanager
    def side_stream(self) -> Iterator[None]:
        self._require_open()
        self.num_side_stream += 1
        yield

    @contextlib.contextmanager
    def overlapped(self) -> Iterator[None]:
        self._require_open()
        self.num_overlapped += 1
        yield

    def join_overlapped(self) -> None:
        self.num_joins += 1

    @contextlib.contextmanager
    def capture(self, graph: Any, generators: Sequence[torch.Generator] = ()) -> Iterator[None]:
        self._require_open()
        graph.generators = list(generators)
        self.capturing = True
        started = time.perf_counter()
        try:
            if self.fail_capture:
                raise RuntimeError("operation not permitted when stream is capturing")
            yield
        finally:
            self.capturing = False
            graph.body_s = time.perf_counter() - started
        self.num_captures += 1
