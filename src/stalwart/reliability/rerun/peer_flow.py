"""The peer replay as states of the rerun machine (see ``stalwart.reliability.rerun.peer`` for
the protocol); mixed into ``RerunStateMachine``, split from ``machine.py`` to keep files small.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from typing import Any

from stalwart.distributed import collectives
from stalwart.reliability.rerun.buffer import evaluate_comparison
from stalwart.reliability.rerun.checks import is_grad_message
from stalwart.reliability.rerun.core import Items, MachineCore
from stalwart.reliability.rerun.data_iterator import RerunDataIterator
from stalwart.reliability.rerun.injector import RerunErrorInjector
from stalwart.reliability.rerun.peer import (
    PeerOutcome,
    PeerPlan,
    PeerReport,
    PeerRequest,
    decide_peer_outcome,
    plan_peer_replay,
    to_cpu,
)
from stalwart.reliability.rerun.rng import adopt_rng_state, portable_rng_state
from stalwart.reliability.rerun.types import (
    CallKey,
    Diagnosis,
    DiagnosisSource,
    Identity,
    RerunDiagnostic,
    RerunState,
    RerunValidationStatus,
    Suspect,
    device_identity,
)

logger = logging.getLogger("stalwart.reliability.rerun.machine")


class PeerReplayMixin(MachineCore):
    """Peer replay states (a part of the machine: ``core.MachineCore``)."""

    # ----------------------------------------------------------------------------- public
    def replay_context(self) -> contextlib.AbstractContextManager[Any]:
        """What a loop wraps each pass in: :class:`ReplayDeterminism` during a peer replay,
        nothing otherwise (``GuardedStep`` does it)."""
        if self.state is RerunState.REPLAYING_ON_PEER:
            return self.replay_determinism.applied()
        return contextlib.nullcontext()

    @property
    def replaying_on_peer(self) -> bool:
        return self.state is RerunState.REPLAYING_ON_PEER

    # ---------------------------------------------------------------------------- begin
    def _peer_replay_possible(self) -> bool:
        return self.peer_replay and self.world_size > 1

    def _peer_request(self, iterators: list[RerunDataIterator[Any]]) -> PeerRequest:
        ev = self.event
        assert ev is not None  # only a rank whose rejection reproduced asks
        injection = self.injector.injection_for(ev.key)
        return PeerRequest(
            rank=self.group_rank,
            identity=device_identity(),
            key=tuple(ev.key),  # type: ignore[arg-type]
            message=ev.message,
            fatal=ev.fatal,
            tolerance=ev.tolerance,
            initial=ev.initial_result,
            batches=[to_cpu(list(it.saved_microbatches)) for it in iterators],
            rng=portable_rng_state(self._saved.rng) if self._saved is not None else {},
            injection=None if injection is None else (injection[0].value, tuple(injection[1])),  # type: ignore[arg-type]
            replayable=self.local_grad_checks or not is_grad_message(ev.message),
        )

    def _begin_peer_replay(self, iterators: list[RerunDataIterator[Any]], reproduced: bool) -> bool:
        """Pick the peers and ship the inputs (one collective); True: the replay pass runs."""
        request = self._peer_request(iterators) if reproduced else None
        gathered = collectives.all_gather_objects((device_identity(), request), self.process_group)
        identities: list[Identity] = [tuple(g[0]) for g in gathered]  # type: ignore[index,misc]
        plan, why = plan_peer_replay(identities, [g[1] for g in gathered])  # type: ignore[index]
        if plan is None:
            self._log0(f"No peer replay ({why}): rerunning from a checkpoint instead")
            return False
        self._peer_plan = plan
        self._restore_state()
        for it in iterators:
            it.rewind()
        mine = plan.replaying_for(self.group_rank)
        if mine is not None:  # this rank computes the suspect's iteration
            adopt_rng_state(mine.rng, self.rng)
            for it, items in zip(iterators, mine.batches, strict=True):
                it.serve(items)
        pairs = ", ".join(
            f"rank {self._global_rank(s)} on rank {self._global_rank(p)} ({identities[p][0]}/{identities[p][1]})"
            for s, p in plan.peers.items()
        )
        self._log0(f"Replaying iteration {self.iteration + 1} on a peer replica: {pairs}")
        self._enter(RerunState.REPLAYING_ON_PEER)
        return True

    def _peer_corrupts(self, key: CallKey) -> bool:
        """Injection during the replay: the suspect's shipped injection, on this device."""
        plan = self._peer_plan
        mine = plan.replaying_for(self.group_rank) if plan is not None else None
        if mine is None or mine.injection is None or tuple(key) != tuple(mine.key):
            return False
        kind, injected_on = mine.injection
        return RerunErrorInjector.corrupts_replay(
            RerunDiagnostic(kind), injected_on, device_identity()
        )

    # ------------------------------------------------------------------------------ end
    def _after_peer_replay(self, iterators: list[RerunDataIterator[Any]]) -> bool:
        """Compare, agree on the verdict (one collective), act: exit, or one clean pass."""
        plan = self._peer_plan
        assert plan is not None
        items = self._read()
        mine = plan.replaying_for(self.group_rank)
        report = self._peer_report(mine, items) if mine is not None else None
        reports = collectives.all_gather_objects(report, self.process_group)
        outcome = decide_peer_outcome(plan, reports)  # type: ignore[arg-type]
        self._peer_plan = None
        self._restore_state()
        for it in iterators:
            it.rewind()
        if self._rejected_at is not None:
            self.last_attribution_seconds = time.monotonic() - self._rejected_at
        self._record_peer_outcome(outcome)
        if outcome.persistent or outcome.fatal:
            self._pending_diagnosis = self._peer_diagnosis(outcome)
            # The checkpoint resumes this iteration, as the exit 16 one would (the relaunch
            # applies rerun_verdict.json to it: refuse the suspects, or train on).
            self.state = RerunState.WILL_RERUN_FROM_CHECKPOINT
            self._awaiting_exit = True
            return False
        self._log0(
            "Continuing normal execution because the failed validation was not fatal (a correct "
            "result, reproduced on a peer); the iteration runs once more for its gradients"
        )
        self._finish_event()
        self._final_pass = True  # the next read accepts: the gradients of a clean pass
        self._enter(RerunState.RERUNNING_IN_PLACE)
        return True

    def _peer_report(self, request: PeerRequest, items: Items) -> PeerReport:
        value, comparison = math.nan, math.inf
        for rec, v in items:
            if tuple(rec.key) == tuple(request.key):
                value = v
                comparison = evaluate_comparison(rec.spec.comparison_func, request.initial, v)
                break
        else:
            logger.warning(self._describe(f"the peer replay did not make call {request.key}"))
        return PeerReport(
            request.rank, self.group_rank, device_identity(), value, comparison,
            comparison <= request.tolerance,
        )  # fmt: skip

    def _record_peer_outcome(self, outcome: PeerOutcome) -> None:
        """Logs and tracker lines (on each suspect), and rank 0's one summary line."""
        persistent = outcome.persistent
        self.diagnosis = (
            RerunDiagnostic.PERSISTENT_ERROR if persistent else RerunDiagnostic.CORRECT_RESULT
        )
        request = outcome.plan.requests.get(self.group_rank)
        if request is not None:
            self._log_suspect(request, outcome.reports.get(self.group_rank))
        spent = self.last_attribution_seconds
        took = f" {spent:.2f} s after the rejection" if spent is not None else ""
        if persistent:
            who = ", ".join(self._suspect(outcome.plan, s).describe() for s in persistent)
            self._log0(f"Peer replay verdict{took}: persistent error on {who}")
        else:
            self._log0(f"Peer replay verdict{took}: correct result (reproduced on a peer)")

    def _log_suspect(self, request: PeerRequest, report: PeerReport | None) -> None:
        where = (
            "a peer"
            if report is None
            else f"rank {self._global_rank(report.peer)} "
            + (f"({report.peer_identity[0]}/{report.peer_identity[1]})")
        )
        value = math.nan if report is None else report.value
        if report is not None and report.reproducible:
            status = RerunValidationStatus.PEER_REPLAY_REPRODUCIBLE
            logger.warning(
                "Peer replay: unexpected result is reproducible on %s, therefore it was likely "
                "correct (%s = %s)", where, request.initial, value,
            )  # fmt: skip
            self._log_failure(
                f"Correct result (but possible Application error) ({request.message})",
                request.fatal,
            )
        else:
            status = RerunValidationStatus.PEER_REPLAY_NOT_REPRODUCIBLE
            logger.warning(
                "Peer replay: unexpected result is not reproducible on %s, therefore was likely "
                "incorrect (%s != %s)", where, request.initial, value,
            )  # fmt: skip
            self._log_failure("Possible persistent error!", True, f"(message='{request.message}')")
        if self.tracker is not None:  # where the value was computed: the peer's device
            identity = report.peer_identity if report is not None else device_identity()
            self.tracker.write(
                identity=identity, rank=self.rank, iteration=self.iteration,
                status=status, result=value, message=request.message,
            )  # fmt: skip

    def _peer_diagnosis(self, outcome: PeerOutcome) -> Diagnosis:
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
        return Diagnosis(
            self.iteration, kind, suspects, message, DiagnosisSource.PEER_REPLAY, self.iteration
        )

    def _suspect(self, plan: PeerPlan, group_rank: int) -> Suspect:
        node, device = plan.requests[group_rank].identity
        return Suspect(self._global_rank(group_rank), node, device)
