"""The one replica check (``--check-weight-hash-across-dp-replicas-interval``): fingerprints of
the data-parallel replicas (``fingerprints``) compared in the step and before every save.

In the step, the all-reduced gradients (and the weights they step) are compared before the
optimizer step, gated on the device. After the step, at the interval and before every save,
:meth:`ReplicaCheck.check` compares the weights; a mismatch exits 17 without saving
(``stalwart.reliability.exit.replica_exit``). Most silent data corruption gives finite wrong values
that no NaN check sees, and a corrupted all-reduced gradient on one replica makes its weights drift
one step later. So, at the iterations :class:`ReplicaSchedule` names, the step fingerprints the
pass's gradients and the weights (exact integer sums of their bytes), all-gathers them on the
device, and records one device check (``REPLICA_MESSAGE``) whose rejection also raises the
optimizer's skip gate: a mismatch never reaches the weights. The check's value rides on the
machine's one per-iteration read; the gathered fingerprints are read on the host only after a
mismatch.

A mismatch is then attributed (:func:`attribute_replicas`, pure): the iteration is rerun in place
on every rank (its micro-batches and RNG), then

* the rerun agrees across replicas: the rank(s) whose first copy differs from it had a
  transient corruption; training goes on with the rerun's consistent gradients (named in the
  log and the tracker file);
* the rerun still disagrees, and a strict majority (>= 3 replicas) or a copy that changed
  between the two passes names the rank(s): a persistent fault of their devices; the
  pre-iteration state is saved when the weights still agree, the suspects go into
  ``rerun_verdict.json`` and the job exits 17 (a relaunch refuses their devices);
* otherwise (two replicas disagreeing the same way twice: nothing tells which copy is right):
  exit 17 without saving, as the weight check does.

Sampled mode (``sample_fraction`` = 1/N): every iteration fingerprints one of N groups of a
seeded random partition of the parameters (balanced by size), so every parameter, and so every
gradient bucket, is covered every N iterations at about 1/N of the cost of a full check.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from stalwart.distributed import collectives
from stalwart.reliability.rerun.attribution.fingerprints import (
    ReplicaCheckResult,
    check_replica_consistency,
    decide_replica_consistency,
    gather_fingerprints,
    tensor_fingerprints,
)
from stalwart.reliability.rerun.checks.recorder import Recorder
from stalwart.reliability.rerun.checks.rules import NAN_RULE, DeviceCheck, is_rejected
from stalwart.reliability.rerun.reporter import Reporter
from stalwart.reliability.rerun.types import (
    Diagnosis,
    DiagnosisSource,
    RerunValidationStatus,
    Suspect,
    device_identity,
)
from stalwart.reliability.rerun.verdicts import Items

logger = logging.getLogger("stalwart.reliability.rerun.machine")

REPLICA_MESSAGE = (
    "found replica fingerprints (weights or all-reduced gradients) that differ across "
    "data-parallel ranks"
)


@dataclass(frozen=True)
class ReplicaSchedule:
    """Which parameters the step fingerprints at which iteration.

    ``interval`` (``--check-weight-hash-across-dp-replicas-interval``): every parameter at the
    iterations (numbered from 1) that are multiples of it. ``sample_fraction``
    (``--check-weight-hash-sample-fraction``): every iteration, one group of
    ``ceil(1 / fraction)``; ``seed`` draws the partition (the same on every rank).
    """

    interval: int = 0
    sample_fraction: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.interval < 0:
            raise ValueError(
                "--check-weight-hash-across-dp-replicas-interval must be >= 0 (0: off); "
                f"got {self.interval}"
            )
        fraction = self.sample_fraction
        if isinstance(fraction, bool) or not (0.0 <= fraction <= 1.0):  # NaN fails too
            raise ValueError(
                f"--check-weight-hash-sample-fraction must be in [0, 1] (0: off); got {fraction!r}"
            )

    @property
    def enabled(self) -> bool:
        return self.interval > 0 or self.sample_fraction > 0

    @property
    def num_groups(self) -> int:
        return math.ceil(1.0 / self.sample_fraction) if self.sample_fraction > 0 else 1

    def partition(self, sizes: Sequence[int]) -> list[list[int]]:
        """Parameter indices in ``num_groups`` groups: a seeded random order, each parameter
        into the lightest group so far (largest first), so the groups cost about the same."""
        order = list(range(len(sizes)))
        random.Random(self.seed).shuffle(order)
        order.sort(key=lambda i: -sizes[i])  # stable: ties keep the random order
        groups: list[list[int]] = [[] for _ in range(min(self.num_groups, max(len(sizes), 1)))]
        load = [0] * len(groups)
        for i in order:
            lightest = min(range(len(groups)), key=lambda g: (load[g], g))
            groups[lightest].append(i)
            load[lightest] += sizes[i]
        return [sorted(g) for g in groups]

    def due(self, iteration: int, groups: list[list[int]]) -> list[int] | None:
        """The indices to fingerprint at the 0-based ``iteration`` (None: nothing)."""
        if self.interval > 0 and (iteration + 1) % self.interval == 0:
            return sorted(i for g in groups for i in g)
        if self.sample_fraction > 0:
            return groups[iteration % len(groups)]
        return None


@dataclass(frozen=True)
class ReplicaAttribution:
    """Who disagreed (group ranks) and what the rerun showed (see the module docstring)."""

    kind: str  # "transient" | "persistent" | "unattributed"
    suspects: list[int] = field(default_factory=list)
    weights_consistent: bool = True


def _consistent(rows: list[list[int]], columns: slice = slice(None)) -> bool:
    return all(row[columns] == rows[0][columns] for row in rows)


def attribute_replicas(
    originals: list[list[int]], reruns: list[list[int]], weight_columns: int
) -> ReplicaAttribution:
    """Attribute a fingerprint mismatch from the first pass and its in-place rerun (pure).

    ``originals[r]`` / ``reruns[r]``: rank r's fingerprints (weights first, ``weight_columns``
    of them, then gradients) in the two passes.
    """
    weights_ok = _consistent(reruns, slice(0, weight_columns))
    if _consistent(reruns):
        changed = [r for r, row in enumerate(originals) if row != reruns[0]]
        return ReplicaAttribution("transient" if changed else "unattributed", changed, weights_ok)
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank, row in enumerate(reruns):
        groups.setdefault(tuple(row), []).append(rank)
    ranked = sorted(groups.values(), key=len, reverse=True)
    if len(ranked[0]) > len(ranked[1]):  # a strict majority names the others
        majority = ranked[0]
        minority = [r for r in range(len(reruns)) if r not in majority]
        return ReplicaAttribution("persistent", minority, weights_ok)
    changed = [r for r in range(len(reruns)) if originals[r] != reruns[r]]
    if changed and len(changed) < len(reruns):  # a copy that changes between passes is faulty
        return ReplicaAttribution("persistent", changed, weights_ok)
    return ReplicaAttribution("unattributed", [], weights_ok)


class ReplicaCheck:
    """The replica check: in the step, fingerprints of a pass gathered across the group (device
    side) and the attribution of a mismatch after its rerun (the first pass's rows, the detail
    the exit reports); after the step, the weights compared when :meth:`due` (at the interval,
    and before every save).

    Args:
        schedule: which parameters at which iteration.
        group: the data-parallel group (the machine's).
    """

    def __init__(self, schedule: ReplicaSchedule, group: dist.ProcessGroup | None = None) -> None:
        self.schedule = schedule
        self.group = group
        self._groups: list[list[int]] | None = None
        self._gathered: torch.Tensor | None = None
        self.weight_columns = 0
        self.columns: list[str] = []
        self.num_recorded = 0
        self.originals: list[list[int]] | None = None  # a mismatch's first pass, until its rerun
        self.detail = ""  # the mismatch the exit reports ("": none)

    def due(self, iteration: int, *, saving: bool = False) -> bool:
        """Whether to compare the weights after the step of the completed ``iteration``
        (1-based, as logged): at the multiples of the interval, and before every save while the
        interval is on (never write a checkpoint from diverged replicas). The sampled mode
        fingerprints in the step only."""
        interval = self.schedule.interval
        return interval > 0 and (saving or (iteration >= 1 and iteration % interval == 0))

    def check(self, module: torch.nn.Module) -> ReplicaCheckResult:
        """Collective: compare ``module``'s weights across the group (global ranks in the
        result; :func:`check_replica_consistency`)."""
        return check_replica_consistency(module, self.group)

    def fingerprints(
        self,
        iteration: int,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str] | None = None,
    ) -> torch.Tensor | None:
        """This rank's fingerprints of the due weights, then their gradients (device int64),
        or None when nothing is due. A parameter without a gradient contributes a zero."""
        if self._groups is None:
            self._groups = self.schedule.partition([p.numel() for p in params])
        due = self.schedule.due(iteration, self._groups)
        if not due:
            return None
        label = [names[i] if names is not None else f"parameter {i}" for i in due]
        self.columns = label + [f"{n}.grad" for n in label]
        weights = [params[i].detach() for i in due]
        # A missing gradient fingerprints as an empty tensor: a zero in its column, with no
        # index built on the host (device work only, whatever the gradients).
        grads = [
            g if (g := params[i].grad) is not None else w[:0]
            for i, w in zip(due, weights, strict=True)
        ]
        self.weight_columns = len(due)
        return torch.cat([tensor_fingerprints(weights), tensor_fingerprints(grads)])

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's vector, ``[world, k]`` (device work; gloo gathers on the CPU)."""
        gathered = self._gathered = gather_fingerprints(local, self.group)
        self.num_recorded += 1
        return gathered

    def host_rows(self) -> list[list[int]]:
        """The last gathered fingerprints on the host (a sync: only after a mismatch)."""
        if self._gathered is None:
            return []
        # Deliberate sync: attribution after a fingerprint mismatch (rare path).
        return [list(map(int, row)) for row in self._gathered.tolist()]

    def forget(self) -> None:
        self._gathered = None

    def describe(self, rows: list[list[int]]) -> str:
        """The replica check's one line for these rows (ranks of the group, columns named)."""
        result = decide_replica_consistency(rows, self.columns)
        return dataclasses.replace(result, subject="weights and gradients").describe()

    def record(
        self,
        iteration: int,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str] | None,
        recorder: Recorder,
    ) -> None:
        """Fingerprint what the schedule says, gather across the group and record the
        comparison into ``recorder`` as a device check that also raises the skip gate (device
        work and one device all-gather; nothing read on the host)."""
        local = self.fingerprints(iteration, params, names)
        if local is None:
            self.forget()
            return
        value = mismatch_value(self.gather(local)).to(local.device)
        check = DeviceCheck(NAN_RULE, REPLICA_MESSAGE, 0.0, True)
        recorder.check_all_on_device(value, [[check]])
        recorder.check_buffer(value.device).raise_gate(torch.isnan(value))

    # ------------------------------------------------------------- attribution of a mismatch
    def keep_originals(self) -> None:
        """A mismatch: keep the first pass's rows for the attribution after its rerun."""
        self.originals = self.host_rows()

    def attribute(self, reporter: Reporter, iteration: int) -> tuple[ReplicaAttribution, list[Any]]:
        """After the in-place rerun of a mismatch: the attribution and every rank's identity
        (one gather; every rank is here since the mismatch was the same on all)."""
        assert self.originals is not None
        originals, self.originals = self.originals, None
        reruns = self.host_rows()
        attribution = attribute_replicas(originals, reruns, self.weight_columns)
        identities = collectives.all_gather_objects(device_identity(), reporter.process_group)
        line = describe_attribution(attribution, identities, iteration)
        rows = originals if attribution.kind == "transient" else reruns
        self.detail = f"iteration {iteration + 1}: {self.describe(rows)}"
        line += f" ({self.detail})"
        rank = reporter.group_rank
        if rank == 0:
            logger.error(line)
        if rank in attribution.suspects:
            reporter.track(
                iteration,
                RerunValidationStatus.REPLICA_MISMATCH,
                math.nan,
                REPLICA_MESSAGE,
                rank=reporter.global_rank(rank),
            )
        return attribution, identities

    @staticmethod
    def diagnosis(
        attribution: ReplicaAttribution, identities: list[Any], iteration: int, reporter: Reporter
    ) -> Diagnosis:
        """The diagnosis of a persistent mismatch (its suspects by global rank)."""
        suspects = tuple(
            Suspect(reporter.global_rank(r), *identities[r]) for r in attribution.suspects
        )
        saved = iteration if attribution.weights_consistent else None
        return Diagnosis(
            iteration,
            "replica_corruption",
            suspects,
            REPLICA_MESSAGE,
            DiagnosisSource.REPLICA_CHECK,
            saved,
        )


