from __future__ import annotations

import gc
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from graphs_fake_backend import FakeGraphContext  # type: ignore[import-not-found]
from torch import nn

from stalwart.graphs import (
    CaptureFailurePolicy,
    FullIterationGraph,
    GraphContext,
    GraphMode,
    GraphSignatureError,
    SignatureChangePolicy,
    StagePhase,
)


class Flags:
    """Device-side check state for ``validation_buffer`` (any object with a device-only
    ``reset_``): a running sum, failed when non-finite."""

    def __init__(self) -> None:
        self.total = torch.zeros(())

    def reset_(self) -> None:
        self.total.zero_()

    def record_nonfinite(self, name: str, value: torch.Tensor) -> None:
        del name
        self.total.add_(value.detach().sum())

    def ok(self) -> bool:
        return bool(torch.isfinite(self.total))


class Recorder:
    """A Megatron-style forward_backward_func over a tiny linear model."""

    def __init__(self, flags: Flags | None = None) -> None:
        torch.manual_seed(0)
        self.model = nn.Linear(4, 1)
        self.calls = 0
        self.seen_ptrs: list[int] = []
        self.flags = flags

    def __call__(
        self,
        *,
        data_iterator: Iterator[Any],
        num_microbatches: int,
        forward_only: bool = False,
        **_unused: Any,
    ) -> list[dict[str, torch.Tensor]]:
        self.calls += 1
        losses = []
        for _ in range(num_microbatches):
            batch = next(data_iterator)
            self.seen_ptrs.append(batch["x"].data_ptr())
            loss = self.model(batch["x"]).pow(2).mean()
            if self.flags is not None:
                self.flags.record_nonfinite("loss", loss)
            if not forward_only:
                (loss / num_microbatches).backward()
            losses.append({"lm loss": loss.detach()})
        return losses


def _data(n: int, rows: int = 2, start: int = 0) -> Iterator[dict[str, torch.Tensor]]:
    for i in range(start, start + n):
        yield {"x": torch.full((rows, 4), float(i))}


def _call(graph: FullIterationGraph, it: Iterator[Any], n: int = 2, **kw: Any) -> Any:
    return graph(
        forward_step_func=None,
        data_iterator=it,
        model=None,
        num_microbatches=n,
        seq_length=4,
        micro_batch_size=2,
        **kw,
    )


def test_cpu_device_is_rejected_with_clear_message() -> None:
    with pytest.raises(ValueError, match="full_iteration requires a CUDA device"):
        GraphContext(torch.device("cpu"))


def test_warmup_then_capture_then_replay() -> None:
    ctx, fn = FakeGraphContext(), Recorder()
    graph = FullIterationGraph(fn, context=ctx, warmup_steps=3)
    it = _data(100)
    for _ in range(3):
        _call(graph, it)
        assert graph.phase() is StagePhase.WARMUP
    out = _call(graph, it)  # capture: Python runs once more, then one replay
    assert graph.phase() is StagePhase.CAPTURED and fn.calls == 4
    assert ctx.num_captures == 1 and ctx.num_replays == 1
    assert ctx.num_side_stream == 3  # warm-up on the capture stream
    for _ in range(5):
        assert _call(graph, it) is out  # static outputs, same object
    assert fn.calls == 4 and ctx.num_replays == 6
    # All micro-batches were read up front: 9 calls x 2 micro-batches consumed.
    assert next(it)["x"][0, 0].item() == 18.0
    # The latest data sits in the static buffers that the captured code read.
    static = graph.static_inputs()
    assert static[1]["x"][0, 0].item() == 17.0
    assert set(fn.seen_ptrs) == {b["x"].data_ptr() for b in static}


def test_training_and_evaluation_have_separate_graphs() -> None:
    ctx, fn = FakeGraphContext(), Recorder()
    graph = FullIterationGraph(fn, context=ctx, warmup_steps=1)
    it = _data(100)
    _call(graph, it)
    _call(graph, it)
    assert graph.phase(GraphMode.TRAINING) is StagePhase.CAPTURED
    assert graph.phase(GraphMode.EVALUATION) is StagePhase.WARMUP
    _call(graph, it, forward_only=True)
    _call(graph, it, forward_only=True)
    assert graph.phase(GraphMode.EVALUATION) is StagePhase.CAPTURED
    assert graph.num_captures == 2


def test_microbatch_count_change_recaptures_with_warning() -> None:
    ctx, fn = FakeGraphContext(), Recorder()
    graph = FullIterationGraph(fn, context=ctx, warmup_steps=1)
    it = _data(100)
    _call(graph, it, n=2)
    _call(graph, it, n=2)
    with pytest.warns(UserWarning, match="num_microbatches changed from 2 to 4"):
        _call(graph, it, n=4)
    assert graph.phase() is StagePhase.WARMUP  # never replays the stale graph
    _call(graph, it, n=4)
    assert graph.phase() is StagePhase.CAPTURED and graph.num_captures == 2


def test_shape_change_fails_when_configured() -> None:
    ctx, fn = FakeGraphContext(), Recorder()
    graph = FullIterationGraph(
        fn, context=ctx, warmup_steps=1, on_signature_change=SignatureChangePolicy.FAIL
    )
    _call(graph, _data(2))
    with pytest.raises(GraphSignatureError, match="micro-batch shapes/dtypes changed"):
        _call(graph, _data(2, rows=3))
    with pytest.raises(GraphSignatureError, match="static arguments changed"):
        graph(data_iterator=_data(2), num_microbatches=2, seq_length=8)


