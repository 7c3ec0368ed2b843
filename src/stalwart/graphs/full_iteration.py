"""Full-iteration CUDA graph: warm up, capture and replay a whole forward-backward step.

:class:`FullIterationGraph` wraps a Megatron-style ``forward_backward_func`` (keyword-only call
over ``num_microbatches`` micro-batches). Each call reads every micro-batch up front, copies them
into static buffers, and then either runs eagerly (the first ``warmup_steps`` calls, on the
capture stream), captures (next call; the capture is followed by a replay so that call still does
one real iteration), or replays. Training (``forward_only=False``) and evaluation
(``forward_only=True``) have separate graphs and buffers; all state is per instance.

After capture no Python inside ``forward_backward_func`` runs again: only device work is
replayed. Device-side checks (``isfinite(loss)`` into a flag buffer) keep working because they
are device work; host reads (``.item()``) are illegal in capture and must happen after the call.
Timers: record CUDA events (event-mode timers) around the call, never inside the wrapped
function; ordinary events recorded inside become capture dependencies, not timestamps. Only
external events (``torch.cuda.Event(external=True)``) are re-recorded by every replay: the
straggler detector's regions and the in-graph optimizer's split
(``stalwart.observability.timer_split``) use them.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
import warnings
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, Protocol

import torch

from stalwart.graphs.pool import GraphContext
from stalwart.graphs.static_inputs import InputSignature, StaticInputs, signature_of
from stalwart.log_notice import NOTICE

logger = logging.getLogger(__name__)

_STATIC_KWARG_TYPES = (type(None), bool, int, float, str)
_NOT_SIGNATURE_KWARGS = frozenset({"data_iterator", "num_microbatches"})


class GraphMode(enum.Enum):
    """Which graph a call uses: ``forward_only=False`` -> TRAINING, True -> EVALUATION."""

    TRAINING = "training"
    EVALUATION = "evaluation"


class StagePhase(enum.Enum):
    """Where one mode's graph is in its life cycle."""

    WARMUP = "warmup"
    CAPTURED = "captured"
    EAGER_FALLBACK = "eager_fallback"


class SignatureChangePolicy(enum.Enum):
    """What to do when the micro-batch count, shapes, dtypes or static kwargs change."""

    RECAPTURE = "recapture"  # warn, drop the graph and buffers, warm up and capture again
    FAIL = "fail"  # raise GraphSignatureError


class CaptureFailurePolicy(enum.Enum):
    """What to do when capture raises (e.g. a host sync inside the captured region)."""

    FAIL = "fail"
    EAGER = "eager"  # warn once and keep running this mode eagerly


class GraphSignatureError(ValueError):
    """The workload changed under a captured graph and the policy is FAIL."""


class GateSource(Protocol):
    """Device-side validation state written inside the captured iteration.

    ``reset_()`` must only issue device work (e.g. ``flags.zero_()``): it is called at the start
    of every training iteration, inside the captured region, so each replay starts clean.
    """

    def reset_(self) -> None: ...


@dataclasses.dataclass
class _Stage:
    inputs: StaticInputs
    signature: InputSignature | None = None
    graph: Any = None
    outputs: Any = None
    num_eager: int = 0
    phase: StagePhase = StagePhase.WARMUP
    chunked: bool = False
    kwargs: dict[str, Any] | None = None
    capture_seconds: float = 0.0


def _read_microbatches(data_iterator: Any, num_microbatches: int) -> Any:
    if data_iterator is None:
        return None
    if isinstance(data_iterator, list):  # one iterator per model chunk (virtual pipeline)
        return [
            None if it is None else [next(it) for _ in range(num_microbatches)]
            for it in data_iterator
        ]
    return [next(data_iterator) for _ in range(num_microbatches)]


def _static_iterators(static: Any, chunked: bool) -> Any:
    if static is None:
        return None
    if chunked:
        return [None if chunk is None else iter(chunk) for chunk in static]
    return iter(static)


def _static_kwargs(kwargs: dict[str, Any]) -> Hashable:
    # Constant kwargs (seq_length, micro_batch_size, forward_only, ...) are baked into the graph.
    return tuple(
        sorted(
            (key, value)
            for key, value in kwargs.items()
            if key not in _NOT_SIGNATURE_KWARGS and isinstance(value, _STATIC_KWARG_TYPES)
        )
    )


