"""Rerun state machine: detect NaN/Inf/spiky results and attribute them by re-running.

Re-implements Megatron-LM's rerun state machine as an instance passed to the training loop,
with host syncs batched to one read per iteration and Megatron's known defects fixed.
"""

from __future__ import annotations

from stalwart.reliability.rerun.buffer import (
    INF_RULE,
    NAN_RULE,
    CheckSpec,
    DeviceRule,
    RuleKind,
    ValidationBuffer,
    host_predicate,
)
from stalwart.reliability.rerun.checks import (
    GRAD_TOLERANCE,
    INF_GRAD_MESSAGE,
    INF_LOSS_MESSAGE,
    LARGE_GRAD_MESSAGE,
    NAN_GRAD_MESSAGE,
    NAN_LOSS_MESSAGE,
    SPIKY_LOSS_MESSAGE,
    GradCheckState,
    bucket_layout,
    check_grad_norm,
    check_grads,
    check_loss,
    grad_check_comm_hook,
    local_grad_norm,
    register_grad_check_hook,
)
from stalwart.reliability.rerun.config import (
    RerunConfig,
    resolve_iterations_to_skip,
)
from stalwart.reliability.rerun.data_iterator import RerunDataIterator
from stalwart.reliability.rerun.injector import RerunErrorInjector
from stalwart.reliability.rerun.machine import RerunStateMachine
from stalwart.reliability.rerun.peer import (
    PeerPlan,
    PeerReport,
    PeerRequest,
    ReplayDeterminism,
    decide_peer_outcome,
    plan_peer_replay,
)
from stalwart.reliability.rerun.replicas import (
    REPLICA_MESSAGE,
    ReplicaAttribution,
    ReplicaGate,
    ReplicaSchedule,
    attribute_replicas,
)
from stalwart.reliability.rerun.rng import RngStateTracker, capture_rng_state, restore_rng_state
from stalwart.reliability.rerun.stats import QuickStats, compare_floats
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
    RerunValidationStatus,
    RerunVerdict,
    Suspect,
    device_identity,
)

__all__ = [
    "DEVICE_ID_ENV",
    "EXIT_CODE_FAILED_ON_RESULT_VALIDATION",
    "EXIT_CODE_RESUME_TO_DISAMBIGUATE",
    "GRAD_TOLERANCE",
    "INF_GRAD_MESSAGE",
    "INF_LOSS_MESSAGE",
    "INF_RULE",
    "LARGE_GRAD_MESSAGE",
    "NAN_GRAD_MESSAGE",
    "NAN_LOSS_MESSAGE",
    "NAN_RULE",
    "REPLICA_MESSAGE",
    "SPIKY_LOSS_MESSAGE",
    "CheckConfig",
    "CheckSpec",
    "DeviceRule",
    "Diagnosis",
    "DiagnosisSource",
    "GradCheckState",
    "PeerPlan",
    "PeerReport",
    "PeerRequest",
    "QuickStats",
    "ReplayDeterminism",
    "ReplicaAttribution",
    "ReplicaGate",
    "ReplicaSchedule",
    "RerunConfig",
    "RerunDataIterator",
    "RerunDiagnostic",
    "RerunErrorInjector",
    "RerunMode",
    "RerunState",
    "RerunStateMachine",
    "RerunValidationStatus",
    "RerunVerdict",
    "RngStateTracker",
    "RuleKind",
    "Suspect",
    "ValidationBuffer",
    "attribute_replicas",
    "bucket_layout",
    "capture_rng_state",
    "check_grad_norm",
    "check_grads",
    "check_loss",
    "compare_floats",
    "decide_peer_outcome",
    "device_identity",
    "grad_check_comm_hook",
    "host_predicate",
    "local_grad_norm",
    "plan_peer_replay",
    "read_iterations_to_skip",
    "register_grad_check_hook",
    "resolve_iterations_to_skip",
    "restore_rng_state",
]
