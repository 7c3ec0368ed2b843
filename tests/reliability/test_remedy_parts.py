"""The remedies' pure parts: the transient action, the spike rewind's window, records and LR
factor, the tracker file's rewind lines, the data iterator's unread and going back, the exit
decision of a rewind, the verdict file's new diagnosis; each docstring example runs."""

from __future__ import annotations

import doctest
import json
from pathlib import Path

import pytest

from stalwart.reliability import rewind
from stalwart.reliability.exit import ExitConfig, ExitInputs, decide
from stalwart.reliability.rerun import RerunDataIterator, RerunVerdict, read_iterations_to_skip
from stalwart.reliability.rerun.attribution.verdict_file import read_verdict
from stalwart.reliability.rerun.remedies import Remedies, RemedyConfig, TransientPolicy
from stalwart.reliability.rerun.reporter import Reporter
from stalwart.reliability.rerun.types import SpikeRewind
from stalwart.reliability.rerun.verdicts import TransientAction, spike_rewinds, transient_action
from stalwart.reliability.rewind import RewindPolicy, RewindRecord, lr_scale_at, read_rewinds

A = TransientAction


def test_the_rewind_docstring_runs() -> None:
    assert doctest.testmod(rewind, raise_on_error=True).attempted >= 3


@pytest.mark.parametrize(
    ("continues", "transient", "dirty", "over", "reproduced", "expected"),
    [
        (False, True, False, False, False, A.MEGATRON),  # exit: Megatron's protocol
        (True, False, False, False, True, A.MEGATRON),  # nothing transient: attribution
        (True, True, False, False, False, A.CONTINUE),
        (True, True, True, False, False, A.MEGATRON),  # the rerun rejected a call itself
        (True, True, False, False, True, A.MEGATRON),  # another rank's result reproduced
        (True, True, False, True, False, A.SUSPECT),
        (True, True, True, True, True, A.SUSPECT),  # over budget: the device leaves first
    ],
)
def test_transient_action(
    continues: bool, transient: bool, dirty: bool, over: bool, reproduced: bool, expected: A
) -> None:
    assert transient_action(continues, transient, dirty, over, reproduced) is expected


def test_a_spike_rewinds_only_without_a_fatal_request_and_with_a_rewind_left() -> None:
    assert spike_rewinds(True, False, True)
    assert not spike_rewinds(True, True, True)
    assert not spike_rewinds(True, False, False)
    assert not spike_rewinds(False, False, True)


def test_policy_window_cap_and_lr_factor() -> None:
    policy = RewindPolicy(enabled=True, window=3, lr_scale=0.5, max_rewinds=2)
    first = policy.plan(spike=12, restored=8)
    assert (first.first, first.last, first.describe()) == (12, 14, "iterations 12-14")
    policy.add(first)
    assert policy.allows()
    policy.add(policy.plan(spike=20, restored=16))
    assert not policy.allows()  # max_rewinds reached
    assert [policy.scale_at(n) for n in (8, 9, 16, 17)] == [1.0, 0.5, 0.5, 0.25]
    with pytest.raises(ValueError, match="before its spike"):
        policy.plan(spike=5, restored=5)
    assert not RewindPolicy(enabled=False).allows()
    assert lr_scale_at(100, [], 0.5) == 1.0


def test_the_tracker_file_gives_the_rewinds_and_their_skips(tmp_path: Path) -> None:
    tracker = tmp_path / "t.txt"
    record = RewindRecord(spike=7, restored=5, first=7, last=8)
    line = (
        "ts=x node=n device=d jobID=j rank=0 iteration={} status=rewind_skipped result=nan "
        f"message={record.message('Spiky loss')!r}\n"
    )
    tracker.write_text(
        line.format(7)
        + line.format(8)
        + "ts=x node=n device=d jobID=j rank=0 iteration=9 status=rewind_skipped result=1 "
        "message='not a rewind'\n" + "\xff\xfe torn\n"
    )
    assert read_rewinds(str(tracker)) == [record]
    assert read_iterations_to_skip(str(tracker)) == [7, 8, 9]
    assert read_rewinds(str(tmp_path / "missing")) == []


def test_unread_serves_the_iteration_again_and_going_back_needs_a_sequence() -> None:
    it = RerunDataIterator(list(range(10)))
    it.advance()
    assert [next(it), next(it)] == [0, 1]
    it.rewind()
    assert next(it) == 0  # a rerun pass
    it.unread()
    it.advance()
    assert [next(it), next(it)] == [0, 1]  # the same items, read as new
    it.commit()
    assert it.position == 2 and it.rewindable
    it.advance()
    next(it)
    it.load_state_dict({"position": 1})  # back, from the sequence's start
    it.advance()
    assert next(it) == 1
    one_shot = RerunDataIterator(iter(range(10)))
    assert not one_shot.rewindable
    one_shot.advance()
    next(one_shot)
    next(one_shot)
    with pytest.raises(ValueError, match="cannot go back to item 1 of a one-shot iterator"):
        one_shot.load_state_dict({"position": 1})


def test_a_rewind_decision_neither_saves_nor_exits_whatever_else_was_agreed() -> None:
    request = SpikeRewind(6, 1e6, "Spiky loss", "peer_replay")
    inputs = ExitInputs(signal_received=True, signal_number=15, rerun=RerunVerdict(rewind=request))
    decision = decide(12, inputs, ExitConfig(save_interval=12), can_save=True, finished=True)
    assert decision.rewind == request and not decision.exit and decision.save.value == "none"
    assert RerunVerdict(rewind=request).rejected and not RerunVerdict(rewind=request).exit


def test_the_counts_ignore_foreign_rows() -> None:
    remedies = Remedies(RemedyConfig(TransientPolicy.CONTINUE, 2), Reporter(None, None))
    remedies.load([None, "x", {"a/b": 2, "c/d": True, 5: 1, "e/f": "3"}, {"a/b": 1}])
    assert remedies.counts == {"a/b": 2}
    assert not remedies.may_rewind()  # no loop gave it a way to rewind


def test_policy_spellings() -> None:
    assert TransientPolicy.parse(" Continue ") is TransientPolicy.CONTINUE
    with pytest.raises(ValueError, match="--rerun-transient-policy must be one of exit, continue"):
        TransientPolicy.parse("retry")


def test_the_verdict_file_reads_the_budget_diagnosis(tmp_path: Path) -> None:
    verdict = {
        "checkpoint": "iter_0000003",
        "iteration": 3,
        "diagnosis": "repeated_transient_errors",
        "suspects": [["node", "gpu-a"]],
        "suspect_ranks": [0],
        "source": "transient_budget",
        "message": "m",
        "time": "t",
    }
    (tmp_path / "rerun_verdict.json").write_text(json.dumps(verdict))
    found, problem = read_verdict(str(tmp_path))
    assert problem == "" and found is not None and found.suspects == [("node", "gpu-a")]
