"""Pure decisions of in-process restart: what a failure is, and whether to try again.

Every rank reads the same failure records from the store and calls :func:`decide_retry` on them,
so all ranks reach the same verdict without a collective (the process group is gone by then).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass

# Exit status when in-process restart gives up: non-zero so that torchrun (``--max-restarts``)
# or the scheduler restarts the whole job.
EXIT_CODE_INPROCESS_GAVE_UP = 75
# Exit status of a rank whose device failed the health check (or shares a node with one).
EXIT_CODE_UNHEALTHY = 76

_MESSAGE_LIMIT = 300


class FailureKind(enum.StrEnum):
    """How a failure was detected."""

    EXCEPTION = "exception"  # the train function raised on this rank
    COMMUNICATION = "communication"  # a collective failed and no other rank reported first
    WATCHDOG = "watchdog"  # no progress for --inprocess-soft-timeout
    DEAD_RANK = "dead_rank"  # a peer stopped heartbeating
    FATAL = "fatal"  # an exception that must not be retried (bad input, interrupt)


class Verdict(enum.Enum):
    """What every rank does after a failed attempt."""

    RETRY = "retry"
    STOP_ATTEMPT_LIMIT = "stop_attempt_limit"
    STOP_REPEATED_FAULT = "stop_repeated_fault"
    STOP_FATAL = "stop_fatal"


@dataclass(frozen=True)
class FailureRecord:
    """One failed attempt, as published in the store by the rank that saw it first.

    ``iteration`` is the 1-based iteration that was running (None before training started).
    """

    attempt: int
    rank: int
    kind: FailureKind
    error_type: str
    message: str
    iteration: int | None = None
    host: str = ""

    @property
    def identity(self) -> tuple[str, str, int | None]:
        """Two failures with the same identity are the same (repeatable) fault."""
        return (self.error_type, self.message, self.iteration)

    def cause(self) -> str:
        return f"{self.error_type}: {self.message}" if self.message else self.error_type

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: bytes | str) -> FailureRecord:
        data = json.loads(raw)
        data["kind"] = FailureKind(data["kind"])
        return cls(**data)


def short_message(exc: BaseException) -> str:
    """First line of ``str(exc)``, bounded (stable across attempts: no addresses or tracebacks)."""
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    return first[:_MESSAGE_LIMIT]


def decide_retry(history: Sequence[FailureRecord], max_iterations: int) -> Verdict:
    """Verdict after the last failure in ``history`` (one record per failed attempt, in order).

    ``max_iterations`` (``--inprocess-max-iterations``) bounds the number of attempts, the first
    run included. A fault whose identity (type, message, iteration) was already seen in an earlier
    attempt is repeatable (e.g. an OOM at the same iteration): retrying cannot help.
    """
    if not history:
        raise ValueError("decide_retry needs at least one failure")
    last = history[-1]
    if last.kind is FailureKind.FATAL:
        return Verdict.STOP_FATAL
    if any(prev.identity == last.identity for prev in history[:-1]):
        return Verdict.STOP_REPEATED_FAULT
    if len(history) >= max_iterations:
        return Verdict.STOP_ATTEMPT_LIMIT
    return Verdict.RETRY


def verdict_message(verdict: Verdict, history: Sequence[FailureRecord], max_iterations: int) -> str:
    """The one line that explains why in-process restart stops (or continues)."""
    last = history[-1]
    where = f"rank {last.rank} at iteration {last.iteration}: {last.cause()}"
    if verdict is Verdict.STOP_REPEATED_FAULT:
        return (
            f"in-process restart: giving up: the same fault happened twice ({where}); "
            f"retrying cannot help, exiting with code {EXIT_CODE_INPROCESS_GAVE_UP} "
            "so that the launcher restarts the job"
        )
    if verdict is Verdict.STOP_ATTEMPT_LIMIT:
        return (
            f"in-process restart: giving up after {len(history)} failed attempts "
            f"(--inprocess-max-iterations {max_iterations}); last failure {where}; exiting with "
            f"code {EXIT_CODE_INPROCESS_GAVE_UP} so that the launcher restarts the job"
        )
    if verdict is Verdict.STOP_FATAL:
        return f"in-process restart: not retrying a fatal error ({where})"
    return f"in-process restart: retrying after {where}"
