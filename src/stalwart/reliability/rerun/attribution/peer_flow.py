"""The peer replay's side of the rerun machine (see
``stalwart.reliability.rerun.attribution.peer`` for the protocol): :class:`PeerReplay` owns the plan
of the replay under way and does its collectives, its RNG and data set-up, its comparison and its
lines; the machine owns the states."""

from __future__ import annotations

import logging
import math
from typing import Any

from stalwart.distributed import collectives
from stalwart.reliability.rerun.attribution.peer import (
    PeerOutcome,
    PeerPlan,
    PeerReport,
    PeerRequest,
    ReplayDeterminism,
    decide_peer_outcome,
    plan_peer_replay,
    to_cpu,
)
from stalwart.reliability.rerun.checks.rules import evaluate_comparison, is_grad_message
from stalwart.reliability.rerun.data_iterator import RerunDataIterator
from stalwart.reliability.rerun.injector import RerunErrorInjector
from stalwart.reliability.rerun.reporter import Reporter
from stalwart.reliability.rerun.rng import RngStateTracker, adopt_rng_state, portable_rng_state
from stalwart.reliability.rerun.types import (
    CallKey,
    Diagnosis,
    DiagnosisSource,
    Identity,
    RerunDiagnostic,
    RerunValidationStatus,
    Suspect,
    device_identity,
)
from stalwart.reliability.rerun.verdicts import Event, Items

logger = logging.getLogger("stalwart.reliability.rerun.machine")


