"""``stalwart launch``'s policy: every documented outcome -> its action (pure, no processes)."""

from __future__ import annotations

import signal

import pytest

from stalwart.distributed.launch_policy import (
    ActionKind,
    LaunchOutcome,
    decide,
    process_exit_code,
)

HOST = "node0"
ABC = ("a", "b", "c")


def outcome(codes: dict[int, int], **kw: object) -> LaunchOutcome:
    base: dict[str, object] = dict(
        devices=ABC, host=HOST, restarts_left=2, global_batch_size=12, micro_batch_size=2
    )
    base.update(kw)
    return LaunchOutcome(exit_codes=codes, **base)  # type: ignore[arg-type]


def test_finished_stops_with_0() -> None:
    action = decide(outcome({0: 0, 1: 0, 2: 0}))
    assert (action.kind, action.exit_code, action.devices) == (ActionKind.FINISHED, 0, ABC)


def test_bad_input_stops_with_2_even_with_other_failures() -> None:
    action = decide(outcome({0: 2, 1: -15, 2: 2}))
    assert (action.kind, action.exit_code) == (ActionKind.BAD_INPUT, 2)
    assert "rank 0 exited 2" in action.line


def test_launcher_signal_is_a_preemption() -> None:
    action = decide(outcome({}, launcher_signal=signal.SIGTERM))
    assert (action.kind, action.exit_code) == (ActionKind.PREEMPTED, 143)
    assert "SIGTERM" in action.line and "run the same command again" in action.line
    slurm = decide(outcome({}, launcher_signal=signal.SIGTERM, slurm_job="42"))
    assert "SLURM requeues" in slurm.line


@pytest.mark.parametrize("code", [-9, -6, 1, 75, 137, 17])
def test_hang_dead_rank_transient_restart_on_same_devices(code: int) -> None:
    action = decide(outcome({1: code, 0: 1}, first_failed=1))
    assert action.kind is ActionKind.RESTART and action.devices == ABC
    assert f"rank 1 exited {code}" in action.line


def test_exit_17_with_old_suspects_not_in_use_is_a_restart() -> None:
    action = decide(outcome({0: 17, 1: 17}, suspects=((HOST, "z"),)))
    assert action.kind is ActionKind.RESTART


def test_exit_17_with_suspect_excludes_it_keeping_the_global_batch() -> None:
    action = decide(outcome({0: 17, 1: 17, 2: 17}, suspects=((HOST, "b"),)))
    assert action.kind is ActionKind.EXCLUDE
    assert action.devices == ("a", "c") and action.excluded == ("b",)
    assert "global batch 12 kept: 3 micro-batches per rank" in action.line


def test_exit_17_with_suspect_and_a_spare_replaces_it() -> None:
    action = decide(outcome({0: 17}, suspects=((HOST, "b"),), spares=("d", "e")))
    assert action.kind is ActionKind.REPLACE
    assert action.devices == ("a", "d", "c") and action.spares == ("e",)
    assert "b -> d" in action.line


def test_exit_16_refusal_on_a_suspect_device_excludes_it() -> None:
    action = decide(outcome({0: 16, 1: 16, 2: 16}, suspects=((HOST, "c"),)))
    assert action.kind is ActionKind.EXCLUDE and action.devices == ("a", "b")


@pytest.mark.parametrize(
    ("gbs", "mbs", "why"),
    [(None, 2, "pass --global-batch-size"), (12, None, "pass --global-batch-size"),
     (6, 2, "not a multiple of --micro-batch-size 2 x 2 rank(s)")],
)  # fmt: skip
def test_exclusion_that_would_change_the_batch_stops(
    gbs: int | None, mbs: int | None, why: str
) -> None:
    action = decide(
        outcome({0: 17}, suspects=((HOST, "b"),), global_batch_size=gbs, micro_batch_size=mbs)
    )
    assert (action.kind, action.exit_code, action.devices) == (ActionKind.OPERATOR, 17, ABC)
    assert why in action.line


