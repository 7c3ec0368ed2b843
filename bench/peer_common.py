"""What every peer of ``bench/peers.py`` shares: the run's spec, the model shape, the clock that
times its windows, the profiler window, the synthetic token windows and the child's entry.

A peer is a function ``run(spec, clock) -> dict`` (its mode and notes) in one of the sibling
modules named by :data:`PEER_MODULES`; it calls ``clock.before(i)`` and ``clock.after(i)``
around iteration ``i`` (1-based) from its trainer's own per-step hook.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

# peer -> (module, function): imported only in that peer's child process.
PEER_MODULES = {
    "stalwart": ("peer_trainers", "run_stalwart"),
    "stalwart-bf16-residual": ("peer_trainers", "run_stalwart_bf16_residual"),
    "hf": ("peer_trainers", "run_hf"),
    "torchtitan": ("peer_titan", "run_trainer"),
    "torchtitan-fallback": ("peer_titan", "run_fallback"),
}


@dataclasses.dataclass
class Spec:
    """One comparison: the model (stalwart's flags for it), the batch, what is timed."""

    model_flags: list[str]
    micro_batch_size: int
    global_batch_size: int
    warmup: int
    iters: int
    window: int
    profile_iters: int
    log_interval: int
    lr: float
    device: str
    compile: bool
    tokens_path: str
    work_dir: str
    profile_peers: list[str] = dataclasses.field(default_factory=list)
    seed: int = 1234

    def profiles(self, peer: str) -> bool:
        """Whether ``peer`` is profiled after its timed iterations."""
        return self.profile_iters > 0 and peer in self.profile_peers

    @property
    def timed_end(self) -> int:
        """The last timed iteration (1-based)."""
        return self.warmup + self.iters

    @property
    def total_iterations(self) -> int:
        """Warm-up, timed, profiled, and one more so that the profiled ones are not the last."""
        return self.timed_end + self.profile_iters + 1

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // self.micro_batch_size


def model_config(spec: Spec) -> Any:
    """The ``GPTConfig`` of ``spec.model_flags`` (every peer builds this shape)."""
    from stalwart.cli.args import parse_train_args
    from stalwart.config.run import build_run_config

    return build_run_config(parse_train_args(spec.model_flags), spec.model_flags).model


class TokenWindows(torch.utils.data.Dataset):
    """Window ``i`` of the token file: ``seq + 1`` uint32 ids from ``i * seq`` (stalwart's
    ``TokenDataset`` windows), as int64."""

    def __init__(self, path: str, seq_length: int) -> None:
        self.tokens = np.memmap(path, dtype=np.uint32, mode="r")
        self.seq = seq_length

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq

    def window(self, index: int) -> torch.Tensor:
        start = index * self.seq
        return torch.from_numpy(self.tokens[start : start + self.seq + 1].astype(np.int64))

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = self.window(index)[:-1]
        return {"input_ids": ids, "labels": ids.clone()}  # HF shifts the labels itself


class Clock:
    """Times a peer: the first iteration and the steady start (seconds since the child was
    launched: ``PEERS_T0``), the windows after the warm-up (ms per iteration, each from a
    device sync to a device sync), peak memory at the end of the timed iterations, and the
    profiler window after them (``profile=False``: the peer profiles itself)."""

    def __init__(
        self,
        spec: Spec,
        trace_path: Path,
        profile: bool = True,
        on_window: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.spec = spec
        self.on_window = on_window  # each new window: what is measured so far (a timeout keeps it)
        self.device = torch.device(spec.device)
        self.t0 = float(os.environ.get("PEERS_T0", time.time()))
        self.trace_path = trace_path
        self.profile = profile
        self.windows_ms: list[float] = []
        self.first_iteration_s: float | None = None
        self.steady_s: float | None = None
        self.memory: dict[str, float] = {}
        self._mark = 0.0
        self._profiler: Any = None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def before(self, i: int) -> None:
        """Iteration ``i`` (1-based) starts: opens the profiler window at its first iteration."""
        if self.profile and i == self.spec.timed_end + 1 and self._profiler is None:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU]
            activities += [ProfilerActivity.CUDA] if self.device.type == "cuda" else []
            self._sync()
            self._profiler = profile(activities=activities)
            self._profiler.__enter__()

    def after(self, i: int) -> None:
        """Iteration ``i`` (1-based) ended on the host."""
        spec = self.spec
        if i == 1:
            self._sync()
            self.first_iteration_s = time.time() - self.t0
        if i == spec.warmup:
            self._sync()
            self.steady_s = time.time() - self.t0
            self._mark = time.perf_counter()
        elif spec.warmup < i <= spec.timed_end and (i - spec.warmup) % spec.window == 0:
            self._sync()
            now = time.perf_counter()
            self.windows_ms.append((now - self._mark) * 1e3 / spec.window)
            self._mark = now
        if i == spec.timed_end:
            self.memory = peak_memory(self.device)
        if self.on_window is not None and spec.warmup < i <= spec.timed_end:
            self.on_window(self.result())
        if self._profiler is not None and i == spec.timed_end + spec.profile_iters:
            self._sync()
            self._profiler.__exit__(None, None, None)
            self._profiler.export_chrome_trace(str(self.trace_path))
            self._profiler = None

    def result(self) -> dict[str, Any]:
        return {
            "windows_ms": self.windows_ms,
            "first_iteration_s": self.first_iteration_s,
            "steady_s": self.steady_s,
            **self.memory,
        }


def peak_memory(device: torch.device) -> dict[str, float]:
    if device.type != "cuda":
        return {}
    return {
        "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30,
        "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30,
    }


def environment(spec: Spec) -> dict[str, Any]:
    info: dict[str, Any] = {"torch": torch.__version__}
    if spec.device == "cuda" and torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
    return info


def run_child(peer: str, spec_path: Path, result_path: Path) -> int:
    """The child's entry: run ``peer``; its result (or its error) goes to ``result_path``."""
    spec = Spec(**json.loads(spec_path.read_text()))
    result: dict[str, Any] = {"peer": peer, **environment(spec)}
    trace = spec_path.parent / "trace.json"

    def partial(measured: dict[str, Any]) -> None:
        result_path.write_text(json.dumps({**result, **measured, "partial": True}, default=str))

    profile = spec.profiles(peer) and not peer.startswith("stalwart")
    clock = Clock(spec, trace, profile=profile, on_window=partial)
    module, function = PEER_MODULES[peer]
    try:
        run = getattr(importlib.import_module(module), function)
        result.update(run(spec, clock) or {})
    except BaseException as exc:  # the table names what stopped the peer
        result["error"] = f"{type(exc).__name__}: {exc}".strip()[:2000]
        result["traceback"] = traceback.format_exc()[-4000:]
        traceback.print_exc()
    result.update(clock.result())
    result.setdefault("trace", str(trace))
    result_path.write_text(json.dumps(result, default=str))
    return 0 if clock.windows_ms else 1
