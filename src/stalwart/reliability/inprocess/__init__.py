"""In-process restart: recover from a fault without restarting the job.

Built on torch.distributed's own ``TCPStore``/``PrefixStore`` (no nvidia-resiliency-ext). Entry
points: :func:`restartable` / :class:`InProcessRestarter` for any train function written against
:class:`Attempt`, and ``--inprocess-restart`` for the reference trainer
(:func:`stalwart.train.inprocess.run_training_inprocess`). See ``wrapper.py`` for the
abort -> finalize -> health check -> rendezvous cycle.
"""

from __future__ import annotations

from stalwart.reliability.inprocess.config import InProcessConfig, RestartGranularity
from stalwart.reliability.inprocess.health import HealthCheckFailed, check_device_computes
from stalwart.reliability.inprocess.monitor import RestartRequested
from stalwart.reliability.inprocess.policy import (
    EXIT_CODE_INPROCESS_GAVE_UP,
    EXIT_CODE_UNHEALTHY,
    FailureKind,
    FailureRecord,
    Verdict,
    decide_retry,
)
from stalwart.reliability.inprocess.store import RestartStore, StoreAddress
from stalwart.reliability.inprocess.wrapper import (
    Attempt,
    InProcessRestarter,
    InProcessRestartExhausted,
    RestartOptions,
    abort_process_groups,
    restartable,
)

__all__ = [
    "EXIT_CODE_INPROCESS_GAVE_UP",
    "EXIT_CODE_UNHEALTHY",
    "Attempt",
    "FailureKind",
    "FailureRecord",
    "HealthCheckFailed",
    "InProcessConfig",
    "InProcessRestartExhausted",
    "InProcessRestarter",
    "RestartGranularity",
    "RestartOptions",
    "RestartRequested",
    "RestartStore",
    "StoreAddress",
    "Verdict",
    "abort_process_groups",
    "check_device_computes",
    "decide_retry",
    "restartable",
]
