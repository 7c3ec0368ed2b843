"""Health check and memory accounting between in-process restart attempts."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

HealthCheck = Callable[[torch.device], None]


class HealthCheckFailed(RuntimeError):
    """The device of this rank did not compute correctly (or not in time)."""


def check_device_computes(device: torch.device) -> None:
    """A small matmul on ``device`` must give the exact expected result.

    ``ones(n, n) @ ones(n, n)`` is ``n`` everywhere and exactly representable, so any mismatch means
    the device (or its context) is broken. On CUDA this also synchronizes, which surfaces a sticky
    error left behind by the failed attempt.
    """
    n = 64
    a = torch.ones(n, n, device=device)
    # Deliberate sync: the health check must observe the device's result.
    got = (a @ a).to("cpu")
    if not torch.equal(got, torch.full((n, n), float(n))):
        raise HealthCheckFailed(f"device {device} computed a wrong matmul result")
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_health_checks(
    checks: Sequence[HealthCheck], device: torch.device, timeout_s: float = 30.0
) -> str | None:
    """Run ``checks`` on a helper thread; None when all pass, else why not.

    The thread bounds the time a hung device can take (it is left behind as a daemon thread; the
    rank then exits, so the launcher replaces it).
    """
    outcome: list[str | None] = []

    def body() -> None:
        try:
            for check in checks:
                check(device)
            outcome.append(None)
        except Exception as exc:
            outcome.append(f"{type(exc).__name__}: {exc}")

    thread = threading.Thread(target=body, name="stalwart-health-check", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not outcome:
        return f"health check did not finish within {timeout_s:.0f}s"
    return outcome[0]


@dataclass(frozen=True)
class MemorySample:
    """Process memory after a finalize: host RSS and (on CUDA) device bytes held by the
    allocator."""

    rss_bytes: int
    device_allocated_bytes: int = 0
    device_reserved_bytes: int = 0

    @property
    def rss_mb(self) -> float:
        return self.rss_bytes / 2**20

    def describe(self) -> str:
        text = f"RSS {self.rss_mb:.1f} MB"
        if self.device_reserved_bytes:
            text += (
                f", device allocated {self.device_allocated_bytes / 2**20:.1f} MB"
                f", reserved {self.device_reserved_bytes / 2**20:.1f} MB"
            )
        return text


def rss_bytes() -> int:
    """Resident set size of this process (psutil, else /proc/self/statm)."""
    try:
        import psutil
    except ImportError:
        with open("/proc/self/statm", encoding="ascii") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    return int(psutil.Process().memory_info().rss)


def sample_memory(device: torch.device) -> MemorySample:
    if device.type == "cuda":
        return MemorySample(
            rss_bytes(), torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
        )
    return MemorySample(rss_bytes())


def release_memory(device: torch.device) -> None:
    """Collect garbage, return cached device blocks and free heap pages to the OS."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    _malloc_trim()


def _malloc_trim() -> None:
    """glibc keeps freed arenas mapped; ``malloc_trim(0)`` hands them back so RSS reflects use."""
    name = ctypes.util.find_library("c")
    if not name:
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(name).malloc_trim(0)
