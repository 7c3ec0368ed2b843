"""ETTR at scale: the effective training time ratio a job's measured recovery gives at N GPUs.

ETTR (effective training time ratio) is productive training time over wall-clock time, the ratio
Llama 3 and ByteRobust report. This module projects it from what one run measured, under a
stated failure model. Pure functions of numbers; `stalwart.observability.goodput.ettr_report`
reads them from a ledger (``stalwart goodput --project``).

The model (first order; the form of the expected-ETTR estimate of Kokolis et al., "Revisiting
Reliability in Large-Scale Machine Learning Research Clusters", HPCA 2025, arXiv:2410.21680)::

    MTTF(N) = G / N                        failures independent, rate proportional to GPUs
    C       = detection + teardown + restart + recompile + lost work     seconds per failure
    lost work = dt / 2                     a failure lands uniformly inside a checkpoint interval
    ETTR(N) = (1 - C / MTTF(N)) / (1 + w / dt)                           clipped to [0, 1]

with ``dt`` the checkpoint interval in seconds of training and ``w`` the blocking seconds of one
save. In wall time ``T`` the job trains ``P`` seconds, saves ``P / dt`` times (``P w / dt``
seconds) and fails ``T / MTTF`` times, ``C`` seconds each: ``T = P (1 + w/dt) + T C / MTTF``.
Startup, evaluation and straggler waits are outside the model (they do not grow with failures).

Example: 10 minutes per failure plus a 30-minute checkpoint interval, a 10-second save, at the
default failure model's 16,384 GPUs (MTTF 1.84 h)::

    >>> cost = RecoveryCost(detection_s=60, teardown_s=120, restart_s=300, recompile_s=120,
    ...                     lost_work_s=900, checkpoint_write_s=10, checkpoint_interval_s=1800)
    >>> mttf = META_RESEARCH_CLUSTERS.mttf_s(16_384)
    >>> round(mttf / 3600, 2), round(expected_ettr(cost, mttf), 4)
    (1.84, 0.7693)
    >>> halved = cost.halved("restart")      # what a 150 s faster start-up is worth there
    >>> round(100 * (expected_ettr(halved, mttf) - expected_ettr(cost, mttf)), 2)
    2.25
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

__all__ = [
    "META_RESEARCH_CLUSTERS",
    "PROJECTED_COMPONENTS",
    "FailureModel",
    "RecoveryCost",
    "ScalePoint",
    "Sensitivity",
    "expected_ettr",
    "project",
    "sensitivity",
    "young_interval_s",
]

SOURCE = (
    'Kokolis et al., "Revisiting Reliability in Large-Scale Machine Learning Research Clusters", '
    "HPCA 2025, arXiv:2410.21680"
)
# The components of one failure's cost, then the checkpoints' own (``w``).
PROJECTED_COMPONENTS = (
    "detection",
    "teardown",
    "restart",
    "recompile",
    "lost work",
    "checkpoint write",
)
_FIELDS = {
    "detection": "detection_s",
    "teardown": "teardown_s",
    "restart": "restart_s",
    "recompile": "recompile_s",
    "lost work": "lost_work_s",
    "checkpoint write": "checkpoint_write_s",
}


@dataclass(frozen=True)
class FailureModel:
    """Failures as a Poisson process whose rate grows in proportion to the GPU count:
    ``MTTF(N) = gpu_hours_per_failure / N``. ``source`` says where the constant comes from."""

    gpu_hours_per_failure: float
    source: str

    def __post_init__(self) -> None:
        g = self.gpu_hours_per_failure
        if not (math.isfinite(g) and g > 0):
            raise ValueError(f"GPU-hours per failure must be a finite number > 0, got {g!r}")

    @classmethod
    def anchored(cls, mttf_hours: float, gpus: int, source: str) -> FailureModel:
        """The model with ``MTTF(gpus) = mttf_hours`` (a measured or published point)."""
        return cls(mttf_hours * gpus, source)

    def mttf_s(self, gpus: int) -> float:
        """Mean time to failure of a job on ``gpus`` GPUs, in seconds."""
        return 3600.0 * self.gpu_hours_per_failure / gpus

    def describe(self) -> str:
        return f"MTTF(N) = {self.gpu_hours_per_failure:,.0f} GPU-hours / N ({self.source})"


# The paper projects 0.23 h for 131,072 GPUs (and 1.8 h for 16,384) from its fitted failure rate
# per node; it measured 7.9 h for 1,024-GPU jobs, shorter than this inverse law gives there
# (29.5 h): ``FailureModel.anchored(7.9, 1024, ...)`` (``--mttf 7.9@1024``) is the pessimistic
# curve through that point.
META_RESEARCH_CLUSTERS = FailureModel.anchored(
    0.23, 131_072, f"0.23 h at 131,072 GPUs, inverse in the GPU count: {SOURCE}"
)


@dataclass(frozen=True)
class RecoveryCost:
    """Seconds one failure costs, by component, and the checkpoints' own cost: ``w`` =
    ``checkpoint_write_s`` blocking seconds per save every ``checkpoint_interval_s`` seconds of
    training (None: no periodic saves known, the ``w / dt`` term is 0). ``lost_work_s`` is the
    expected lost work per failure (``dt / 2``)."""

    detection_s: float
    teardown_s: float
    restart_s: float
    recompile_s: float
    lost_work_s: float
    checkpoint_write_s: float = 0.0
    checkpoint_interval_s: float | None = None

    def __post_init__(self) -> None:
        for name in (*_FIELDS.values(), "checkpoint_interval_s"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")

    @property
    def per_failure_s(self) -> float:
        """``C``: detection + teardown + restart + recompile + lost work."""
        return (
            self.detection_s
            + self.teardown_s
            + self.restart_s
            + self.recompile_s
            + (self.lost_work_s)
        )

    def seconds(self) -> dict[str, float]:
        """Seconds by component (:data:`PROJECTED_COMPONENTS`)."""
        return {name: getattr(self, attr) for name, attr in _FIELDS.items()}

    def halved(self, component: str) -> RecoveryCost:
        """The same cost with one component (a :data:`PROJECTED_COMPONENTS` name) halved."""
        attr = _FIELDS[component]
        return dataclasses.replace(self, **{attr: getattr(self, attr) / 2})


def _checkpoint_factor(cost: RecoveryCost) -> float:
    """``1 + w / dt`` (1 without a checkpoint interval)."""
    dt = cost.checkpoint_interval_s
    return 1.0 + cost.checkpoint_write_s / dt if dt else 1.0


def expected_ettr(cost: RecoveryCost, mttf_s: float) -> float:
    """``ETTR = (1 - C / MTTF) / (1 + w / dt)``, clipped to ``[0, 1]`` (0: a failure comes
    before the last one is recovered from, on average). See the module docstring."""
    if not mttf_s > 0:
        raise ValueError(f"MTTF must be > 0 s, got {mttf_s!r}")
    return max(1.0 - cost.per_failure_s / mttf_s, 0.0) / _checkpoint_factor(cost)


def young_interval_s(write_s: float, mttf_s: float) -> float:
    """Young's checkpoint interval ``sqrt(2 w MTTF)``: it minimises ``w / dt + dt / (2 MTTF)``
    (the saves' cost plus the expected lost work), to first order."""
    return math.sqrt(2.0 * write_s * mttf_s)


@dataclass(frozen=True)
class Sensitivity:
    """How ETTR at one scale moves with one component: ``halved`` = ETTR with the component
    halved, ``per_second`` = d ETTR / d component (both as fractions, not percent)."""

    component: str
    seconds: float
    halved: float
    per_second: float


def sensitivity(cost: RecoveryCost, mttf_s: float) -> list[Sensitivity]:
    """Each component's :class:`Sensitivity` (the others held). The derivatives, from the
    formula: ``-1 / (MTTF (1 + w/dt))`` for a per-failure component, ``-(1 - C/MTTF) /
    (dt (1 + w/dt)^2)`` for ``w``; 0 where ETTR is clipped to 0."""
    factor = _checkpoint_factor(cost)
    alive = 1.0 - cost.per_failure_s / mttf_s
    dt = cost.checkpoint_interval_s
    out = []
    for name, seconds in cost.seconds().items():
        if alive <= 0:
            slope = 0.0
        elif name == "checkpoint write":
            slope = -alive / (dt * factor * factor) if dt else 0.0
        else:
            slope = -1.0 / (mttf_s * factor)
        halved = expected_ettr(cost.halved(name), mttf_s)
        out.append(Sensitivity(name, seconds, halved, slope))
    return out


@dataclass(frozen=True)
class ScalePoint:
    """The projection at one GPU count."""

    gpus: int
    mttf_s: float
    ettr: float
    young_interval_s: float | None  # None without a measured save cost
    sensitivity: list[Sensitivity]

    @property
    def failures_per_day(self) -> float:
        return 86400.0 / self.mttf_s


def project(cost: RecoveryCost, model: FailureModel, gpus: list[int]) -> list[ScalePoint]:
    """:class:`ScalePoint` for each GPU count (positive integers)."""
    points = []
    for n in gpus:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"a GPU count must be an integer >= 1, got {n!r}")
        mttf = model.mttf_s(n)
        young = young_interval_s(cost.checkpoint_write_s, mttf) if cost.checkpoint_write_s else None
        points.append(
            ScalePoint(n, mttf, expected_ettr(cost, mttf), young, sensitivity(cost, mttf))
        )
    return points
