"""Two gloo ranks: exit inputs agreed in one collective; learned FT timeouts agreed by MAX.

One spawned job covers both (each rank pays ~3 s for ``import torch`` on the CI machine).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from stalwart.distributed import collectives
from stalwart.reliability.exit import ExitConfig, ExitDecision, decide, gather_exit_inputs
from stalwart.reliability.hang.sections import FaultToleranceConfig, Section, build_section_monitor
from stalwart.reliability.signals import DistributedSignalHandler

from dist_utils import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _summary(it: int, d: ExitDecision) -> tuple[int, str | None, str]:
    return (it, d.reason.value if d.reason else None, d.save.value)


def _exit_scenarios(rank: int) -> dict[str, object]:
    calls = 0
    original = collectives.all_reduce_floats

    def counting(*args: object, **kwargs: object) -> list[float]:
        nonlocal calls
        calls += 1
        return original(*args, **kwargs)  # type: ignore[arg-type]

    collectives.all_reduce_floats = counting  # type: ignore[assignment]
    out: dict[str, object] = {}
    # Only rank 1 receives the exit signal, at iteration 3.
    cfg = ExitConfig(exit_signal_handler=True, exit_signal="SIGUSR1", save_interval=100)
    with DistributedSignalHandler(signal.SIGUSR1) as handler:
        for it in range(1, 11):
            if rank == 1 and it == 3:
                os.kill(os.getpid(), signal.SIGUSR1)
            d = decide(it, gather_exit_inputs(cfg, handler, 0.0), cfg)
            if d.exit:
                out["signal"] = _summary(it, d)
                break
    out["calls_signal"] = calls
    # Rank 0's clock runs 5 minutes ahead; the budget is 6 minutes.
    cfg = ExitConfig(exit_duration_in_mins=6.0)
    for it in range(1, 11):
        elapsed = float(it) + (5.0 if rank == 0 else 0.0)
        d = decide(it, gather_exit_inputs(cfg, None, elapsed), cfg)
        if d.exit:
            out["duration"] = _summary(it, d)
            break
    out["calls_total"] = calls
    collectives.all_reduce_floats = original  # type: ignore[assignment]
    return out


def _learn(rank: int, save_dir: str) -> dict[str, float]:
    cfg = FaultToleranceConfig(
        enable_ft=True, calc_ft_timeouts=True, ft_num_warmup_iters=0, min_steps_for_step_update=2,
        min_learned_timeout_s=0.0, poll_interval_s=0.05,
    )  # fmt: skip
    with build_section_monitor(cfg, rank, save_dir) as mon:
        for _ in range(2):
            with mon.step_section():
                time.sleep(0.01 if rank == 0 else 0.1)  # rank 1 is the slow one
        with mon.section(Section.CHECKPOINTING):
            time.sleep(0.01)
        learned = mon.maybe_update_timeouts(closing=True)
    assert learned is not None
    return learned.as_dict()


def _body(rank: int, world_size: int, save_dir: str) -> tuple[dict[str, object], dict[str, float]]:
    return _exit_scenarios(rank), _learn(rank, save_dir)


def test_ranks_agree_on_exit_and_learned_timeouts(tmp_path: Path) -> None:
    (e0, t0), (e1, t1) = run_distributed(_body, world_size=2, args=(str(tmp_path),))
    assert e0 == e1
    assert e0["signal"] == (3, "signal", "persistent")
    assert e0["calls_signal"] == 3  # one collective per iteration
    assert e0["duration"] == (2, "duration", "persistent")
    assert e0["calls_total"] == 5
    assert t0 == t1
    assert t0["step"] >= 5.0 * 0.1  # the slowest rank sets the timeout
    state = json.loads((tmp_path / "ft_state.json").read_text())
    assert state["timeouts"]["step"] == t0["step"]
    assert sorted(state["calculated_sections"]) == ["checkpointing", "step"]