class PeerReplay:
    """The peer replay of a reproduced rejection (stalwart's attribution in the same launch).

    Args:
        enabled: whether a reproduced rejection is replayed on a peer (else: exit 16).
        determinism: the settings of the replay's pass.
        reporter: the machine's place in its group and its lines.
        rng: the machine's RNG tracker (a peer adopts its suspect's state into it).
    """

    def __init__(
        self,
        enabled: bool,
        determinism: ReplayDeterminism,
        reporter: Reporter,
        rng: RngStateTracker,
    ) -> None:
        self.enabled = enabled
        self.determinism = determinism
        self._reporter = reporter
        self._rng = rng
        self.plan: PeerPlan | None = None

    @property
    def possible(self) -> bool:
        return self.enabled and self._reporter.world_size > 1

    def request(
        self,
        ev: Event,
        injector: RerunErrorInjector,
        iterators: list[RerunDataIterator[Any]],
        saved_rng: dict[str, Any] | None,
        local_grad_checks: bool,
    ) -> PeerRequest:
        """What this rank, whose rejection reproduced, ships to its peer
        (``local_grad_checks`` False: its gradient checks saw reduced shards, not replayable)."""
        injection = injector.injection_for(ev.key)
        shipped = None if injection is None else (injection[0].value, tuple(injection[1]))
        return PeerRequest(
            rank=self._reporter.group_rank,
            identity=device_identity(),
            key=tuple(ev.key),  # type: ignore[arg-type]
            message=ev.message,
            fatal=ev.fatal,
            tolerance=ev.tolerance,
            initial=ev.initial_result,
            batches=[to_cpu(list(it.saved_microbatches)) for it in iterators],
            rng=portable_rng_state(saved_rng) if saved_rng is not None else {},
            injection=shipped,  # type: ignore[arg-type]
            replayable=local_grad_checks or not is_grad_message(ev.message),
        )

    def plan_replay(self, request: PeerRequest | None) -> list[Identity] | None:
        """Pick the peers (one collective, every rank); every rank's identity, or None (logged)
        when no replay is possible."""
        reporter = self._reporter
        gathered = collectives.all_gather_objects(
            (device_identity(), request), reporter.process_group
        )
        identities: list[Identity] = [tuple(g[0]) for g in gathered]  # type: ignore[index,misc]
        plan, why = plan_peer_replay(identities, [g[1] for g in gathered])  # type: ignore[index]
        if plan is None:
            reporter.log0(f"No peer replay ({why}): rerunning from a checkpoint instead")
            return None
        self.plan = plan
        return identities

    def start(
        self, iterators: list[RerunDataIterator[Any]], identities: list[Identity], iteration: int
    ) -> None:
        """After the machine put back the iteration's start: a peer takes its suspect's RNG
        state and micro-batches; rank 0 names the pairs."""
        assert self.plan is not None
        reporter = self._reporter
        mine = self.plan.replaying_for(reporter.group_rank)
        if mine is not None:  # this rank computes the suspect's iteration
            adopt_rng_state(mine.rng, self._rng)
            for it, items in zip(iterators, mine.batches, strict=True):
                it.serve(items)
        pairs = ", ".join(
            f"rank {reporter.global_rank(s)} on rank {reporter.global_rank(p)} "
            f"({identities[p][0]}/{identities[p][1]})"
            for s, p in self.plan.peers.items()
        )
        reporter.log0(f"Replaying iteration {iteration + 1} on a peer replica: {pairs}")

    def corrupts(self, key: CallKey) -> bool:
        """Injection during the replay: the suspect's shipped injection, on this device."""
        plan = self.plan
        mine = plan.replaying_for(self._reporter.group_rank) if plan is not None else None
        if mine is None or mine.injection is None or tuple(key) != tuple(mine.key):
            return False
        kind, injected_on = mine.injection
        return RerunErrorInjector.corrupts_replay(
            RerunDiagnostic(kind), injected_on, device_identity()
        )

    def finish(self, items: Items, iteration: int) -> PeerOutcome:
        """Compare and agree (one collective): the replay's outcome; the plan is done."""
        plan = self.plan
        assert plan is not None
        mine = plan.replaying_for(self._reporter.group_rank)
        report = self._report(mine, items, iteration) if mine is not None else None
        reports = collectives.all_gather_objects(report, self._reporter.process_group)
        self.plan = None
        return decide_peer_outcome(plan, reports)  # type: ignore[arg-type]

    def _report(self, request: PeerRequest, items: Items, iteration: int) -> PeerReport:
        value, comparison = math.nan, math.inf
        for rec, v in items:
            if tuple(rec.key) == tuple(request.key):
                value = v
                comparison = evaluate_comparison(rec.spec.comparison_func, request.initial, v)
                break
        else:
            line = f"the peer replay did not make call {request.key}"
            logger.warning(self._reporter.describe(iteration, line))
        return PeerReport(
            request.rank,
            self._reporter.group_rank,
            device_identity(),
            value,
            comparison,
            comparison <= request.tolerance,
        )

    def record_outcome(
        self, outcome: PeerOutcome, iteration: int, seconds: float | None
    ) -> RerunDiagnostic:
        """Logs and tracker lines (on each suspect), and rank 0's one summary line; the
        diagnosis (``seconds``: since the rejection, if known)."""
        persistent = outcome.persistent
        request = outcome.plan.requests.get(self._reporter.group_rank)
        if request is not None:
            self._log_suspect(request, outcome.reports.get(self._reporter.group_rank), iteration)
        took = f" {seconds:.2f} s after the rejection" if seconds is not None else ""
        if persistent:
            who = ", ".join(self._suspect(outcome.plan, s).describe() for s in persistent)
            self._reporter.log0(f"Peer replay verdict{took}: persistent error on {who}")
            return RerunDiagnostic.PERSISTENT_ERROR
        self._reporter.log0(f"Peer replay verdict{took}: correct result (reproduced on a peer)")
        return RerunDiagnostic.CORRECT_RESULT

    def _log_suspect(self, request: PeerRequest, report: PeerReport | None, iteration: int) -> None:
        reporter = self._reporter
        where = (
            "a peer"
            if report is None
            else f"rank {reporter.global_rank(report.peer)} "
            + (f"({report.peer_identity[0]}/{report.peer_identity[1]})")
        )
        value = math.nan if report is None else report.value
        reproducible = report is not None and report.reproducible
        reporter.log_repeat_verdict(
            logger,
            iteration,
            "Peer replay",
            where,
            reproducible=reproducible,
            values=(request.initial, value),
            message=request.message,
            fatal=request.fatal,
        )
        status = (
            RerunValidationStatus.PEER_REPLAY_REPRODUCIBLE
            if reproducible
            else RerunValidationStatus.PEER_REPLAY_NOT_REPRODUCIBLE
        )
        # Where the value was computed: the peer's device.
        identity = report.peer_identity if report is not None else device_identity()
        reporter.track(iteration, status, value, request.message, identity=identity)

    def diagnosis(self, outcome: PeerOutcome, iteration: int) -> Diagnosis:
        """The diagnosis the exit carries (``rerun_verdict.json``)."""
        persistent = outcome.persistent
        plan = outcome.plan
        if persistent:
            suspects = tuple(self._suspect(plan, s) for s in persistent)
            message = plan.requests[persistent[0]].message
            kind = RerunDiagnostic.PERSISTENT_ERROR.value
        else:
            suspects = ()
            message = next(r.message for r in plan.requests.values() if r.fatal)
            kind = RerunDiagnostic.CORRECT_RESULT.value
        return Diagnosis(iteration, kind, suspects, message, DiagnosisSource.PEER_REPLAY, iteration)

    def _suspect(self, plan: PeerPlan, group_rank: int) -> Suspect:
        node, device = plan.requests[group_rank].identity
        return Suspect(self._reporter.global_rank(group_rank), node, device)
