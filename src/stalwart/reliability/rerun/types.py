"""Enums, exit codes and small value types shared by the rerun state machine.

Names and string values follow Megatron-LM so that migrating users, launchers and log parsers keep
working; behaviour is re-implemented from a behavioural spec, not copied.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from stalwart.distributed.launch_env import (
    VISIBLE_DEVICES_ENV,
    env_device_list,
    env_int,
    env_token,
    node_name,
)

EXIT_CODE_RESUME_TO_DISAMBIGUATE = 16
"""The launcher should restart the job from the checkpoint just saved (or the same one)."""

EXIT_CODE_FAILED_ON_RESULT_VALIDATION = 17
"""Result validation failed and the diagnosis is complete (or the error was transient)."""

DEVICE_ID_ENV = "STALWART_DEVICE_ID"
"""Overrides the device part of a rank's identity, so one machine can simulate "another GPU"."""

COMPARISON_MATCH = 0.0
COMPARISON_MISMATCH = float("inf")

CallKey = tuple[str, str, int]
"""Identity of one validation call inside a run: (scope, message, 1-based sequence number).

``scope`` is ``""`` for eager ``validate_result`` calls and the buffer name for the slots of a
:class:`ValidationBuffer`. The sequence number counts calls with the same scope and message.
"""

Identity = tuple[str, str]
"""Where a rank computes: (node name, device id)."""


class RerunMode(str, enum.Enum):  # noqa: UP042 (StrEnum needs Python 3.11)
    """What the machine does with validation calls.

    ``report_stats`` is accepted as an alias of ``report_determinism_stats`` (Megatron's CLI used
    the former while its enum used the latter, so neither spelling worked end to end).
    """

    DISABLED = "disabled"
    VALIDATE_RESULTS = "validate_results"
    REPORT_DETERMINISM_STATS = "report_determinism_stats"

    @classmethod
    def _missing_(cls, value: object) -> RerunMode | None:
        if isinstance(value, str) and value.strip().lower() in ("report_stats", "report-stats"):
            return cls.REPORT_DETERMINISM_STATS
        if isinstance(value, str):
            for member in cls:
                if member.value == value.strip().lower().replace("-", "_"):
                    return member
        return None

    @classmethod
    def parse(cls, value: RerunMode | str) -> RerunMode:
        """Convert user input; raises ``ValueError`` naming ``--rerun-mode`` and the allowed
        values."""
        try:
            return cls(value)
        except ValueError:
            allowed = ", ".join(m.value for m in cls) + " (alias: report_stats)"
            raise ValueError(f"--rerun-mode must be one of {allowed}; got {value!r}") from None


class RerunDiagnostic(str, enum.Enum):  # noqa: UP042 (StrEnum needs Python 3.11)
    """Cause attributed to an unexpected result (also the error-injection types)."""

    CORRECT_RESULT = "correct_result"
    TRANSIENT_ERROR = "transient_error"
    PERSISTENT_ERROR = "persistent_error"

    @classmethod
    def parse(cls, value: RerunDiagnostic | str) -> RerunDiagnostic:
        """Convert user input; raises ``ValueError`` naming ``--error-injection-type``."""
        try:
            return cls(value)
        except ValueError:
            allowed = ", ".join(m.value for m in cls)
            raise ValueError(
                f"--error-injection-type must be one of {allowed}; got {value!r}"
            ) from None


class RerunState(enum.Enum):
    """The machine's states: Megatron's six (same values) and the peer replay.

    ``REPLAYING_ON_PEER`` (stalwart): after an in-place rerun reproduced a rejection on rank r,
    every rank runs one more pass in which a peer replica replays rank r's micro-batches with
    r's RNG state (``stalwart.reliability.rerun.attribution.peer``). It is never checkpointed.
    """

    NOT_RUNNING_YET = 0
    INITIAL_RUN = 1
    RERUNNING_IN_PLACE = 2
    WILL_RERUN_FROM_CHECKPOINT = 3
    RERUNNING_FROM_CHECKPOINT = 4
    RERUNNING_AGAIN_FROM_CHECKPOINT = 5
    REPLAYING_ON_PEER = 6


class RerunValidationStatus(str, enum.Enum):  # noqa: UP042 (StrEnum needs Python 3.11)
    """Status written to the result-rejected tracker file."""

    RERUN_DISABLED = "rerun_disabled"
    INITIAL_RUN = "initial_run"
    FIRST_RERUN_NOT_REPRODUCIBLE = "first_rerun_not_reproducible"
    FIRST_RERUN_REPRODUCIBLE = "first_rerun_reproducible"
    SECOND_RERUN_NOT_REPRODUCIBLE = "second_rerun_not_reproducible"
    SECOND_RERUN_REPRODUCIBLE = "second_rerun_reproducible"
    # stalwart: the replay of a rank's iteration on a peer replica (written by that rank, with
    # the peer's node and device: where the value was computed).
    PEER_REPLAY_NOT_REPRODUCIBLE = "peer_replay_not_reproducible"
    PEER_REPLAY_REPRODUCIBLE = "peer_replay_reproducible"
    # stalwart: replica fingerprints differed; the rank whose copy disagreed.
    REPLICA_MISMATCH = "replica_mismatch"
    # stalwart: an iteration of the window a spike rewind skipped (``--rewind-on-spike``):
    # written once per skipped iteration by rank 0; a relaunch skips it too.
    REWIND_SKIPPED = "rewind_skipped"


