"""Rerun state machine on 2 gloo ranks: agreement, fatal-beats-continue, DDP grad hook."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from dist_utils import run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reliability"))
from test_rerun_harness import fresh, make_batches, params, restart, train

from stalwart.reliability.rerun import (
    DEVICE_ID_ENV,
    RerunConfig,
    RerunDiagnostic,
    RerunErrorInjector,
    RerunStateMachine,
    register_grad_check_hook,
)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
N = 4


def _nan_and_spike(sm: RerunStateMachine, loss: torch.Tensor, config: RerunConfig) -> None:
    sm.validate_result(loss, torch.isnan, "found NaN in local forward loss calculation")
    spiky = functools.partial(sm.is_unexpectedly_large, threshold=10, context="loss", num_samples=2)
    sm.validate_result(loss, spiky, "Spiky loss", fatal=False)


def _no_loss_check(sm: RerunStateMachine, loss: torch.Tensor, config: RerunConfig) -> None:
    return None


def _transient_on_rank1(rank: int, tracker: str) -> dict[str, Any]:
    config = RerunConfig(result_rejected_tracker_filename=tracker)
    inj = RerunErrorInjector(1, "transient_error", ranks=[1], at_iterations={1})
    model, opt = fresh()
    sm = RerunStateMachine(
        mode="validate_results", error_injector=inj, result_rejected_tracker_filename=tracker
    )
    out = train(sm, model, opt, make_batches(N, seed=rank), config, stop=N)
    return {"code": out.code, "passes": out.passes, "has_event": sm.judge.event is not None}


def _fatal_beats_continue(rank: int, tracker: str) -> dict[str, Any]:
    os.environ[DEVICE_ID_ENV] = f"gpu{rank}"
    config = RerunConfig(result_rejected_tracker_filename=tracker)
    batches = make_batches(
        N, seed=rank, nan_at={2} if rank == 1 else (), spike_at={2} if rank == 0 else ()
    )
    model, opt = fresh()
    sm = RerunStateMachine(mode="validate_results", result_rejected_tracker_filename=tracker)
    first = train(sm, model, opt, batches, config, stop=N, loss_check=_nan_and_spike)
    assert first.checkpoint is not None
    identities = [r["identity"][1] for r in first.checkpoint["rerun"]["ranks"]]
    os.environ[DEVICE_ID_ENV] = f"gpu{rank + 2}"  # resumed on other GPUs
    sm2, model2, opt2, start = restart(first.checkpoint, config)
    second = train(
        sm2, model2, opt2, batches, config, start=start, stop=N, loss_check=_nan_and_spike
    )
    return {
        "first": (first.code, first.iteration),
        "identities": identities,
        "second": second.code,
        "diagnosis": sm2.judge.diagnosis,
    }


def _ddp_hook(rank: int, world_size: int) -> dict[str, Any]:
    config = RerunConfig()
    results: dict[str, Any] = {}
    for with_hook in (True, False):
        model, opt = fresh()
        ddp = DDP(model)
        sm = RerunStateMachine(mode="validate_results" if with_hook else "disabled")
        if with_hook:
            register_grad_check_hook(ddp, sm.recorder)
        out = train(sm, model, opt, make_batches(N, seed=rank), config, stop=N,
                    loss_check=_no_loss_check, ddp=ddp)  # fmt: skip
        results[f"params_{with_hook}"] = [p.tolist() for p in params(out.model)]
        results[f"passes_{with_hook}"] = out.passes
    # Injected persistent error on rank 0's grad check: both ranks rerun and checkpoint.
    model, opt = fresh()
    ddp = DDP(model)
    inj = RerunErrorInjector(1, "persistent_error", ranks=[0], at_iterations={1})
    sm = RerunStateMachine(mode="validate_results", error_injector=inj)
    register_grad_check_hook(ddp, sm.recorder)
    out = train(sm, model, opt, make_batches(N, seed=rank), config, stop=N,
                loss_check=_no_loss_check, ddp=ddp)  # fmt: skip
    results["inject"] = (out.code, out.iteration, out.passes)
    results["event"] = sm.judge.event.message if sm.judge.event is not None else None
    return results


def _body(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    return {
        "transient": _transient_on_rank1(rank, f"{tmp}/transient.txt"),
        "fatal": _fatal_beats_continue(rank, f"{tmp}/fatal.txt"),
        "ddp": _ddp_hook(rank, world_size),
    }


def test_rerun_two_ranks(tmp_path: Path) -> None:
    r0, r1 = run_distributed(_body, world_size=2, args=(str(tmp_path),), timeout_s=180)

    # Injection on rank 1 only: both ranks rerun iteration 1 and agree on exit 17.
    for r in (r0, r1):
        assert (r["transient"]["code"], r["transient"]["passes"]) == (17, 3)
    assert (r0["transient"]["has_event"], r1["transient"]["has_event"]) == (False, True)
    lines = (tmp_path / "transient.txt").read_text().splitlines()
    # Loop index 1 is iteration 2 in the tracker (numbered as logged).
    assert len(lines) == 2 and all("rank=1 iteration=2 " in line for line in lines)

    # Fatal NaN on rank 1 beats the non-fatal spike on rank 0 (Megatron let "continue" win).
    for r in (r0, r1):
        assert r["fatal"]["first"] == (16, 2)
        assert r["fatal"]["identities"] == ["gpu0", "gpu1"]
        assert r["fatal"]["second"] == 17
    assert r1["fatal"]["diagnosis"] is RerunDiagnostic.CORRECT_RESULT
    assert r0["fatal"]["diagnosis"] is RerunDiagnostic.CORRECT_RESULT  # the spike reproduced too

    # DDP comm hook: averaging identical to DDP's default; rank-0 injection stops both ranks.
    for r in (r0, r1):
        assert r["ddp"]["passes_True"] == N
        for a, b in zip(r["ddp"]["params_True"], r["ddp"]["params_False"]):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b))
        assert r["ddp"]["inject"] == (16, 1, 3)
    assert r0["ddp"]["params_True"] == r1["ddp"]["params_True"]
    assert r0["ddp"]["event"].startswith("found NaN in local grad norm")
    assert r1["ddp"]["event"] is None