def test_no_device_left_stops() -> None:
    action = decide(outcome({0: 17}, devices=("a",), suspects=((HOST, "a"),)))
    assert action.kind is ActionKind.OPERATOR and "no device left" in action.line


def test_exit_16_moves_to_spares_when_there_are_enough() -> None:
    action = decide(outcome({0: 16, 1: 16}, devices=("a", "b"), spares=("c", "d", "e")))
    assert action.kind is ActionKind.MOVE
    assert action.devices == ("c", "d") and action.spares == ("e", "a", "b")


def test_exit_16_without_spares_says_what_to_do() -> None:
    action = decide(outcome({0: 16}, spares=("d",)))
    assert (action.kind, action.exit_code) == (ActionKind.OPERATOR, 16)
    assert "only 1 spare device(s) for 3 rank(s) on node0" in action.line


def test_exit_16_without_spares_under_slurm_requeues_off_the_node() -> None:
    action = decide(outcome({0: 16}, slurm_job="77"))
    assert (action.kind, action.exit_code) == (ActionKind.REQUEUE, 16)
    assert action.commands == (
        ("scontrol", "update", "JobId=77", "ExcNodeList=node0"), ("scontrol", "requeue", "77")
    )  # fmt: skip
    assert "sbatch --exclude=node0" in action.line


def test_multi_node_suspect_excludes_its_node() -> None:
    suspects = (("node3", "5"),)
    plain = decide(outcome({4: 17}, nnodes=2, suspects=suspects))
    assert (plain.kind, plain.exit_code) == (ActionKind.OPERATOR, 17)
    assert "without node(s) node3" in plain.line and "--exclude=node3" in plain.line
    slurm = decide(outcome({4: 17}, nnodes=2, suspects=suspects, slurm_job="9"))
    assert slurm.kind is ActionKind.REQUEUE and slurm.excluded == ("node3",)
    assert ("scontrol", "update", "JobId=9", "ExcNodeList=node3") in slurm.commands
    # On one node (this one): the same rule as a single-node job, per node.
    here = decide(outcome({0: 17}, nnodes=2, suspects=((HOST, "b"),), slurm_job="9"))
    assert here.kind is ActionKind.REQUEUE and here.excluded == (HOST,)


def test_single_node_job_ignores_suspects_of_other_nodes() -> None:
    action = decide(outcome({0: 17}, suspects=(("elsewhere", "b"),)))
    assert action.kind is ActionKind.RESTART


@pytest.mark.parametrize(
    ("codes", "kw"),
    [({1: -9, 0: 1}, {}), ({0: 17}, {}), ({0: 17}, {"suspects": ((HOST, "b"),)}),
     ({0: 16}, {"spares": ("x", "y", "z")})],
)  # fmt: skip
def test_every_relaunch_spends_the_budget(codes: dict[int, int], kw: dict[str, object]) -> None:
    assert decide(outcome(codes, **kw)).kind.relaunches
    action = decide(outcome(codes, restarts_left=0, first_failed=min(codes), **kw))
    assert action.kind is ActionKind.EXHAUSTED
    rank = min(codes)
    assert action.exit_code == process_exit_code(codes[rank])
    assert f"restart budget exhausted (--max-restarts): rank {rank} exited" in action.line


def test_exhausted_names_the_first_failed_rank_and_its_signal() -> None:
    action = decide(outcome({0: 1, 2: -9}, restarts_left=0, first_failed=2))
    assert action.exit_code == 137 and "rank 2 exited -9 (SIGKILL)" in action.line


def test_stops_do_not_need_a_budget() -> None:
    assert decide(outcome({0: 0}, restarts_left=0)).kind is ActionKind.FINISHED
    assert decide(outcome({0: 2}, restarts_left=0)).kind is ActionKind.BAD_INPUT


def test_docstring_example() -> None:
    import stalwart.distributed.launch_policy as policy

    example = policy.__doc__.split("Example::")[1]  # type: ignore[union-attr]
    code = "\n".join(line[4:] for line in example.splitlines() if line.strip())
    exec(compile(code, "example", "exec"), vars(policy).copy())