def device_identity() -> Identity:
    """(node, device) of this process, read now.

    The node is `stalwart.distributed.launch_env.node_name` (SLURM's node name, else the
    hostname). The device is ``$STALWART_DEVICE_ID`` when set; else entry ``LOCAL_RANK`` of
    ``$STALWART_VISIBLE_DEVICES`` (fake device ids on CPU/gloo, set by ``stalwart launch``);
    else, once CUDA is initialised, the physical id of the current device: its entry of
    ``$CUDA_VISIBLE_DEVICES`` when set (a relaunch with a remapped list must name the same GPU
    as the launch that suspected it), else its index; else ``cpu:<LOCAL_RANK>``. Reading it
    never initialises CUDA.
    """
    node = node_name()  # SLURM's name where it has one: what `stalwart launch` compares
    override = env_token(DEVICE_ID_ENV, "")
    if override:
        return node, override
    local_rank = env_int("LOCAL_RANK", 0)
    visible = env_device_list(VISIBLE_DEVICES_ENV)
    if visible:
        return node, visible[min(local_rank, len(visible) - 1)]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        index = torch.cuda.current_device()
        try:
            cuda_visible = env_device_list("CUDA_VISIBLE_DEVICES")
        except ValueError:  # CUDA's own syntax, not ours: fall back to the index
            cuda_visible = []
        return node, cuda_visible[index] if index < len(cuda_visible) else str(index)
    return node, f"cpu:{local_rank}"


def job_id() -> str:
    """Scheduler job id for the tracker file (``N/A`` outside SLURM)."""
    return env_token("SLURM_JOB_ID", "") or env_token("SLURM_JOBID", "") or "N/A"


@dataclass(frozen=True)
class CheckConfig:
    """Which checks ``Recorder.check_loss`` / ``check_grad_norm`` record (Megatron's
    ``--check-for-nan-in-loss-and-grad``, ``--check-for-spiky-loss``, ``--check-for-large-grads``
    and their factors)."""

    nan_and_inf: bool = True
    spiky_loss: bool = False
    large_grads: bool = False
    spiky_loss_factor: float = 10.0
    large_grads_factor: float = 10.0
    large_samples: int = 100  # the sampling window of both (Megatron's num_samples)

    @property
    def grads(self) -> bool:
        """Whether any gradient check is on."""
        return self.nan_and_inf or self.large_grads

    @property
    def any(self) -> bool:
        return self.nan_and_inf or self.spiky_loss or self.large_grads


class DiagnosisSource(str, enum.Enum):  # noqa: UP042 (StrEnum needs Python 3.11)
    """How a diagnosis was reached (the ``source`` of ``rerun_verdict.json``)."""

    PEER_REPLAY = "peer_replay"  # in the same launch, on a peer replica
    RERUN_FROM_CHECKPOINT = "rerun_from_checkpoint"  # Megatron's: after an exit 16 and relaunch
    REPLICA_CHECK = "replica_check"  # replica fingerprints: a majority vote or a replay
    TRANSIENT_BUDGET = "transient_budget"  # more transients on a device than the budget allows


@dataclass(frozen=True)
class Suspect:
    """A rank named by a diagnosis and where it computed (global rank, node, device)."""

    rank: int
    node: str
    device: str

    @property
    def identity(self) -> Identity:
        return self.node, self.device

    def describe(self) -> str:
        return f"rank {self.rank} ({self.node}/{self.device})"


@dataclass(frozen=True)
class Diagnosis:
    """A finished attribution, recorded in ``<save>/rerun_verdict.json`` by ``leave``.

    ``iteration``: completed iterations when it was reached (the failed iteration is logged as
    ``iteration + 1``); ``diagnosis``: ``persistent_error``, ``correct_result``,
    ``replica_corruption`` or ``repeated_transient_errors``; ``suspects``: the ranks whose
    device is to be excluded (empty for a correct result); ``checkpoint_iteration``: the checkpoint
    the relaunch resumes (None: the latest one in the save directory).
    """

    iteration: int
    diagnosis: str
    suspects: tuple[Suspect, ...]
    message: str
    source: DiagnosisSource
    checkpoint_iteration: int | None = None


@dataclass(frozen=True)
class SpikeRewind:
    """A loss spike attributed to the application (the data): the loop restores its newest
    snapshot and skips a window from the spike on (``stalwart.reliability.rewind``).

    ``iteration``: the machine's 0-based index of the spiking iteration (logged ``+ 1``);
    ``value``: the spiking loss; ``attribution``: how the spike was attributed
    (``peer_replay``: reproduced on a peer replica; ``in_place``: reproduced by the in-place
    rerun, with no peer to replay it on)."""

    iteration: int
    value: float
    message: str
    attribution: str


@dataclass(frozen=True)
class RerunVerdict:
    """What the machine asks of the loop after an iteration: nothing, or exit with ``exit_code``
    (16 or 17), after saving a checkpoint of the completed iterations when ``checkpoint``, or
    rewind (``rewind``: the iteration is not trained; the loop restores a snapshot).

    ``diagnosis``: set when the exit ends an attribution (the verdict file's content);
    ``replica_detail``: set when replica fingerprints differ (the exit is a replica mismatch)."""

    exit_code: int = 0
    checkpoint: bool = False
    diagnosis: Diagnosis | None = None
    replica_detail: str = ""
    rewind: SpikeRewind | None = None

    @property
    def exit(self) -> bool:
        return self.exit_code != 0

    @property
    def rejected(self) -> bool:
        """The iteration's result was not applied: an exit, or a spike rewind."""
        return self.exit or self.rewind is not None
