"""A profiling window over chosen iterations (``--profile``), Megatron's flags and window.

``--profile --profile-step-start S --profile-step-end E`` traces the ``E - S`` iterations that
start after ``S`` completed iterations, i.e. the iterations the log prints as ``S+1 .. E``, on the
ranks in ``--profile-ranks`` (default: rank 0). Two back ends:

* ``--use-pytorch-profiler``: ``torch.profiler`` (CPU, and CUDA kernels on a GPU). At the end of the
  window each profiled rank writes a Chrome/Perfetto trace
  ``<dir>/trace_rank<r>_iters<S+1>-<E>.json`` and a text table of the top operators next to it.
  The window opens at the first iteration inside ``[S, E)``, so a run resumed in the middle of the
  window still profiles its remaining iterations.
* otherwise (a GPU): ``cudaProfilerStart``/``cudaProfilerStop`` around the window, for
  ``nsys profile --capture-range=cudaProfilerApi``. Without CUDA, choose the PyTorch profiler.

Disabled is `NullProfilerWindow` (no per-iteration cost). Usage in a hand-written loop::

    window = ProfilerConfig(profile=True, use_pytorch_profiler=True, profile_dir="prof").build(
        rank=rank, world_size=world_size, device=device, run_dir=None)
    for completed in range(start, train_iters):
        window.on_iteration_start(completed)
        step.run(completed + 1)                        # numbered from 1, as logged
        window.on_iteration_end(completed + 1)
    window.close()
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from stalwart.log_notice import NOTICE
from stalwart.observability.sinks import flag_name

logger = logging.getLogger(__name__)


class ProfilerWindow(Protocol):
    """What the loop calls; iterations are counts of *completed* iterations."""

    def on_iteration_start(self, completed: int) -> None: ...
    def on_iteration_end(self, completed: int) -> None: ...
    def close(self) -> None: ...


class NullProfilerWindow:
    """Profiling off."""

    def on_iteration_start(self, completed: int) -> None: ...
    def on_iteration_end(self, completed: int) -> None: ...
    def close(self) -> None: ...


def validate_profile_window(start: int, end: int, ranks: Sequence[int]) -> None:
    """``ValueError`` naming the flag for a window that cannot be profiled."""
    if start < 0:
        raise ValueError(f"--profile-step-start must be >= 0 (got {start})")
    if end <= start:
        raise ValueError(
            f"--profile-step-end must be > --profile-step-start (got start {start}, end {end})"
        )
    if not ranks or any(r < 0 for r in ranks):
        raise ValueError(f"--profile-ranks must be rank numbers >= 0 (got {list(ranks)})")


class TorchProfilerWindow:
    """``torch.profiler`` over completed-iteration counts ``[start, end)``; exports at the end."""

    def __init__(self, start: int, end: int, out_dir: str, rank: int, device: torch.device) -> None:
        self.start, self.end = start, end
        self.out_dir, self.rank, self.device = out_dir, rank, device
        self._profiler: Any = None
        self._label: Any = None  # the open "iteration N" range in the trace
        self._first: int | None = None
        self.trace_path: str | None = None

    def on_iteration_start(self, completed: int) -> None:
        if (
            self._profiler is None
            and self.trace_path is None
            and self.start <= completed < self.end
        ):
            self._begin(completed)
        if self._profiler is not None:
            # Each iteration is a named range in the trace, numbered as the log line.
            self._label = torch.profiler.record_function(f"iteration {completed + 1}")
            self._label.__enter__()

    def _begin(self, completed: int) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(activities=activities, record_shapes=True)
        self._profiler.start()
        self._first = completed + 1
        logger.info(
            "profiler: tracing iterations %d-%d on rank %d", completed + 1, self.end, self.rank
        )

    def on_iteration_end(self, completed: int) -> None:
        self._end_label()
        if self._profiler is not None and completed >= self.end:
            self._export(completed)

    def close(self) -> None:
        """An exit inside the window still writes what was traced."""
        self._end_label()
        if self._profiler is not None:
            self._export(None)

    def _end_label(self) -> None:
        label, self._label = self._label, None
        if label is not None:
            label.__exit__(None, None, None)

    def _export(self, last: int | None) -> None:
        profiler, self._profiler = self._profiler, None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # Deliberate sync: the window's kernels must end
        profiler.stop()
        os.makedirs(self.out_dir, exist_ok=True)
        span = f"{self._first}-{last if last is not None else 'exit'}"
        path = os.path.join(self.out_dir, f"trace_rank{self.rank}_iters{span}.json")
        profiler.export_chrome_trace(path)
        sort_by = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        table = profiler.key_averages().table(sort_by=sort_by, row_limit=25)
        with open(os.path.join(self.out_dir, f"ops_rank{self.rank}_iters{span}.txt"), "w") as f:
            f.write(table + "\n")
        self.trace_path = path
        logger.info("profiler: trace written to %s", path, extra=NOTICE)


class CudaProfilerRangeWindow:
    """``cudaProfilerStart/Stop`` around ``[start, end)`` (an nsys capture range)."""

    def __init__(self, start: int, end: int, device: torch.device) -> None:
        self.start, self.end, self.device = start, end, device
        self._running = False
        self._done = False

    def on_iteration_start(self, completed: int) -> None:
        if not self._running and not self._done and self.start <= completed < self.end:
            torch.cuda.synchronize(self.device)  # Deliberate sync: earlier work stays outside
            torch.cuda.cudart().cudaProfilerStart()
            self._running = True

    def on_iteration_end(self, completed: int) -> None:
        if self._running and completed >= self.end:
            self.close()

    def close(self) -> None:
        if self._running:
            torch.cuda.synchronize(self.device)  # Deliberate sync: the window's kernels must end
            torch.cuda.cudart().cudaProfilerStop()
            self._running, self._done = False, True


@dataclass(kw_only=True, frozen=True)
class ProfilerConfig:
    """``--profile``: a profiler window over iterations ``[profile_step_start,
    profile_step_end)`` on ``profile_ranks``; ``use_pytorch_profiler`` writes a torch trace to
    ``profile_dir`` (default ``<run dir>/profile``), else ``cudaProfilerStart/Stop`` (nsys)."""

    profile: bool = False
    profile_step_start: int = 10
    profile_step_end: int = 12
    profile_ranks: list[int] = field(default_factory=lambda: [0])
    use_pytorch_profiler: bool = False
    profile_dir: str | None = None

    def __post_init__(self) -> None:
        if any(isinstance(r, bool) or not isinstance(r, int) for r in self.profile_ranks):
            raise ValueError(
                f"--profile-ranks must be rank numbers >= 0 (got {self.profile_ranks})"
            )
        if self.profile:
            validate_profile_window(
                self.profile_step_start, self.profile_step_end, self.profile_ranks
            )

    def check(
        self, device: torch.device, world_size: int, spell: Callable[[str], str] | None = None
    ) -> None:
        """The window can be opened in a job of ``world_size`` ranks on ``device`` (a
        ``ValueError`` naming the settings as ``spell`` writes a field's name, else the flag)."""
        if not self.profile:
            return
        name = spell or flag_name
        if not any(r < world_size for r in self.profile_ranks):
            raise ValueError(
                f"{name('profile_ranks')} {self.profile_ranks}: no such rank in a job of "
                f"{world_size}"
            )
        if not self.use_pytorch_profiler and device.type != "cuda":
            raise ValueError(
                f"{name('profile')} without {name('use_pytorch_profiler')} needs a CUDA device "
                "(it opens an nsys capture range); turn "
                f"{name('use_pytorch_profiler')} on to trace on {device.type}"
            )

    def build(
        self, *, rank: int, world_size: int, device: torch.device, run_dir: str | None
    ) -> ProfilerWindow:
        """This rank's window: a null object unless ``profile`` and ``rank`` is profiled."""
        if not self.profile:
            return NullProfilerWindow()
        self.check(device, world_size)
        ranks, start, end = self.profile_ranks, self.profile_step_start, self.profile_step_end
        if rank not in ranks:
            return NullProfilerWindow()
        if self.use_pytorch_profiler:
            out_dir = self.profile_dir or os.path.join(run_dir or ".", "profile")
            return TorchProfilerWindow(start, end, out_dir, rank, device)
        return CudaProfilerRangeWindow(start, end, device)
