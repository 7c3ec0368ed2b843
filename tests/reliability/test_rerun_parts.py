"""Rerun building blocks: float comparison, stats, flags, tracker parsing, RNG, buffers."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from stalwart.reliability.rerun import (
    EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
    QuickStats,
    RerunConfig,
    RerunDataIterator,
    RerunErrorInjector,
    RerunMode,
    RerunState,
    RerunStateMachine,
    RngStateTracker,
    ValidationBuffer,
    compare_floats,
    read_iterations_to_skip,
)
from stalwart.reliability.rerun.checks.rules import UNWRITTEN
from stalwart.rng_state import capture_rng_state, restore_rng_state

INF, NAN = math.inf, math.nan


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        (1.0, 1.0, 0.0),
        (NAN, NAN, 0.0),
        (NAN, 1.0, INF),
        (INF, 1.0, INF),
        (INF, INF, 0.0),
        (INF, -INF, INF),  # Megatron: nan, i.e. wrongly "reproducible"
        (1.0, -1.0, 2.0),  # Megatron: ZeroDivisionError
        (0.0, 1e-9, 2.0),
        (0.0, 0.0, 0.0),
        (0.0, -0.0, 0.0),
    ],
)
def test_compare_floats_edge_cases(a: float, b: float, expected: float) -> None:
    assert compare_floats(a, b) == expected
    assert compare_floats(torch.tensor(a), torch.tensor(b)) == expected


def test_compare_floats_relative() -> None:
    assert compare_floats(1.0, 1.001) == pytest.approx(9.995e-4, rel=1e-3)


def test_quickstats_format_and_combine() -> None:
    qs = QuickStats()
    for x in (0, 0, 0.1, 0.2, 0.3):
        qs.record(x)
    assert qs.print_stats() == (
        "5/2 total/identical samples, rel. variability: avg= 1.200E-01, p50= 1.000E-01, "
        "p90= 3.000E-01, p99= 3.000E-01, p99.9= 3.000E-01, max: 3.000E-01"
    )
    small = QuickStats(max_size=3)
    small.combine([qs, qs])  # over max_size: ring buffer, nothing silently dropped
    assert small.zero_cnt == 4 and len(small.samples) == 3 and small.max == 0.3
    empty = QuickStats()
    empty.record(0)
    assert empty.print_stats() == "1 samples, all identical"


def test_mode_alias_and_flag_errors() -> None:
    assert RerunMode("report_stats") is RerunMode.REPORT_DETERMINISM_STATS
    assert RerunConfig(rerun_mode="report_stats").mode is RerunMode.REPORT_DETERMINISM_STATS
    with pytest.raises(ValueError, match=r"--rerun-mode .*validate_results"):
        RerunConfig(rerun_mode="sometimes")
    with pytest.raises(ValueError, match=r"--error-injection-type .*persistent_error"):
        RerunConfig(error_injection_type="cosmic_ray")
    with pytest.raises(ValueError, match="--error-injection-rate"):
        RerunConfig(error_injection_rate=-1)
    with pytest.raises(ValueError, match="--error-injection-rate"):
        RerunConfig(rerun_mode="disabled", error_injection_rate=3)
    with pytest.raises(ValueError, match="--iterations-to-skip"):
        RerunConfig(iterations_to_skip=[-2])
    with pytest.raises(ValueError, match=r"RerunConfig\.spiky_loss_factor"):
        RerunConfig(spiky_loss_factor=0)
    with pytest.raises(ValueError, match="--result-rejected-tracker-filename"):
        RerunStateMachine(result_rejected_tracker_filename="/nonexistent-dir/x.txt")


def _line(job: str, rank: int, it: int, status: str) -> str:
    return (
        f"ts=2026-01-01 00:00:00.1 node=n1 device=0 jobID={job} rank={rank} iteration={it} "
        f"status={status} result=nan message='found NaN in local forward loss calculation'\n"
    )


def test_read_iterations_to_skip(tmp_path: Path) -> None:
    path = tmp_path / "t.txt"
    path.write_text(
        _line("111", 3, 10, "rerun_disabled")
        + _line("112", 3, 10, "RerunValidationStatus.RERUN_DISABLED")
        + _line("111", 3, 20, "rerun_disabled")
        + _line("111", 4, 20, "rerun_disabled")
        + _line("112", 3, 20, "rerun_disabled")
        + _line("111", 6, 40, "first_rerun_reproducible")
        + _line("113", 6, 40, "second_rerun_reproducible")
        + _line("111", 7, 50, "initial_run")
        + _line("112", 7, 50, "initial_run")
        + "garbage line\n"
    )
    assert read_iterations_to_skip(str(path)) == [10, 40]
    assert read_iterations_to_skip(str(tmp_path / "missing.txt")) == []


def test_rng_capture_restore_with_user_generator() -> None:
    gen = torch.Generator().manual_seed(5)
    tracker = RngStateTracker()
    tracker.register_generator("mine", gen.get_state, gen.set_state)
    state = capture_rng_state(tracker)
    first = (random.random(), np.random.rand(), torch.rand(1), torch.rand(1, generator=gen))
    restore_rng_state(state, tracker)
    second = (random.random(), np.random.rand(), torch.rand(1), torch.rand(1, generator=gen))
    assert first[:2] == second[:2]
    assert torch.equal(first[2], second[2]) and torch.equal(first[3], second[3])
    with pytest.raises(ValueError):
        tracker.register_generator("mine", gen.get_state, gen.set_state)


def test_injector_never_touches_global_random() -> None:
    random.seed(3)
    expected = random.random()
    random.seed(3)
    inj = RerunErrorInjector(5, "transient_error", seed=1)
    for i in range(20):
        inj.maybe_inject(("", "m", i), i, 0, ("n", "d"))
        inj.clear()
    assert random.random() == expected


def test_data_iterator_replay_and_state() -> None:
    it = RerunDataIterator([{"a": 1}, {"a": 2}, {"a": 3}, {"a": 4}])
    first = next(it)
    first["a"] = 99  # consumer mutation must not corrupt the replay copy
    next(it)
    it.rewind()
    assert [next(it)["a"], next(it)["a"]] == [1, 2]
    with pytest.raises(RuntimeError, match="no more batches"):
        next(it)
    # Not accepted yet: a checkpoint now resumes at the start of this iteration.
    assert it.state_dict() == {"position": 0}
    it.commit()
    sd = it.state_dict()
    assert sd == {"position": 2}
    it.advance()
    assert next(it)["a"] == 3
    assert it.peek(1) == [{"a": 4}]
    assert it.state_dict() == {"position": 2}  # read ahead, not consumed
    resumed = RerunDataIterator([{"a": 1}, {"a": 2}, {"a": 3}, {"a": 4}])
    resumed.load_state_dict(sd)
    assert next(resumed)["a"] == 3


def test_data_iterator_state_of_a_resumable_source() -> None:
    class Source:
        def __init__(self) -> None:
            self.read = 0

        def __iter__(self) -> Source:
            return self

        def __next__(self) -> int:
            self.read += 1
            return self.read

        def state_dict(self, unconsumed_microbatches: int = 0) -> dict[str, int]:
            return {"read": self.read - unconsumed_microbatches}

        def load_state_dict(self, state: dict[str, int]) -> None:
            self.read = state["read"]

    it = RerunDataIterator(Source())
    it.advance()
    next(it), next(it)
    it.commit()
    it.advance()
    next(it)
    it.peek(2)
    assert it.state_dict() == {"position": 2, "source": {"read": 2}}
    again = RerunDataIterator(Source())
    again.load_state_dict(it.state_dict())
    again.advance()
    assert next(again) == 3


def test_validation_buffer_transient_injection() -> None:
    buf = ValidationBuffer("cpu", name="graph")
    slot = buf.add_check("grad norm", torch.isnan, tolerance=1e-3)
    sm = RerunStateMachine(
        mode="validate_results", error_injector=RerunErrorInjector(1, "transient_error")
    )
    sm.recorder.attach_buffer(buf)
    passes = 0
    while sm.should_run_forward_backward(iteration=7):
        passes += 1
        buf.record(slot, torch.tensor(2.0))  # what a captured graph would do on replay
    assert passes == 2
    assert sm.should_checkpoint_and_exit() == (False, True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION)
    assert sm.judge.event is not None and sm.judge.event.key == ("graph", "grad norm", 1)


def test_validation_buffer_clean_and_unwritten_slots() -> None:
    buf = ValidationBuffer("cpu")
    s0 = buf.add_check("a", torch.isnan)
    buf.add_check("b", torch.isnan)  # never recorded: not evaluated
    sm = RerunStateMachine(mode="validate_results")
    sm.recorder.attach_buffer(buf)
    for it in range(3):
        while sm.should_run_forward_backward(iteration=it):
            buf.record(s0, torch.tensor(float(it)))
        assert sm.should_checkpoint_and_exit() == (False, False, 0)


def test_a_slot_written_last_pass_only_neither_gates_nor_is_read() -> None:
    """A slot holds UNWRITTEN from each pass's start: its NaN of the last pass is gone (no gate,
    no verdict), whether the gate counts injections or not."""
    for may_inject in (True, False):
        buf = ValidationBuffer("cpu", may_inject=may_inject)
        s0, s1 = buf.add_check("a", torch.isnan), buf.add_check("b", torch.isinf)
        sm = RerunStateMachine(mode="validate_results")
        sm.recorder.attach_buffer(buf)
        assert sm.should_run_forward_backward(iteration=0)
        buf.record(s0, torch.tensor(1.0))
        buf.record(s1, torch.tensor(2.0))
        buf.update_gate()
        assert float(buf.gate) == 0.0
        assert not sm.should_run_forward_backward(iteration=0)
        assert sm.should_run_forward_backward(iteration=1)
        buf.values[s1] = math.inf  # left over from a pass that wrote it; this one does not
        buf.begin([False, False])
        buf.record(s0, torch.tensor(3.0))
        buf.update_gate()
        assert float(buf.gate) == 0.0 and float(buf.values[s1]) == UNWRITTEN
        assert not sm.should_run_forward_backward(iteration=1)
        assert sm.should_checkpoint_and_exit() == (False, False, 0)


def test_gate_takes_the_verdicts_the_read_takes() -> None:
    """NaN in a NaN slot and Inf in an Inf slot gate the step; NaN in an Inf-only slot or a
    non-fatal slot under the fatal-only policy does not."""
    cases = [("nan", torch.isnan, math.nan, True, True), ("inf", torch.isinf, math.inf, True, True),
             ("inf-only", torch.isinf, math.nan, True, False),
             ("nan-only", torch.isnan, math.inf, True, False),
             ("non-fatal", torch.isnan, math.nan, False, False)]  # fmt: skip
    for name, func, value, fatal, gated in cases:
        buf = ValidationBuffer("cpu", may_inject=False)
        slot = buf.add_check(name, func, fatal=fatal)
        buf.set_gate_policy(gate_non_fatal=False)
        buf.begin([False])
        buf.record(slot, torch.tensor(value))
        buf.update_gate()
        assert float(buf.gate) == (1.0 if gated else 0.0), name


def test_paired_gate_equals_the_general_gate_and_is_used_only_when_exact() -> None:
    """Values checked for NaN and Inf together (how the loss and grad checks record) take the
    two-op "any value not finite" gate; it gates exactly as the general one. A NaN-only slot
    written alone, a LARGE slot or a possible injection keeps the general gate."""
    values = [1.0, -2.0, math.nan, math.inf, -math.inf, UNWRITTEN]
    rows = (("nan", torch.isnan), ("inf", torch.isinf))
    for a in values:
        for b in values:
            gates = []
            for paired in (True, False):
                buf = ValidationBuffer("cpu", may_inject=False)
                slots = [buf.add_check(f"{name}{i}", f) for i in range(2) for name, f in rows]
                buf.begin([False] * 4)
                buf.record_run(slots[0], 2, torch.tensor([a, b], dtype=torch.float64))
                if not paired:  # the same values, one slot at a time: the general gate
                    buf._paired.clear()
                    buf._unpaired.update(slots)
                assert buf._paired_gate(4) is paired
                buf.update_gate()
                gates.append(float(buf.gate))
            finite = all(math.isfinite(x) for x in (a, b))
            assert gates == [0.0 if finite else 1.0] * 2, (a, b, gates)
    buf = ValidationBuffer("cpu", may_inject=False)
    nan_only = buf.add_check("nan only", torch.isnan)
    buf.begin([False])
    buf.record(nan_only, torch.tensor(math.inf))  # a NaN check of an Inf: not rejected
    assert not buf._paired_gate(1)
    buf.update_gate()
    assert float(buf.gate) == 0.0
    assert not ValidationBuffer("cpu", may_inject=True)._paired_gate(0)


def test_state_dict_ignored_when_world_size_changed(caplog: Any) -> None:
    sm = RerunStateMachine(mode="validate_results")
    sd = sm.state_dict()
    assert sd["ranks"][0]["identity"][1]
    sd["state"] = RerunState.WILL_RERUN_FROM_CHECKPOINT.name
    sd["world_size"] = 8
    other = RerunStateMachine(mode="validate_results")
    other.load_state_dict(sd)
    assert other.state is RerunState.NOT_RUNNING_YET
    assert "World size changed" in caplog.text
