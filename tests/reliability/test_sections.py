"""Section timeouts: parsing, config validation, learning math, ft_state.json, monitor bookkeeping."""

from __future__ import annotations

import json
import logging
import mmap
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from stalwart.reliability.hang import monitor as hb
from stalwart.reliability.hang.sections import (
    FaultToleranceConfig,
    NullSectionMonitor,
    Section,
    SectionMonitor,
    SectionTimeouts,
    build_section_monitor,
    parse_ft_timeouts,
)
from stalwart.reliability.hang.timeouts import (
    FtState,
    ft_state_path,
    learn_timeouts,
    load_ft_state,
    resolve_timeouts,
    save_ft_state,
    select_sections_to_update,
)


def test_parse_ft_timeouts_full_partial_and_nvrx_spelling() -> None:
    t = parse_ft_timeouts("setup=600,step=180,checkpointing=420,out_of_section=600")
    assert t == SectionTimeouts(600, 180, 420, 600)
    assert parse_ft_timeouts("step=30") == SectionTimeouts(step=30)
    assert parse_ft_timeouts(" step:2.5 , out-of-section=9 ") == SectionTimeouts(
        step=2.5, out_of_section=9
    )


@pytest.mark.parametrize(
    "text",
    ["", "step", "step=", "step=abc", "stp=1", "step=1,,setup=2", "step=0", "step=-1",
     "step=inf", "step=nan", "step=1,step=2"],
)  # fmt: skip
def test_parse_ft_timeouts_rejects_bad_input_naming_the_flag(text: str) -> None:
    with pytest.raises(ValueError, match="--ft-timeouts") as info:
        parse_ft_timeouts(text)
    if text in ("step", "stp=1", "step=abc"):
        assert "setup, step, checkpointing, out_of_section" in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"ft_num_warmup_iters": -1}, "--ft-num-warmup-iters"),
        ({"safety_factor": 0.5}, r"FaultToleranceConfig\.safety_factor"),
        ({"blend_alpha": 1.0}, r"FaultToleranceConfig\.blend_alpha"),
        ({"poll_interval_s": 0.0}, r"FaultToleranceConfig\.poll_interval_s"),
        ({"min_steps_for_step_update": 0}, r"FaultToleranceConfig\.min_steps_for_step_update"),
        ({"min_learned_timeout_s": -1.0}, r"FaultToleranceConfig\.min_learned_timeout_s"),
        (
            {"kill_grace_s": float("nan")},
            r"FaultToleranceConfig\.kill_grace_s: must be a number >= 0",
        ),
        ({"abort_grace_s": -0.5}, r"FaultToleranceConfig\.abort_grace_s"),
        ({"stack_dump_wait_s": float("inf")}, r"FaultToleranceConfig\.stack_dump_wait_s"),
        ({"stack_dump_signal": "SIGKILL"}, r"FaultToleranceConfig\.stack_dump_signal"),
    ],
)
def test_config_validation_names_flags(kwargs: dict, flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        FaultToleranceConfig(**kwargs)


def test_exit_signal_must_differ_from_dump_signal() -> None:
    cfg = FaultToleranceConfig(enable_ft=True, stack_dump_signal="SIGUSR2")
    cfg.check_exit_signal(signal.SIGTERM)
    with pytest.raises(ValueError, match="--exit-signal"):
        cfg.check_exit_signal(signal.SIGUSR2)


def test_find_overrun_is_pure() -> None:
    timeouts = (10.0, 1.0, 5.0, 2.0)
    step_open = hb.Snapshot(1, 0, 100.0, 99.0, 100.0, timeouts)
    assert hb.find_overrun(step_open, 100.5) is None
    over = hb.find_overrun(step_open, 101.5)
    assert over is not None and over.section == "step" and over.timeout_s == 1.0
    idle = hb.Snapshot(hb.NO_SECTION, 0, 0.0, 100.0, 100.0, timeouts)
    assert hb.find_overrun(idle, 200.0) is None  # out-of-section not armed yet
    armed = hb.Snapshot(hb.NO_SECTION, hb.FLAG_OUT_OF_SECTION_ARMED, 0.0, 100.0, 100.0, timeouts)
    over = hb.find_overrun(armed, 102.5)
    assert over is not None and over.section == "out_of_section"


def _record(seq: int, section: int, start: float) -> bytes:
    return hb.pack_record(seq, section, 0, start, start - 1.0, start, (10.0, 1.0, 5.0, 2.0))


def test_a_write_stopped_half_way_leaves_the_previous_record() -> None:
    buf = mmap.mmap(-1, hb.RECORD_SIZE)
    hb.write_record(buf, 1, _record(1, 0, 50.0))  # setup opened
    hb.write_record(buf, 2, _record(2, 1, 100.0))  # step opened
    snap = hb.read_snapshot(buf)
    assert snap is not None and snap.section == 1 and snap.section_start == 100.0
    # The worker stops after writing half of record 3 (its slot is the one record 1 used).
    torn = _record(3, 2, 200.0)
    slot = (3 % 2) * hb.SLOT_SIZE
    buf[slot : slot + hb.SLOT_SIZE // 2] = torn[: hb.SLOT_SIZE // 2]
    snap = hb.read_snapshot(buf)
    assert snap is not None and snap.section == 1 and snap.section_start == 100.0
    buf[:] = bytes(hb.RECORD_SIZE)  # nothing valid at all
    assert hb.read_snapshot(buf) is None


def test_unreadable_record_counts_as_no_progress() -> None:
    timeouts = (10.0, 1.0, 5.0, 2.0)
    step_open = hb.Snapshot(1, 0, 100.0, 99.0, 100.0, timeouts)
    # The last valid record keeps ageing: its step overruns as if the record were still there.
    assert hb.judge(step_open, 100.2, 100.5, 600.0) is None
    over = hb.judge(step_open, 100.2, 101.5, 600.0)
    assert over is not None and over.section == "step"
    # Nothing could overrun in the last record (not armed): the time unreadable is judged
    # against its longest timeout; with no valid record ever, against the fallback.
    idle = hb.Snapshot(hb.NO_SECTION, 0, 0.0, 100.0, 100.0, timeouts)
    assert hb.judge(idle, 100.0, 109.0, 600.0) is None
    over = hb.judge(idle, 100.0, 111.0, 600.0)
    assert over is not None and over.section == hb.UNREADABLE and over.timeout_s == 10.0
    assert hb.judge(None, 100.0, 650.0, 600.0) is None
    over = hb.judge(None, 100.0, 701.0, 600.0)
    assert over is not None and over.timeout_s == 600.0
    assert hb.judge(idle, None, 1e9, 600.0) is None  # readable and idle: never a hang


def test_select_sections_follows_megatron_rules() -> None:
    base: dict[str, Any] = dict(
        num_timed_steps=20, num_checkpoints=1, persistent_checkpoint_loaded=True, async_save=False
    )
    # out_of_section is learned at every save with enough evidence, not only at shutdown
    # (Megatron learns it at shutdown only: a job killed before its end never learned it).
    every = {"setup", "step", "checkpointing", "out_of_section"}
    assert select_sections_to_update(**base) == every
    assert "out_of_section" not in select_sections_to_update(**{**base, "num_checkpoints": 0})
    fresh = {**base, "persistent_checkpoint_loaded": False}
    assert select_sections_to_update(**fresh) == {"step", "checkpointing"}
    few = {**base, "num_timed_steps": 15}
    assert "step" not in select_sections_to_update(**few)
    async_ = {**base, "async_save": True}
    assert "checkpointing" not in select_sections_to_update(**async_)


def test_learn_timeouts_factor_blend_and_floor() -> None:
    prev = SectionTimeouts(setup=600, step=180, checkpointing=420, out_of_section=600)
    new, calc = learn_timeouts(
        prev,
        {"step": 2.0, "checkpointing": -1.0},
        previously_calculated=frozenset(),
        safety_factor=5.0,
    )
    assert new.step == 10.0 and new.checkpointing == 420 and calc == {"step"}
    # A second round blends with the previous *learned* value: 0.5 * 10 + 0.5 * 20.
    again, calc2 = learn_timeouts(new, {"step": 4.0}, previously_calculated=calc, safety_factor=5.0)
    assert again.step == pytest.approx(15.0) and calc2 == {"step"}
    floored, _ = learn_timeouts(
        prev, {"step": 0.01}, previously_calculated=frozenset(), safety_factor=5.0, floor_s=30.0
    )
    assert floored.step == 30.0


def test_ft_state_roundtrip_and_resolve(tmp_path: Path) -> None:
    state = FtState(
        SectionTimeouts(step=12.0, checkpointing=99.0), frozenset({"step"}), {"step": 2.4}
    )
    save_ft_state(ft_state_path(tmp_path), state, safety_factor=5.0)
    data = json.loads((tmp_path / "ft_state.json").read_text())
    assert data["timeouts"]["step"] == 12.0 and data["calculated_sections"] == ["step"]
    assert load_ft_state(ft_state_path(tmp_path)) == state
    cfg = FaultToleranceConfig(
        enable_ft=True,
        timeouts=SectionTimeouts(step=180, checkpointing=7),
        min_learned_timeout_s=10.0,
    )
    timeouts, calculated = resolve_timeouts(cfg, tmp_path)
    # Only learned sections are taken from the file; the rest follow the current flags.
    assert timeouts.step == 12.0 and timeouts.checkpointing == 7 and calculated == {"step"}
    assert resolve_timeouts(cfg, tmp_path / "missing") == (cfg.timeouts, frozenset())


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (0.001, "below the 30 s floor"),
        (-5, "not a finite number > 0"),
        (1e30, "above the 86400 s ceiling"),
        ("fast", "not a number"),
        (True, "not a number"),
        (None, "not a number"),
    ],
)
def test_absurd_learned_timeouts_are_rejected_in_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, value: object, reason: str
) -> None:
    payload = {
        "version": 1,
        "timeouts": {"setup": value, "step": value, "checkpointing": 99.0, "out_of_section": 1e-3},
        "calculated_sections": ["setup", "step", "checkpointing", "out_of_section"],
    }
    (tmp_path / "ft_state.json").write_text(json.dumps(payload))
    cfg = FaultToleranceConfig(enable_ft=True, timeouts=SectionTimeouts(setup=600, step=180))
    with caplog.at_level(logging.WARNING):
        timeouts, calculated = resolve_timeouts(cfg, tmp_path)
    # Rejected values fall back to the configured ones; the sane value is still used.
    assert timeouts == SectionTimeouts(setup=600, step=180, checkpointing=99.0)
    assert calculated == {"checkpointing"}
    lines = [
        r.getMessage() for r in caplog.records if "rejected learned timeouts" in r.getMessage()
    ]
    assert len(lines) == 1, caplog.text
    assert reason in lines[0] and "setup" in lines[0] and "using 180 s" in lines[0]
    assert "out_of_section (0.001 s is below" in lines[0]
    # A parseable file with absurd values never breaks load_ft_state either.
    state = load_ft_state(ft_state_path(tmp_path))
    assert state is not None and "out_of_section" in state.calculated_sections


