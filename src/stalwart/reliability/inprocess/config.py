"""Flags of in-process restart (``--inprocess-*``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class RestartGranularity(enum.StrEnum):
    """``--inprocess-granularity``: restart only the faulty rank's process state, or its node's."""

    RANK = "rank"
    NODE = "node"


@dataclass(kw_only=True)
class InProcessConfig:
    """In-process restart settings; off unless ``inprocess_restart``."""

    inprocess_restart: bool = False
    inprocess_max_iterations: int = 3
    inprocess_soft_timeout: float = 60.0
    inprocess_hard_timeout: float = 90.0
    inprocess_heartbeat_interval: float = 1.0
    inprocess_heartbeat_timeout: float | None = None  # None: --inprocess-soft-timeout
    inprocess_barrier_timeout: float = 300.0
    inprocess_monitor_thread_interval: float = 0.05
    # Megatron's --inprocess-empty-cuda-cache: the restarter always empties the cache.
    inprocess_empty_cuda_cache: bool = False
    inprocess_granularity: RestartGranularity | str = RestartGranularity.RANK

    def __post_init__(self) -> None:
        try:
            self.inprocess_granularity = RestartGranularity(self.inprocess_granularity)
        except ValueError:
            raise ValueError(
                f"--inprocess-granularity: got {self.inprocess_granularity!r}, allowed: rank, node"
            ) from None
        if self.inprocess_max_iterations < 1:
            raise ValueError(
                f"--inprocess-max-iterations must be >= 1 (got {self.inprocess_max_iterations})"
            )
        if not 0 < self.inprocess_heartbeat_interval < self.inprocess_soft_timeout:
            raise ValueError(
                "--inprocess-heartbeat-interval must be > 0 and < --inprocess-soft-timeout"
            )
        if not self.inprocess_soft_timeout < self.inprocess_hard_timeout:
            raise ValueError("--inprocess-soft-timeout must be < --inprocess-hard-timeout")
        timeout = self.inprocess_heartbeat_timeout
        if timeout is not None and not timeout > self.inprocess_heartbeat_interval:
            raise ValueError(
                "--inprocess-heartbeat-timeout must be > --inprocess-heartbeat-interval"
            )
        if not self.inprocess_barrier_timeout > 0:
            raise ValueError("--inprocess-barrier-timeout must be > 0")
        if not 0 < self.inprocess_monitor_thread_interval < self.inprocess_soft_timeout:
            raise ValueError(
                "--inprocess-monitor-thread-interval must be > 0 and < --inprocess-soft-timeout"
            )
