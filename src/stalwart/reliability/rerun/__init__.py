"""Rerun state machine: detect NaN/Inf/spiky results and attribute them by re-running.

Re-implements Megatron-LM's rerun state machine as an instance passed to the training loop,
with host syncs batched to one read per iteration and Megatron's known defects fixed.
"""

from __future__ import annotations

from stalwart.reliability.rerun.attribution.peer import (
    PeerReport,
    PeerRequest,
    ReplayDeterminism,
    decide_peer_outcome,
    plan_peer_replay,
)
from stalwart.reliability.rerun.attribution.replicas import (
    ReplicaCheck,
    ReplicaSchedule,
    attribute_replicas,
)
from stalwart.reliability.rerun.checks.buffer import ValidationBuffer
from stalwart.reliability.rerun.checks.grads import (
    GradCheckState,
    bucket_layout,
    register_grad_check_hook,
)
from stalwart.reliability.rerun.checks.stats import QuickStats, compare_floats
from stalwart.reliability.rerun.config import RerunConfig, resolve_iterations_to_skip
from stalwart.reliability.rerun.data_iterator import RerunDataIterator
from stalwart.reliability.rerun.injector import RerunErrorInjector
from stalwart.reliability.rerun.machine import RerunStateMachine
from stalwart.reliability.rerun.rng import RngStateTracker
from stalwart.reliability.rerun.tracker import read_iterations_to_skip
from stalwart.reliability.rerun.types import (
    DEVICE_ID_ENV,
    EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
    EXIT_CODE_RESUME_TO_DISAMBIGUATE,
    CheckConfig,
    Diagnosis,
    DiagnosisSource,
    RerunDiagnostic,
    RerunMode,
    RerunState,
    RerunVerdict,
    Suspect,
    device_identity,
)

__all__ = [
    "DEVICE_ID_ENV",
    "EXIT_CODE_FAILED_ON_RESULT_VALIDATION",
    "EXIT_CODE_RESUME_TO_DISAMBIGUATE",
    "CheckConfig",
    "Diagnosis",
    "DiagnosisSource",
    "GradCheckState",
    "PeerReport",
    "PeerRequest",
    "QuickStats",
    "ReplayDeterminism",
    "ReplicaCheck",
    "ReplicaSchedule",
    "RerunConfig",
    "RerunDataIterator",
    "RerunDiagnostic",
    "RerunErrorInjector",
    "RerunMode",
    "RerunState",
    "RerunStateMachine",
    "RerunVerdict",
    "RngStateTracker",
    "Suspect",
    "ValidationBuffer",
    "attribute_replicas",
    "bucket_layout",
    "compare_floats",
    "decide_peer_outcome",
    "device_identity",
    "plan_peer_replay",
    "read_iterations_to_skip",
    "register_grad_check_hook",
    "resolve_iterations_to_skip",
]