def mismatch_value(gathered: torch.Tensor) -> torch.Tensor:
    """NaN when any rank's row differs from rank 0's, else 0.0 (a device scalar for NAN_RULE)."""
    differs = (gathered != gathered[:1]).any()
    return torch.where(differs, math.nan, 0.0).to(torch.float64)


def describe_attribution(
    attribution: ReplicaAttribution, identities: list[Any], iteration: int
) -> str:
    """One line for the log: who, and what happens next."""
    who = ", ".join(
        f"rank {r} ({identities[r][0]}/{identities[r][1]})" for r in attribution.suspects
    )
    if attribution.kind == "transient":
        return (
            f"iteration {iteration + 1}: the replica fingerprints differed; the in-place rerun "
            f"agrees across replicas: transient corruption on {who}; continuing with the "
            "rerun's gradients"
        )
    if attribution.kind == "persistent":
        return (
            f"iteration {iteration + 1}: the replica fingerprints differ again in the rerun: "
            f"persistent fault on {who}"
        )
    return (
        f"iteration {iteration + 1}: the replica fingerprints differ again in the rerun and no "
        "majority or changing copy tells which replica is right"
    )


def split_replica(items: Items) -> tuple[bool, Items]:
    """(whether the replica check of this pass rejected, the other records)."""
    ours = [(rec, v) for rec, v in items if rec.key[1] == REPLICA_MESSAGE]
    rest = [(rec, v) for rec, v in items if rec.key[1] != REPLICA_MESSAGE]
    return any(is_rejected(rec, v) for rec, v in ours), rest
