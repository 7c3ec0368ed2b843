"""The pure parts of the peer replay and the step's replica fingerprints (one process, no
collectives): peer planning, the verdict, the replica attribution, the sampled schedule, the
launcher's files, the served micro-batches and the injector's replay rule."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stalwart.reliability.rerun import (
    Diagnosis,
    DiagnosisSource,
    PeerReport,
    PeerRequest,
    ReplicaSchedule,
    RerunConfig,
    RerunDataIterator,
    RerunDiagnostic,
    RerunErrorInjector,
    Suspect,
    attribute_replicas,
    decide_peer_outcome,
    plan_peer_replay,
)
from stalwart.reliability.rerun.attribution.verdict_file import SUSPECTS_FILENAME, write_verdict


def _request(rank: int, *, replayable: bool = True) -> PeerRequest:
    return PeerRequest(
        rank=rank, identity=("n0", f"cpu:{rank}"), key=(0, "found NaN"), message="found NaN",
        fatal=True, tolerance=0.0, initial=float("nan"), batches=[[1, 2]], rng={},
        replayable=replayable,
    )  # fmt: skip


def test_plan_gives_each_suspect_a_distinct_peer_preferring_another_node() -> None:
    identities = [("a", "0"), ("a", "1"), ("b", "0"), ("b", "1")]
    plan, why = plan_peer_replay(identities, [None, _request(1), None, None])
    assert plan is not None and why == ""
    assert plan.peers == {1: 2}  # node b: a node-level fault must not reproduce on the peer
    assert plan.replaying_for(2) is plan.requests[1] and plan.replaying_for(0) is None
    plan, _ = plan_peer_replay(identities, [_request(0), _request(1), None, None])
    assert plan is not None and plan.peers == {0: 2, 1: 3}


@pytest.mark.parametrize(
    ("requests", "why"),
    [
        ([None, None], "no rank reproduced"),
        ([_request(0), _request(1)], "no replica is left"),
        ([None, _request(1, replayable=False)], "not a local value"),
    ],
)
def test_plan_falls_back_to_the_exit_16_flow(requests: list, why: str) -> None:
    plan, reason = plan_peer_replay([("a", "0"), ("a", "1")], requests)
    assert plan is None and why in reason


def test_verdict_persistent_unless_the_peer_reproduced() -> None:
    plan, _ = plan_peer_replay([("a", "0"), ("a", "1"), ("a", "2")], [None, _request(1), None])
    assert plan is not None
    peer = plan.peers[1]
    same = PeerReport(1, peer, ("a", str(peer)), float("nan"), 0.0, True)
    assert decide_peer_outcome(plan, [None, same, None]).persistent == []
    differs = PeerReport(1, peer, ("a", str(peer)), 1.5, float("inf"), False)
    assert decide_peer_outcome(plan, [differs, None, None]).persistent == [1]
    assert decide_peer_outcome(plan, [None, None, None]).persistent == [1]  # no call made
    assert decide_peer_outcome(plan, []).fatal


def test_replica_attribution() -> None:
    w = 1  # one weight column, then one gradient column
    good, bad = [5, 7], [5, 8]
    assert attribute_replicas([good, bad], [good, good], w).kind == "transient"
    assert attribute_replicas([good, bad], [good, good], w).suspects == [1]
    four = attribute_replicas([good, bad, good, good], [good, bad, good, good], w)
    assert (four.kind, four.suspects, four.weights_consistent) == ("persistent", [1], True)
    changing = attribute_replicas([good, [5, 9]], [good, bad], w)
    assert (changing.kind, changing.suspects) == ("persistent", [1])
    tie = attribute_replicas([good, bad], [good, bad], w)
    assert (tie.kind, tie.suspects) == ("unattributed", [])
    weights = attribute_replicas([good, [6, 7], good], [good, [6, 7], good], w)
    assert weights.suspects == [1] and not weights.weights_consistent


def test_sampled_schedule_covers_every_parameter_every_n_iterations() -> None:
    sizes = [1000, 10, 10, 500, 500, 3, 70, 800]
    schedule = ReplicaSchedule(sample_fraction=0.25, seed=3)
    groups = schedule.partition(sizes)
    assert len(groups) == 4 == schedule.num_groups
    assert sorted(i for g in groups for i in g) == list(range(len(sizes)))
    covered = {i for it in range(4) for i in (schedule.due(it, groups) or [])}
    assert covered == set(range(len(sizes)))
    assert schedule.due(4, groups) == schedule.due(0, groups)
    every = ReplicaSchedule(interval=5)
    assert every.due(3, groups) is None and every.due(4, groups) == list(range(len(sizes)))
    assert not ReplicaSchedule().enabled
    with pytest.raises(ValueError, match="--check-weight-hash-sample-fraction"):
        ReplicaSchedule(sample_fraction=float("nan"))
    with pytest.raises(ValueError, match="--check-weight-hash-sample-fraction"):
        RerunConfig(check_weight_hash_sample_fraction=1.5)


def test_gate_fingerprints_one_column_per_weight_and_gradient_even_without_gradients() -> None:
    """A parameter without a gradient gets a zero gradient column (the labels stay aligned);
    the others' columns are their exact fingerprints; a world of one gathers its own row."""
    import torch

    from stalwart.reliability.rerun import ReplicaCheck
    from stalwart.reliability.rerun.attribution.fingerprints import tensor_fingerprints

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]
    params[0].grad = torch.randn(4, 3)
    gate = ReplicaCheck(ReplicaSchedule(interval=1))
    fp = gate.fingerprints(0, params, ["a", "b"])
    assert fp is not None and fp.dtype == torch.int64
    assert gate.columns == ["a", "b", "a.grad", "b.grad"] and gate.weight_columns == 2
    assert fp[:2].tolist() == tensor_fingerprints([p.detach() for p in params]).tolist()
    assert fp[2].item() == tensor_fingerprints([params[0].grad])[0].item() != 0
    assert fp[3].item() == 0
    params[1].grad = torch.zeros(5)  # an all-zero gradient fingerprints as zero too
    assert gate.fingerprints(0, params)[3].item() == 0  # type: ignore[index]
    assert gate.gather(fp).tolist() == [fp.tolist()] and gate.num_recorded == 1
    params[0].grad = None
    params[1].grad = None
    assert gate.fingerprints(0, params)[2:].tolist() == [0, 0]  # type: ignore[index]