def test_capture_failure_falls_back_to_eager_with_message() -> None:
    ctx, fn = FakeGraphContext(fail_capture=True), Recorder()
    graph = FullIterationGraph(
        fn, context=ctx, warmup_steps=1, on_capture_failure=CaptureFailurePolicy.EAGER
    )
    it = _data(100)
    _call(graph, it)
    with pytest.warns(UserWarning, match="running this mode eagerly"):
        _call(graph, it)
    assert graph.phase() is StagePhase.EAGER_FALLBACK
    _call(graph, it)
    assert fn.calls == 3  # the failed capture's iteration still ran eagerly


def test_capture_failure_raises_by_default() -> None:
    graph = FullIterationGraph(
        Recorder(), context=FakeGraphContext(fail_capture=True), warmup_steps=1
    )
    it = _data(100)
    _call(graph, it)
    with pytest.raises(RuntimeError, match="must not sync with the host"):
        _call(graph, it)


def test_grad_params_are_materialised_once_and_zeroed_in_the_body() -> None:
    fn = Recorder()
    params = list(fn.model.parameters())
    graph = FullIterationGraph(fn, context=FakeGraphContext(), warmup_steps=2, grad_params=params)
    it = _data(100)
    _call(graph, it)
    grads = [p.grad for p in params if p.grad is not None]
    first = [g.clone() for g in grads]
    _call(graph, it, n=2)
    assert all(p.grad is g for p, g in zip(params, grads))  # fixed addresses
    assert not torch.equal(first[0], grads[0])  # zeroed then re-accumulated, not summed forever
    params[0].grad = None
    with pytest.raises(RuntimeError, match="do not call zero_grad"):
        _call(graph, it)


def test_validation_buffer_is_reset_every_training_iteration() -> None:
    flags = Flags()
    fn = Recorder(flags)
    graph = FullIterationGraph(
        fn, context=FakeGraphContext(), warmup_steps=1, validation_buffer=flags
    )
    _call(graph, iter([{"x": torch.full((2, 4), float("nan"))}] * 2))
    assert not flags.ok()
    _call(graph, _data(2))
    assert flags.ok()


def test_reset_and_teardown_drop_graphs() -> None:
    ctx, fn = FakeGraphContext(), Recorder()
    graph = FullIterationGraph(fn, context=ctx, warmup_steps=1)
    it = _data(100)
    _call(graph, it)
    _call(graph, it)
    graph.reset()
    assert graph.phase() is StagePhase.WARMUP and graph.static_inputs() is None
    _call(graph, it)
    _call(graph, it)
    ctx.teardown()
    assert graph.phase() is StagePhase.WARMUP and ctx.closed
    with pytest.raises(RuntimeError, match="torn down"):
        _call(graph, it)


def test_a_graph_dropped_without_teardown_is_freed_at_once() -> None:
    """A test that fails, or an attempt that raises, before ``teardown`` drops its graphs: they
    are freed then (reference counting), with the CUDA graphs they captured. Held by their
    context, graph and context formed a cycle that only a full collection frees: on a GPU that
    can come during a later capture, or at interpreter shutdown (where a failed GPU test's graph
    left ``pytest -m gpu`` hanging after its summary). ``teardown`` still resets the others."""
    gc.disable()  # only reference counting frees anything here
    try:
        ctx = FakeGraphContext()
        dropped_graph = FullIterationGraph(Recorder(), context=ctx, warmup_steps=1)
        kept = FullIterationGraph(Recorder(), context=ctx, warmup_steps=1)
        it = _data(100)
        for graph in (dropped_graph, dropped_graph, kept, kept):
            _call(graph, it)
        assert dropped_graph.phase() is kept.phase() is StagePhase.CAPTURED
        dropped = weakref.ref(dropped_graph)  # its stages are the only holders of its graphs
        del graph, dropped_graph
        assert dropped() is None  # while the context lives on
        ctx.teardown()
        assert kept.phase() is StagePhase.WARMUP and ctx.closed
    finally:
        gc.enable()


def test_instances_do_not_share_state() -> None:
    ctx = FakeGraphContext()
    a = FullIterationGraph(Recorder(), context=ctx, warmup_steps=1)
    b = FullIterationGraph(Recorder(), context=ctx, warmup_steps=1)
    it = _data(100)
    _call(a, it)
    _call(a, it)
    assert a.phase() is StagePhase.CAPTURED and b.phase() is StagePhase.WARMUP


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="--cuda-graph-warmup-steps"):
        FullIterationGraph(Recorder(), context=FakeGraphContext(), warmup_steps=0)
    graph = FullIterationGraph(Recorder(), context=FakeGraphContext())
    with pytest.raises(TypeError, match="data_iterator and num_microbatches"):
        graph(num_microbatches=1)


def test_clone_outputs_and_frozen_value_warning() -> None:
    def fn(*, data_iterator: Iterator[Any], num_microbatches: int, **_: Any) -> Any:
        return [
            {"loss": next(data_iterator)["x"].sum(), "step": 3} for _ in range(num_microbatches)
        ]

    graph = FullIterationGraph(fn, context=FakeGraphContext(), warmup_steps=1, clone_outputs=True)
    it = _data(100)
    _call(graph, it)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out1 = _call(graph, it)
    assert any("frozen at capture" in str(w.message) for w in caught)
    out2 = _call(graph, it)
    assert out1[0]["loss"] is not out2[0]["loss"]


def test_chunked_iterators_get_separate_buffers() -> None:
    seen: list[list[float]] = []

    def fn(*, data_iterator: list[Any], num_microbatches: int, **_: Any) -> Any:
        seen.append([next(chunk)["x"][0, 0].item() for chunk in data_iterator if chunk is not None])
        return []

    graph = FullIterationGraph(fn, context=FakeGraphContext(), warmup_steps=1)
    graph(data_iterator=[_data(1, start=0), _data(1, start=10), None], num_microbatches=1)
    assert seen == [[0.0, 10.0]]
