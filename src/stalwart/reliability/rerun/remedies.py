"""What a rejection costs instead of an exit: a transient verdict under its policy
(``--rerun-transient-policy``, with the per-device count that turns flaky hardware into a
suspect, ``--rerun-transient-budget``), and a reproduced spike's rewind (``--rewind-on-spike``:
the machine asks the loop whether it may, and ends the iteration with the rewind; the loop does
it, ``stalwart.reliability.rewind``).

A transient verdict means the in-place rerun did not reproduce the rejected result: the rerun
ran the same iteration on the same micro-batches, RNG and loss scale, and its own checks passed.

* ``exit`` (Megatron's protocol, the default): a fatal check exits 17 without saving; the
  launcher resumes from the last checkpoint, so the iterations since it are trained again.
* ``continue``: the rerun's result is the fault-free one, so the step applies it and training
  goes on: the fault costs one replay (the goodput ledger's ``rerun`` bucket), the tracker file
  keeps the event's lines, the log says so. Each transient is counted against the device that
  produced it; a device with more than ``budget`` of them in the run (the count is saved with
  the machine's checkpoint state, so a relaunch keeps it) is a suspect: the iteration's start
  is saved and the job exits 17 naming it in ``rerun_verdict.json`` and
  ``suspect_devices.json``, as a persistent error found by a peer replay does.

The rerun must be clean on every rank for its result to be applied: a rerun that rejects a
call of its own, or a rejection reproduced on another rank in the same iteration, falls back to
Megatron's behaviour (:func:`stalwart.reliability.rerun.verdicts.transient_action`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stalwart.distributed import collectives
from stalwart.reliability.rerun.reporter import Reporter
from stalwart.reliability.rerun.types import (
    Diagnosis,
    DiagnosisSource,
    SpikeRewind,
    Suspect,
    device_identity,
)

DEFAULT_TRANSIENT_BUDGET = 2
"""Transients a device may have in a run under ``continue``; the next one makes it a suspect."""

REPEATED_TRANSIENTS = "repeated_transient_errors"
"""The diagnosis of a device over its budget (``rerun_verdict.json``)."""


class TransientPolicy(str, enum.Enum):  # noqa: UP042 (StrEnum needs Python 3.11)
    """What a transient verdict does (see the module docstring)."""

    EXIT = "exit"
    CONTINUE = "continue"

    @classmethod
    def parse(cls, value: TransientPolicy | str) -> TransientPolicy:
        """User input; ``ValueError`` naming ``--rerun-transient-policy`` and the choices."""
        try:
            return cls(value.strip().lower() if isinstance(value, str) else value)
        except ValueError:
            allowed = ", ".join(m.value for m in cls)
            raise ValueError(
                f"--rerun-transient-policy must be one of {allowed}; got {value!r}"
            ) from None


@dataclass(frozen=True)
class RemedyConfig:
    """The machine's remedies (``RerunConfig.build`` gives them).

    Attributes:
        transient_policy: :class:`TransientPolicy` (``exit`` counts nothing).
        transient_budget: transients a device may have in the run; one more makes it a suspect.
        rewind: asked when a spiky loss reproduced: whether the loop may rewind now (None:
            never; training goes on with the spike's gradients, as in Megatron).
    """

    transient_policy: TransientPolicy = TransientPolicy.EXIT
    transient_budget: int = DEFAULT_TRANSIENT_BUDGET
    rewind: Callable[[], bool] | None = None


class Remedies:
    """This run's transient verdicts per device under the policy, and the spike rewind the
    iteration ended with (the machine's part).

    Args:
        config: the policy, the budget, whether a spike may rewind.
        reporter: the machine's place in its group and its lines.
    """

    def __init__(self, config: RemedyConfig, reporter: Reporter) -> None:
        self.policy = TransientPolicy.parse(config.transient_policy)
        self.budget = config.transient_budget
        self._rewind = config.rewind
        self._reporter = reporter
        self.counts: dict[str, int] = {}  # "node/device" -> transients counted in the run
        self.pending_rewind: SpikeRewind | None = None  # the iteration ended with it

    @property
    def continues(self) -> bool:
        return self.policy is TransientPolicy.CONTINUE

    def may_rewind(self) -> bool:
        """Whether a reproduced spike rewinds now (the same answer on every rank)."""
        return self._rewind is not None and self._rewind()

    def observe(self, transient: bool, clean: bool, iteration: int) -> tuple[bool, bool, bool]:
        """After the in-place rerun, this rank's flags for the agreement: ``(transient, dirty,
        over budget)``. ``transient``: this rank's rejection was not reproduced (counted here
        against this device under ``continue``); ``clean``: the rerun rejected nothing on this
        rank. Under ``exit``: all False (nothing changes)."""
        if not self.continues:
            return False, False, False
        over = False
        if transient:
            key = "/".join(device_identity())
            count = self.counts.get(key, 0) + 1
            self.counts[key] = count
            over = count > self.budget
            self._reporter.log_failure(
                iteration,
                f"Transient error {count} of at most {self.budget} on this device",
                over,
                "(over the transient budget: the device is a suspect)" if over else "",
            )
        return transient, not clean, over

    def diagnosis(self, over: bool, iteration: int, message: str) -> Diagnosis:
        """The suspects over budget (collective: one gather over the machine's group, every
        rank calls it once the ranks agreed that some rank is over). ``message``: this rank's
        failed call, if any (the diagnosis names the first suspect's)."""
        reporter = self._reporter
        rows: list[Any] = collectives.all_gather_objects(
            (over, device_identity(), message), reporter.process_group
        )
        over_rows = [(rank, row) for rank, row in enumerate(rows) if row[0]]
        suspects = tuple(
            Suspect(reporter.global_rank(rank), str(row[1][0]), str(row[1][1]))
            for rank, row in over_rows
        )
        who = ", ".join(s.describe() for s in suspects)
        failed = over_rows[0][1][2] if over_rows else message
        line = f"more than {self.budget} transient errors in this run on {who} ({failed})"
        reporter.log0(f"Transient budget exceeded: {line}")
        source = DiagnosisSource.TRANSIENT_BUDGET
        return Diagnosis(iteration, REPEATED_TRANSIENTS, suspects, line, source, iteration)

    def state_dict(self) -> dict[str, int]:
        """The counts this rank knows (JSON-friendly)."""
        return dict(self.counts)

    def load(self, rows: list[Any]) -> None:
        """Merge every rank's saved counts (a device may be another rank's now): the highest
        count of each device wins, so a spike rewind to an older checkpoint forgets none."""
        for row in rows:
            if not isinstance(row, dict):
                continue
            for key, count in row.items():
                if isinstance(key, str) and isinstance(count, int) and not isinstance(count, bool):
                    self.counts[key] = max(self.counts.get(key, 0), count)


__all__ = [
    "DEFAULT_TRANSIENT_BUDGET",
    "REPEATED_TRANSIENTS",
    "Remedies",
    "RemedyConfig",
    "TransientPolicy",
]