def test_verdict_writes_the_launchers_suspect_list_and_drops_a_stale_one(tmp_path: Path) -> None:
    suspect = Suspect(5, "node7", "3")
    persistent = Diagnosis(3, "persistent_error", (suspect,), "m", DiagnosisSource.PEER_REPLAY, 3)
    assert write_verdict(str(tmp_path), persistent)
    verdict = json.loads((tmp_path / "rerun_verdict.json").read_text())
    assert verdict["source"] == "peer_replay" and verdict["suspect_ranks"] == [5]
    listed = json.loads((tmp_path / SUSPECTS_FILENAME).read_text())
    assert listed == {
        "iteration": 3, "diagnosis": "persistent_error", "source": "peer_replay",
        "checkpoint": "iter_0000003", "suspects": [{"rank": 5, "host": "node7", "device": "3"}],
    }  # fmt: skip
    correct = Diagnosis(9, "correct_result", (), "m", DiagnosisSource.PEER_REPLAY, 9)
    assert write_verdict(str(tmp_path), correct)
    assert not (tmp_path / SUSPECTS_FILENAME).exists()


def test_data_iterator_serves_a_peers_microbatches_then_its_own() -> None:
    it = RerunDataIterator(iter(range(100)))
    it.advance()
    assert [next(it), next(it)] == [0, 1]
    it.rewind()
    it.serve(["peer-a", "peer-b"])
    assert [next(it), next(it)] == ["peer-a", "peer-b"]
    with pytest.raises(RuntimeError, match="more micro-batches than the replayed rank"):
        next(it)
    it.rewind()
    assert [next(it), next(it)] == [0, 1]  # its own record is kept
    it.advance()
    assert next(it) == 2


def test_injected_fault_on_the_peer_follows_the_injection_type() -> None:
    here, there = ("n", "cpu:0"), ("n", "cpu:1")
    replay = RerunErrorInjector.corrupts_replay
    assert replay(RerunDiagnostic.CORRECT_RESULT, there, here)
    assert not replay(RerunDiagnostic.PERSISTENT_ERROR, there, here)
    assert replay(RerunDiagnostic.PERSISTENT_ERROR, here, here)
    assert not replay(RerunDiagnostic.TRANSIENT_ERROR, here, here)


def test_grad_corruption_fires_after_the_backward_and_refuses_another_phase(
    tmp_path: Path,
) -> None:
    from stalwart.reliability.faults import FaultInjectionConfig, build_fault_injector

    def build(phase: str) -> object:
        config = FaultInjectionConfig(
            inject_fault="grad_corruption", inject_fault_iteration=3, inject_fault_phase=phase
        )
        return build_fault_injector(config, tmp_path, world_size=2)

    assert getattr(build("step"), "phase", None) == "backward"  # the default: where it fires
    with pytest.raises(ValueError, match="--inject-fault-phase: grad_corruption fires after"):
        build("eval")


def test_replay_determinism_pins_sdpa_backends_and_restores() -> None:
    """A named SDPA backend is pinned inside the block (a pybind enum: looked up by attribute,
    which failed on the H200 with "SDPBackend is not subscriptable"); deterministic algorithms
    are on inside and restored after; a wrong name is one line listing the allowed ones."""
    import pytest
    import torch
    import torch.nn.functional as F

    from stalwart.reliability.rerun import ReplayDeterminism

    q = torch.randn(1, 2, 8, 4)
    with ReplayDeterminism(sdpa_backends=("math",)).applied():
        assert torch.are_deterministic_algorithms_enabled()
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert not torch.are_deterministic_algorithms_enabled()
    bad = ReplayDeterminism(sdpa_backends=("warp",))
    with pytest.raises(ValueError, match=r"sdpa_backends: \['warp'\].*allowed: .*math"):
        bad.applied().__enter__()
    assert not torch.are_deterministic_algorithms_enabled()
