"""Rerun state machine on one process: every diagnosis path, syncs, stats, eval, skip lists."""

from __future__ import annotations

import functools
import logging
import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from test_rerun_harness import (
    Outcome,
    SyncCounter,
    fresh,
    make_batches,
    params,
    restart,
    train,
)

from stalwart.reliability.rerun import (
    DEVICE_ID_ENV,
    EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
    EXIT_CODE_RESUME_TO_DISAMBIGUATE,
    RerunConfig,
    RerunDiagnostic,
    RerunErrorInjector,
    RerunMode,
    RerunState,
    RerunStateMachine,
    read_iterations_to_skip,
    resolve_iterations_to_skip,
)

FAIL_AT = 2
N = 5


def _tracker(path: Path) -> list[dict[str, str]]:
    rows = []
    for line in path.read_text().splitlines():
        fields = dict(part.split("=", 1) for part in line.split(" ") if "=" in part)
        rows.append(fields)
    return rows


def _run(config: RerunConfig, injector: RerunErrorInjector | None, **kw: Any) -> Outcome:
    model, opt = fresh()
    sm = RerunStateMachine(
        mode=config.mode,
        error_injector=injector,
        result_rejected_tracker_filename=config.result_rejected_tracker_filename,
    )
    return train(sm, model, opt, kw.pop("batches", make_batches(N)), config, stop=N, **kw)


def _reference_params(steps: int) -> list[torch.Tensor]:
    model, opt = fresh()
    sm = RerunStateMachine(mode="disabled")
    train(sm, model, opt, make_batches(N), RerunConfig(rerun_mode="disabled"), stop=steps)
    return params(model)


def test_fault_free_validate_mode_matches_disabled_and_syncs_once(monkeypatch: Any) -> None:
    counter = SyncCounter(monkeypatch)
    out = _run(RerunConfig(check_for_spiky_loss=True), None, counter=counter)
    assert (out.code, out.passes) == (0, N)
    assert counter.count == N  # exactly one host read per iteration for all checks together
    monkeypatch.undo()
    for a, b in zip(params(out.model), _reference_params(N)):
        assert torch.equal(a, b)


def test_transient_error_exits_17_without_checkpoint(tmp_path: Path) -> None:
    tracker = tmp_path / "rejected.txt"
    config = RerunConfig(result_rejected_tracker_filename=str(tracker))
    inj = RerunErrorInjector(1, "transient_error", at_iterations={FAIL_AT})
    out = _run(config, inj)
    assert (out.code, out.checkpoint, out.iteration) == (
        EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
        None,
        FAIL_AT,
    )
    assert out.passes == FAIL_AT + 2  # the failed iteration ran twice
    rows = _tracker(tracker)
    assert [r["status"] for r in rows] == ["initial_run", "first_rerun_not_reproducible"]
    assert {r["iteration"] for r in rows} == {str(FAIL_AT + 1)}  # numbered as logged
    # The optimizer never stepped on the rejected iteration.
    for a, b in zip(params(out.model), _reference_params(FAIL_AT)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["persistent_error", "correct_result"])
def test_reproducible_error_checkpoint_restart_and_diagnosis(
    kind: str, tmp_path: Path, monkeypatch: Any
) -> None:
    tracker = tmp_path / "rejected.txt"
    config = RerunConfig(result_rejected_tracker_filename=str(tracker))
    monkeypatch.setenv(DEVICE_ID_ENV, "gpu0")
    first = _run(config, RerunErrorInjector(1, kind, at_iterations={FAIL_AT}))
    assert first.code == EXIT_CODE_RESUME_TO_DISAMBIGUATE and first.checkpoint is not None
    assert first.checkpoint["iteration"] == FAIL_AT
    for a, b in zip(params(first.model), _reference_params(FAIL_AT)):
        assert torch.equal(a, b)
    ck = first.checkpoint

    # Resumed on the same device: exit 16 again, no new checkpoint.
    sm, model, opt, start = restart(ck, config, RerunErrorInjector(1, kind))
    again = train(sm, model, opt, make_batches(N), config, start=start, stop=N)
    assert (again.code, again.checkpoint) == (EXIT_CODE_RESUME_TO_DISAMBIGUATE, None)
    assert sm.state is RerunState.RERUNNING_AGAIN_FROM_CHECKPOINT

    # Resumed on a different device: the diagnosis.
    monkeypatch.setenv(DEVICE_ID_ENV, "gpu1")
    sm, model, opt, start = restart(ck, config, RerunErrorInjector(1, kind))
    second = train(sm, model, opt, make_batches(N), config, start=start, stop=N)
    assert second.code == EXIT_CODE_FAILED_ON_RESULT_VALIDATION
    assert sm.judge.diagnosis is RerunDiagnostic(kind)
    rows = _tracker(tracker)
    expected_second = "second_rerun_not_reproducible"
    if kind == "correct_result":
        expected_second = "second_rerun_reproducible"
    assert [r["status"] for r in rows] == [
        "initial_run",
        "first_rerun_reproducible",
        expected_second,
    ]
    assert {r["iteration"] for r in rows} == {str(FAIL_AT + 1)}  # numbered as logged
    assert {r["device"] for r in rows} == {"gpu0", "gpu1"}

    # Skip list round trip: a real (reproduced) bad result is skipped at the same iteration.
    skip = read_iterations_to_skip(str(tracker))
    assert skip == ([FAIL_AT + 1] if kind == "correct_result" else [])
    if skip:
        assert resolve_iterations_to_skip(config) == [FAIL_AT + 1]
        model, opt = fresh()
        sm = RerunStateMachine(mode="validate_results")
        done = train(sm, model, opt, make_batches(N), config, start=start, stop=N, skip=skip)
        assert done.code == 0


