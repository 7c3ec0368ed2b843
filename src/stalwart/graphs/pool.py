"""Graph memory pool and capture side stream shared by every graph of one training run.

One private pool (``torch.cuda.graph_pool_handle()``) and one side stream serve the
full-iteration graphs (training and evaluation) and the optimizer graph, so graph memory
is reserved once instead of once per graph and per stream. The :class:`GraphContext` owns
both; there is no module-level state. ``teardown()`` resets every graph registered with
the context (on in-process restart, at the end of training), after which the context is
unusable.

Capture, warm-up and stream handling are methods of the context so that CPU tests can
substitute a fake backend (see ``tests/graphs/graphs_fake_backend.py``) and exercise the
warm-up -> capture -> replay state machines without a GPU.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch

from stalwart.distributed import collectives

logger = logging.getLogger(__name__)

CPU_DEVICE_MESSAGE = (
    "--cuda-graph-impl full_iteration requires a CUDA device (got device {device!r}); "
    "use --cuda-graph-impl none on CPU"
)


class CaptureErrorMode(enum.Enum):
    """``capture_error_mode`` of ``torch.cuda.graph``; ``THREAD_LOCAL`` limits errors to our
    thread."""

    GLOBAL = "global"
    THREAD_LOCAL = "thread_local"
    RELAXED = "relaxed"


class Resettable(Protocol):
    """Anything that holds graphs and can drop them (``FullIterationGraph``, ``OptimizerGraph``)."""

    def reset(self) -> None: ...


class GraphContext:
    """Owns the private graph memory pool and the single capture side stream.

    Contract: create one per training run (after the model is on ``device``), pass it to every
    :class:`~stalwart.graphs.FullIterationGraph` / :class:`~stalwart.graphs.OptimizerGraph`,
    and call :meth:`teardown` once when the run (or an in-process restart attempt) ends.

    Raises ``ValueError`` when ``device`` is not a CUDA device.
    """

    def __init__(
        self,
        device: torch.device,
        *,
        capture_error_mode: CaptureErrorMode = CaptureErrorMode.THREAD_LOCAL,
        barrier: Callable[[], None] | None = None,
    ) -> None:
        self.device = torch.device(device)
        self._check_device()
        self.capture_error_mode = capture_error_mode
        # A barrier before and after every capture, as Megatron: all ranks capture together
        # (NCCL kernels in the graph need every peer capturing the same sequence) and none
        # replays before all have finished. None: the world barrier, a no-op without a group.
        self._barrier = barrier
        # Weak: a graph dropped without teardown (a failed test, an attempt that raised) is freed
        # with its captured graphs at once, not kept in a cycle with its context until a full
        # collection (which may come during a later capture, or at interpreter shutdown).
        self._owners: list[weakref.ref[Resettable]] = []
        self._closed = False
        self._stream: Any = self._new_stream()
        self._overlap_stream: Any = None  # created on first use (overlapped optimizer replay)
        self._pool: Any = self._new_pool()

    # ----------------------------------------------------------------- backend seams
    def _check_device(self) -> None:
        if self.device.type != "cuda":
            raise ValueError(CPU_DEVICE_MESSAGE.format(device=str(self.device)))
        if not torch.cuda.is_available():
            raise ValueError(
                "--cuda-graph-impl full_iteration requires a CUDA device, but CUDA is not available"
            )

    def _new_stream(self) -> Any:
        return torch.cuda.Stream(device=self.device)

    def _new_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def new_graph(self) -> Any:
        """A fresh, empty ``torch.cuda.CUDAGraph``."""
        self._require_open()
        return torch.cuda.CUDAGraph()

    def synchronize(self) -> None:
        """Wait for the device (capture boundaries only, never per iteration)."""
        torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def side_stream(self) -> Iterator[None]:
        """Run the body on the capture stream, ordered after and before the current stream.

        Warm-up iterations must run on the same stream as capture: autograd's AccumulateGrad
        nodes remember their last stream and a mismatch breaks capture
        (``cudaErrorStreamCaptureImplicit``).
        """
        self._require_open()
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            yield
        current.wait_stream(self._stream)

    @contextlib.contextmanager
    def overlapped(self) -> Iterator[None]:
        """Run the body on a second stream after the current stream's work, without joining back.

        Work enqueued on the current stream afterwards (e.g. the validation read) does not wait
        for the body; :meth:`join_overlapped` must run before anything touches what the body
        writes. Used to replay the optimizer graph while the host reads the iteration's checks.
        """
        self._require_open()
        if self._overlap_stream is None:
            self._overlap_stream = self._new_stream()
        self._overlap_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._overlap_stream):
            yield

    def on_overlap_stream(self) -> contextlib.AbstractContextManager[Any]:
        """Make :meth:`overlapped`'s stream current, with no waits (to record an event after
        the work queued there); the current stream when there is none."""
        if self.device.type != "cuda" or self._overlap_stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self._overlap_stream)

    def join_overlapped(self) -> None:
        """Make the current stream wait (on the device, no host sync) for :meth:`overlapped`
        work."""
        if self._overlap_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._overlap_stream)

    @contextlib.contextmanager
    def capture(self, graph: Any, generators: Sequence[torch.Generator] = ()) -> Iterator[None]:
        """Capture the body into ``graph`` on the shared stream and pool.

        The device's default CUDA generator is always graph-safe; ``generators`` lists extra
        generators (e.g. an RNG tracker's per-rank generators) registered with the graph so that
        each replay advances them. Raises ``RuntimeError`` if extras are given but this torch
        cannot register them.
        """
        self._require_open()
        self._register_generators(graph, generators)
        self.maybe_barrier()
        self.synchronize()
        with (
            _override_stale_capture_stream(),
            torch.cuda.graph(
                graph,
                pool=self._pool,
                stream=self._stream,
                capture_error_mode=self.capture_error_mode.value,
            ),
        ):
            yield
        self.synchronize()
        self.maybe_barrier()

    @staticmethod
    def _register_generators(graph: Any, generators: Sequence[torch.Generator]) -> None:
        if not generators:
            return
        register = getattr(graph, "register_generator_state", None)
        if register is None:
            raise RuntimeError(
                "this torch cannot register extra RNG generators with a CUDA graph "
                "(CUDAGraph.register_generator_state is missing; needs torch >= 2.5): their "
                "random streams would repeat on every replay"
            )
        for gen in generators:
            register(gen)

    # ----------------------------------------------------------------- lifecycle
    def maybe_barrier(self) -> None:
        """The barrier given at construction, else the world barrier (no-op without a group)."""
        if self._barrier is not None:
            self._barrier()
        else:
            collectives.barrier()

    def register(self, owner: Resettable) -> None:
        """Track a graph owner so :meth:`teardown` can drop its graphs (weakly: an owner
        nobody else holds is gone, and its graphs with it)."""
        self._require_open()
        self._owners = [ref for ref in self._owners if ref() is not None]
        self._owners.append(weakref.ref(owner))

    @property
    def closed(self) -> bool:
        """True after :meth:`teardown`."""
        return self._closed

    def teardown(self) -> None:
        """Reset every registered owner still alive, drop the pool and stream. Idempotent.

        Call on in-process restart and at the end of training: a graph captured against freed
        buffers or old communicators must never be replayed.
        """
        if self._closed:
            return
        for ref in self._owners:
            owner = ref()
            if owner is not None:
                owner.reset()
        self._owners.clear()
        self.join_overlapped()
        self._pool = None
        self._stream = None
        self._overlap_stream = None
        self._closed = True

    def _require_open(self) -> None:
        if self._closed:
            raise RuntimeError("GraphContext was torn down; create a new one")


@contextlib.contextmanager
def _override_stale_capture_stream() -> Iterator[None]:
    """Let autograd re-home AccumulateGrad nodes onto the capture stream, where torch allows it."""
    setter = getattr(torch.autograd.graph, "set_override_stale_capture_stream", None)
    if setter is None:
        # torch <= 2.11: warm-up on the capture stream (GraphContext.side_stream) avoids the issue.
        yield
        return
    setter(True)
    try:
        yield
    finally:
        # Process-global flag: restore the process-initial state.
        setter(False)