def _clone_tensors(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {key: _clone_tensors(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone_tensors(value) for value in obj)
    return obj


def _has_frozen_leaves(obj: Any) -> bool:
    if isinstance(obj, dict):
        return any(_has_frozen_leaves(value) for value in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_frozen_leaves(value) for value in obj)
    return not (obj is None or isinstance(obj, torch.Tensor))


class FullIterationGraph:
    """Capture and replay a whole forward-backward over all micro-batches.

    Args:
        forward_backward_func: called with keyword arguments only; must accept
            ``data_iterator`` (an iterator, ``None``, or a list of them, one per model chunk) and
            ``num_microbatches``; ``forward_only`` selects the mode. It must do only device work
            (no ``.item()``, no host branching on tensor values) and must not replace ``.grad``
            tensors (no ``zero_grad(set_to_none=True)``).
        context: the shared :class:`GraphContext` (pool, stream, teardown).
        warmup_steps: eager calls per mode before capture (>= 1).
        grad_params: parameters whose gradients this wrapper zeroes at the start of every training
            iteration, inside the graph. Their ``.grad`` is materialised once (zeros), so its
            address is fixed for this graph and for an :class:`OptimizerGraph`. The training loop
            must then not call ``optimizer.zero_grad()``. ``None``: the function zeroes grads.
        validation_buffer: device-side check state; ``reset_()`` runs first in every training
            iteration (inside the graph). ``forward_step_func`` writes to it; the loop reads it
            once after the call.
        generators: extra CUDA generators to register with the graph (the default generator is
            always graph-safe), so random ops (dropout) advance on every replay.
        clone_outputs: return clones of the outputs instead of the graph's static tensors.

    Returns of ``__call__``: the wrapped function's return value. Without ``clone_outputs`` its
    tensors are static graph outputs, overwritten by the next replay of the same mode: consume
    them (or clone) before the next call. Non-tensor values are frozen at capture.
    """

    def __init__(
        self,
        forward_backward_func: Callable[..., Any],
        *,
        context: GraphContext,
        warmup_steps: int = 3,
        on_signature_change: SignatureChangePolicy = SignatureChangePolicy.RECAPTURE,
        on_capture_failure: CaptureFailurePolicy = CaptureFailurePolicy.FAIL,
        grad_params: Iterable[torch.Tensor] | None = None,
        validation_buffer: GateSource | None = None,
        generators: Sequence[torch.Generator] = (),
        clone_outputs: bool = False,
    ) -> None:
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ValueError(
                f"--cuda-graph-warmup-steps must be an integer >= 1, got {warmup_steps!r}"
            )
        self._func = forward_backward_func
        self._context = context
        self.warmup_steps = warmup_steps
        self.on_signature_change = on_signature_change
        self.on_capture_failure = on_capture_failure
        self._grad_params = (
            None if grad_params is None else [p for p in grad_params if p.requires_grad]
        )
        self._grads: list[torch.Tensor] = []
        self._validation = validation_buffer
        self._generators = tuple(generators)
        self.clone_outputs = clone_outputs
        self._stages = {mode: _Stage(StaticInputs(context.device)) for mode in GraphMode}
        self.num_captures = 0
        context.register(self)

    # ----------------------------------------------------------------- public API
    def __call__(self, **kwargs: Any) -> Any:
        """Run one iteration (eager warm-up, capture + replay, or replay); see class docstring."""
        return self.stage(**kwargs)()

    def stage(self, **kwargs: Any) -> Callable[[], Any]:
        """Load one iteration's micro-batches into the static inputs now; the returned call
        runs it (what ``__call__`` does in one go). Lets a loop queue the input copies early
        (e.g. before a short optimizer step) and the replay later; stream order keeps the
        copies after the previous replay that read the inputs. Nothing else may call the graph
        of this mode between the two."""
        if "data_iterator" not in kwargs or "num_microbatches" not in kwargs:
            raise TypeError(
                "FullIterationGraph needs keyword arguments data_iterator and num_microbatches"
            )
        mode = GraphMode.EVALUATION if kwargs.get("forward_only", False) else GraphMode.TRAINING
        stage = self._stages[mode]
        num_microbatches = int(kwargs["num_microbatches"])
        batches = _read_microbatches(kwargs["data_iterator"], num_microbatches)
        batch_signature = signature_of(batches)
        signature = InputSignature(num_microbatches, batch_signature, _static_kwargs(kwargs))
        self._check_signature(stage, mode, signature)
        stage = self._stages[mode]  # a workload change replaces the stage
        stage.chunked = isinstance(kwargs["data_iterator"], list)
        static = stage.inputs.load(batches, batch_signature)
        stage.kwargs = dict(kwargs)
        return lambda: self._execute(stage, mode, static)

    @property
    def device(self) -> torch.device:
        """The device of the graph's context."""
        return self._context.device

    def phase(self, mode: GraphMode = GraphMode.TRAINING) -> StagePhase:
        """Life-cycle phase of one mode."""
        return self._stages[mode].phase

    def static_inputs(self, mode: GraphMode = GraphMode.TRAINING) -> Any:
        """The static micro-batch buffers of one mode (None before the first call)."""
        return self._stages[mode].inputs.buffers

    def capture_seconds(self, mode: GraphMode = GraphMode.TRAINING) -> float:
        """Wall time of the last capture of one mode (0.0 if never captured)."""
        return self._stages[mode].capture_seconds

    def reset(self, mode: GraphMode | None = None) -> None:
        """Drop graphs, outputs, static buffers and warm-up counters (one mode or both).

        Use on in-process restart and when the workload shape changes. The next call warms up
        again before capturing.
        """
        for stage_mode in [mode] if mode is not None else list(GraphMode):
            self._stages[stage_mode] = _Stage(StaticInputs(self._context.device))
        if mode is None or mode is GraphMode.TRAINING:
            self._grads = []

    # ----------------------------------------------------------------- internals
    def _check_signature(self, stage: _Stage, mode: GraphMode, signature: InputSignature) -> None:
        if stage.signature is None or stage.signature == signature:
            stage.signature = signature
            return
        reason = stage.signature.difference(signature)
        if self.on_signature_change is SignatureChangePolicy.FAIL:
            raise GraphSignatureError(
                f"{mode.value} iteration workload changed under a full-iteration CUDA graph: "
                f"{reason}; call reset() or use SignatureChangePolicy.RECAPTURE"
            )
        warnings.warn(
            f"{mode.value} iteration workload changed ({reason}): dropping the CUDA graph; "
            f"re-capturing after {self.warmup_steps} eager warm-up iterations",
            stacklevel=3,
        )
        self.reset(mode)
        self._stages[mode].signature = signature

    def _execute(self, stage: _Stage, mode: GraphMode, static: Any) -> Any:
        if stage.phase is StagePhase.CAPTURED:
            stage.graph.replay()
            return self._result(stage.outputs)
        if stage.phase is StagePhase.EAGER_FALLBACK or stage.num_eager < self.warmup_steps:
            stage.num_eager += 1
            return self._run_eager(stage, mode, static)
        return self._capture(stage, mode, static)

    def _call_kwargs(self, stage: _Stage, static: Any) -> dict[str, Any]:
        assert stage.kwargs is not None
        return dict(stage.kwargs, data_iterator=_static_iterators(static, stage.chunked))

    def _run_eager(self, stage: _Stage, mode: GraphMode, static: Any) -> Any:
        kwargs = self._call_kwargs(stage, static)
        with self._context.side_stream():
            return self._body(mode, kwargs)

    def _body(self, mode: GraphMode, kwargs: dict[str, Any]) -> Any:
        """The captured region: reset checks, zero grads, forward-backward."""
        if mode is GraphMode.TRAINING:
            if self._validation is not None:
                self._validation.reset_()
            grads = self._training_grads()
            if grads:
                torch._foreach_zero_(grads)
        return self._func(**kwargs)

    def _training_grads(self) -> list[torch.Tensor]:
        if self._grad_params is None:
            return []
        if not self._grads:
            for param in self._grad_params:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
            self._grads = [param.grad for param in self._grad_params]  # type: ignore[misc]
        for param, grad in zip(self._grad_params, self._grads):
            if param.grad is not grad:
                raise RuntimeError(
                    "a parameter's .grad tensor was replaced (zero_grad(set_to_none=True)?); "
                    "with grad_params the graph owns gradient zeroing: do not call zero_grad()"
                )
        return self._grads

    def _capture(self, stage: _Stage, mode: GraphMode, static: Any) -> Any:
        kwargs = self._call_kwargs(stage, static)
        logger.info("capturing the %s iteration CUDA graph", mode.value)
        graph = self._context.new_graph()
        start = time.perf_counter()
        try:
            with self._context.capture(graph, self._generators):
                outputs = self._body(mode, kwargs)
        except Exception as err:
            del graph
            if self.on_capture_failure is CaptureFailurePolicy.FAIL:
                raise RuntimeError(
                    f"capture of the {mode.value} iteration CUDA graph failed: {err}. "
                    "Captured code must not sync with the host (.item(), printing tensors, "
                    "data-dependent shapes)"
                ) from err
            warnings.warn(
                f"capture of the {mode.value} iteration CUDA graph failed ({err}); "
                "running this mode eagerly from now on",
                stacklevel=3,
            )
            stage.phase = StagePhase.EAGER_FALLBACK
            return self._run_eager(stage, mode, static)
        stage.capture_seconds = time.perf_counter() - start
        stage.graph, stage.outputs, stage.phase = graph, outputs, StagePhase.CAPTURED
        self.num_captures += 1
        logger.info(
            "captured the %s graph in %.3f s", mode.value, stage.capture_seconds, extra=NOTICE
        )
        if _has_frozen_leaves(outputs):
            warnings.warn(
                "non-tensor values returned by the captured function are frozen at capture",
                stacklevel=3,
            )
        # Capture records the work without running it: replay once so this call is a real step.
        graph.replay()
        return self._result(outputs)

    def _result(self, outputs: Any) -> Any:
        return _clone_tensors(outputs) if self.clone_outputs else outputs