def test_learned_timeouts_stay_within_floor_and_ceiling() -> None:
    huge, _ = learn_timeouts(
        SectionTimeouts(), {"step": 1e12}, previously_calculated=frozenset(), safety_factor=5.0
    )
    assert huge.step == 24 * 3600.0
    nan, calc = learn_timeouts(
        SectionTimeouts(),
        {"step": float("nan")},
        previously_calculated=frozenset(),
        safety_factor=5.0,
    )
    assert nan.step == 180.0 and calc == frozenset()


def test_corrupt_ft_state_is_ignored(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "ft_state.json").write_text("{not json")
    with caplog.at_level(logging.WARNING):
        assert load_ft_state(ft_state_path(tmp_path)) is None
    assert "ignoring" in caplog.text


def test_null_monitor_is_a_noop(tmp_path: Path) -> None:
    mon = build_section_monitor(FaultToleranceConfig(), rank=0, save_dir=tmp_path)
    assert isinstance(mon, NullSectionMonitor)
    with mon, mon.step_section(), mon.section(Section.CHECKPOINTING):
        mon.start_section(Section.STEP)
        mon.end_section(Section.STEP)
    assert mon.maybe_update_timeouts(closing=True) is None
    assert list(tmp_path.iterdir()) == []


def test_calc_timeouts_requires_save() -> None:
    with pytest.raises(ValueError, match="--save"):
        build_section_monitor(FaultToleranceConfig(enable_ft=True, calc_ft_timeouts=True), 0, None)