def test_genuine_nan_in_first_iteration_is_validated() -> None:
    out = _run(RerunConfig(), None, batches=make_batches(N, nan_at={0}))
    assert (out.code, out.iteration, out.passes) == (EXIT_CODE_RESUME_TO_DISAMBIGUATE, 0, 2)


def _spiky_only(sm: RerunStateMachine, loss: torch.Tensor, config: RerunConfig) -> None:
    spiky = functools.partial(sm.is_unexpectedly_large, threshold=10, context="loss", num_samples=3)
    sm.validate_result(loss, spiky, "Spiky loss", tolerance=0.0, fatal=False)


def test_spiky_loss_is_non_fatal_and_training_continues(tmp_path: Path) -> None:
    tracker = tmp_path / "t.txt"
    config = RerunConfig(result_rejected_tracker_filename=str(tracker), check_for_spiky_loss=True)
    batches = make_batches(N, spike_at={N - 1})
    out = _run(config, None, batches=batches, loss_check=_spiky_only, grad_check=False)
    assert (out.code, out.passes) == (0, N + 1)
    rows = _tracker(tracker)
    assert [r["status"] for r in rows] == ["initial_run", "first_rerun_reproducible"]
    assert {r["iteration"] for r in rows} == {str(N)}  # loop index N - 1


def test_non_fatal_injection_continues_and_injection_resumes() -> None:
    config = RerunConfig()
    inj = RerunErrorInjector(1, "persistent_error", at_iterations={1, 3})
    out = _run(config, inj, loss_check=_spiky_only, grad_check=False)
    assert (out.code, out.passes) == (0, N + 2)  # both injections rehearsed, none left pending
    assert inj.pending is None


def test_report_determinism_stats_runs_twice_and_reports(caplog: Any) -> None:
    noise = random.Random(1)  # not restored between runs: makes results differ a little

    def noisy(sm: RerunStateMachine, loss: torch.Tensor, config: RerunConfig) -> None:
        sm.validate_result(loss * (1 + 1e-6 * noise.random()), torch.isnan, "noisy loss")
        sm.validate_result(loss, torch.isnan, "exact loss")

    config = RerunConfig(rerun_mode="report_stats")
    assert config.mode is RerunMode.REPORT_DETERMINISM_STATS
    with caplog.at_level(logging.WARNING):
        out = _run(config, None, loss_check=noisy, grad_check=False)
    assert (out.code, out.passes) == (0, 2 * N)
    report = caplog.text
    assert "Stats on computation determinism" in report
    assert "From validation call 'noisy loss': 6/0 total/identical samples" in report
    assert "p50=" in report and "p99.9=" in report
    assert "From validation call 'exact loss': 6 samples, all identical" in report


def test_stats_mode_still_rejects_nan() -> None:
    with pytest.raises(RuntimeError, match="NaN in local forward loss"):
        _run(
            RerunConfig(rerun_mode="report_determinism_stats"),
            None,
            batches=make_batches(N, nan_at={1}),
        )


def test_disabled_mode_raises_on_nan_and_warns_on_spike(caplog: Any) -> None:
    with pytest.raises(RuntimeError, match="iteration 2: Unexpected result nan"):
        _run(RerunConfig(rerun_mode="disabled"), None, batches=make_batches(N, nan_at={1}))


def test_eval_with_disabled_context() -> None:
    sm = RerunStateMachine(mode="validate_results")
    with pytest.raises(RuntimeError, match="outside the forward-backward pass"):
        sm.validate_result(torch.tensor(1.0), torch.isnan, "eval loss")
    with sm.disabled():
        assert sm.get_mode() is RerunMode.DISABLED
        sm.validate_result(torch.tensor(1.0), torch.isnan, "eval loss")
    assert sm.get_mode() is RerunMode.VALIDATE_RESULTS
    with pytest.raises(RuntimeError, match="eval loss"), sm.disabled():
        sm.validate_result(torch.tensor(math.nan), torch.isnan, "eval loss")
    assert sm.get_mode() is RerunMode.VALIDATE_RESULTS
    # Eval in the middle of nothing does not disturb the next training iteration.
    assert sm.should_run_forward_backward(iteration=0)
    sm.validate_result(torch.tensor(1.0), torch.isnan, "loss")
    assert not sm.should_run_forward_backward()
    assert sm.should_checkpoint_and_exit() == (False, False, 0)