def _fast_config(**kw: object) -> FaultToleranceConfig:
    base: dict = dict(
        enable_ft=True, calc_ft_timeouts=True, ft_num_warmup_iters=2, min_steps_for_step_update=3,
        min_learned_timeout_s=0.0, poll_interval_s=0.05,
    )  # fmt: skip
    base.update(kw)
    return FaultToleranceConfig(**base)


def test_learned_timeouts_written_reloaded_and_used(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    mon = build_section_monitor(_fast_config(), rank=0, save_dir=tmp_path)
    assert isinstance(mon, SectionMonitor)
    with mon:
        for _ in range(5):  # 2 warm-up steps (still "setup") + 3 timed steps
            with mon.step_section():
                time.sleep(0.01)
        assert mon.maybe_update_timeouts() is not None  # step qualifies after 3 timed steps
        with mon.section(Section.CHECKPOINTING):
            time.sleep(0.02)
        learned = mon.maybe_update_timeouts(closing=True)
    assert learned is not None
    assert 0.05 <= learned.step < 5.0  # ~5 x 10 ms, blended with the first learned value
    assert 0.1 <= learned.checkpointing < 5.0
    assert learned.setup == 600.0  # no persistent checkpoint was loaded
    state = load_ft_state(ft_state_path(tmp_path))
    assert state is not None and state.calculated_sections == {"step", "checkpointing"}
    with caplog.at_level(logging.INFO, logger="stalwart.reliability.hang.sections"):
        again = build_section_monitor(_fast_config(), rank=0, save_dir=tmp_path)
    assert isinstance(again, SectionMonitor)
    with again:
        assert again.timeouts.step == learned.step
    assert "using learned timeouts" in caplog.text


def test_monitor_bookkeeping_warmup_and_misuse(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    mon = SectionMonitor(
        _fast_config(), 0, timeouts=SectionTimeouts(), calculated=frozenset(), save_dir=tmp_path
    )
    mon.start_section(Section.SETUP)
    with mon.step_section(), mon.step_section(is_eval=True):
        assert mon._section is Section.SETUP  # warm-up steps stay in setup
    mon.end_section(Section.STEP)  # not open: warns, does not raise
    with caplog.at_level(logging.WARNING):
        mon.start_section(Section.CHECKPOINTING)
        mon.start_section(Section.STEP)  # closes checkpointing with a warning
    assert "closing checkpointing" in caplog.text
    mon.end_section(Section.STEP)
    mon.start_evaluation()
    assert mon._warmup_seen[True] == 0
    mon.close()
    mon.close()  # idempotent
