"""Parity by construction: every field of every ``ShellConfig`` sub-config (the probes, ``log``,
``rerun``, ``ft``, ``exit``) and the shell's own fields (``run_dir``, ``goodput``, ...) has an
effect on each path (the reference trainer, Lightning, the Hugging Face Trainer, a hand-written
loop on ``stalwart.loop.Shell``) or is refused there in one line naming it as that path spells
it (:class:`stalwart.loop.Names`).

Two runs per path, each with many fields set at once to values unlike their defaults: run A
(every field but the exits': probes, log, rerun with an injected transient error and skips,
hang detection, run directory, no goodput) and run B (the exits: a save interval, an exit
interval, a SIGUSR1 that the handler catches and does not act on). Each field's effect is read
from the files the run wrote, what it printed, and the parts its shell built. ``CHECKS`` is
keyed by (section, field) and walked against the dataclasses: a field without an entry fails
``test_every_shell_field_has_a_check``, and a field a run leaves at its default fails it too.

Where a field's effect cannot show in these runs it is checked on what the path's shell built
from it (``reached``): the hang monitor's NVRx settings (only a hang shows them), the injector's
seed (an injection rate of 1 draws nothing that depends on it), the exits that end a run earlier
than the others (a phase transition, a time budget: the decision the path's shell makes with its
own config and spelling). ``log_energy`` needs NVML: without pynvml every path refuses it in one
line; ``exit.non_persistent_save_interval`` is refused on the frameworks (their checkpoints are
persistent) and honoured by the trainer and the loop (``<save>/non_persistent``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import re
import signal
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

L = pytest.importorskip("lightning.pytorch")
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from parity_paths import (  # noqa: E402
    DEVICE,
    FRAMEWORKS,
    HAS_NVML,
    ITERS,
    REWINDS,
    RUNNERS,
    SIGNALS,
    _run_a,
    _run_b,
)

from stalwart.integrations import hf, lightning  # noqa: E402
from stalwart.loop import Names, Shell, ShellConfig  # noqa: E402
from stalwart.observability.energy import EnergyConfig, EnergyMeter  # noqa: E402
from stalwart.observability.memory import MemoryMonitor  # noqa: E402
from stalwart.observability.memory_release import (  # noqa: E402
    MemoryReleaseConfig,
    UnusedMemoryRelease,
)
from stalwart.observability.metric_names import grouped_name  # noqa: E402
from stalwart.observability.run_dir import iterations_path  # noqa: E402
from stalwart.observability.sinks import TensorBoardSink, WandbSink  # noqa: E402
from stalwart.observability.straggler import StragglerDetector  # noqa: E402
from stalwart.observability.timers import TimingLogOption, TimingMode  # noqa: E402
from stalwart.reliability.exit import ExitConfig, ExitInputs, ExitReason, decide  # noqa: E402
from stalwart.reliability.hang.sections import (  # noqa: E402
    SectionMonitor,
)
from stalwart.reliability.rerun import DEVICE_ID_ENV, RerunConfig  # noqa: E402
from stalwart.train import trainer as trainer_module  # noqa: E402
from stalwart.train.forward_step import gpt_forward_step  # noqa: E402

PATHS = ("trainer", "lightning", "hf", "loop")
SPELLING = {"trainer": Names.CLI, "lightning": Names.LIGHTNING, "hf": Names.HF, "loop": Names.LOOP}


# --------------------------------------------------------------------------------- the runs
@dataclasses.dataclass
class Run:
    path: str
    shell: Shell
    save: Path
    fields: dict[str, Any]
    out: str  # what it printed
    released: int  # the memory release's calls
    signals: dict[str, Any]  # run B: what its first forward saw

    def child(self, kind: type) -> Any:
        sink = self.shell.sink
        return next(c for c in getattr(sink, "children", (sink,)) if isinstance(c, kind))

    def dumps(self, *parts: str) -> Path:
        return Path(self.fields["dumps"].dump_dir, *parts)

    def metrics(self) -> list[dict[str, Any]]:
        text = Path(self.fields["sinks"].metrics_file).read_text()
        return [json.loads(line) for line in text.splitlines() if line]

    def training(self) -> list[dict[str, Any]]:
        return [
            m for m in self.metrics() if m.get("split", "train") == "train" and "iteration" in m
        ]

    def reason(self) -> dict[str, Any]:
        return json.loads((self.save / "exit_reason.json").read_text())

    def spell(self, setting: str) -> str:
        return SPELLING[self.path].spell(setting)


@contextlib.contextmanager
def _spies(built: list[Shell], released: list[str]) -> Iterator[None]:
    original_init, original_build = Shell.__init__, MemoryReleaseConfig.build

    def spy(self: Shell, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        built.append(self)

    def release(self: MemoryReleaseConfig, device: torch.device) -> Any:
        original_build(self, device)  # checked as on CUDA; CPU has no cache to empty: count
        return UnusedMemoryRelease(self.empty_unused_memory_level, lambda: released.append("x"))

    def forward(batch: Any, model: Any) -> Any:
        SIGNALS.maybe_send()
        return gpt_forward_step(batch, model)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Shell, "__init__", spy)
        mp.setattr(MemoryReleaseConfig, "build", release)
        mp.setattr(trainer_module, "gpt_forward_step", forward)
        mp.setenv(DEVICE_ID_ENV, DEVICE)
        yield


def _run(path: str, root: Path, fields: dict[str, Any], sigusr1: bool) -> Run:
    built: list[Shell] = []
    released: list[str] = []
    out = io.StringIO()
    SIGNALS.armed, SIGNALS.seen = sigusr1, {}
    previous = signal.getsignal(signal.SIGUSR1)
    with _spies(built, released), contextlib.redirect_stdout(out):
        RUNNERS[path](root / "save", fields)
    assert signal.getsignal(signal.SIGUSR1) == previous  # the handler was uninstalled
    (shell,) = built[-1:]
    return Run(path, shell, root / "save", fields, out.getvalue(), len(released), SIGNALS.seen)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Run]:
    """Runs A and B of every path; the shell each built and what it wrote and printed."""
    out: dict[tuple[str, str], Run] = {}
    for path in PATHS:
        root = tmp_path_factory.mktemp(f"{path}-a")
        out[(path, "a")] = _run(path, root, _run_a(root, path), sigusr1=False)
        root = tmp_path_factory.mktemp(f"{path}-b")
        out[(path, "b")] = _run(path, root, _run_b(root, path), sigusr1=True)
    return out


# ------------------------------------------------------------------------------- the checks
def _reached(section: str, name: str) -> Callable[[Run], bool]:
    """The path's shell holds the value set (the adapter dropped nothing)."""

    def check(r: Run) -> bool:
        value = (
            getattr(r.shell.config, section)
            if not name
            else getattr(getattr(r.shell.config, section), name)
        )
        return bool(value == (r.fields[section] if not name else getattr(r.fields[section], name)))

    return check


def _dumper_built_from_its_fields(r: Run) -> bool:
    return r.shell.observer.dumper.config == r.fields["dumps"].dump_config(log_interval=1)


def _stats_iterations(r: Run) -> list[int]:
    lines = r.dumps("tensor_stats", "rank0.jsonl").read_text().splitlines()
    return sorted({int(line.split('"iteration": ')[1].split(",")[0]) for line in lines})


def _monitor(r: Run) -> MemoryMonitor:
    return next(p for p in r.shell.log.providers if isinstance(p, MemoryMonitor))


def _trace(r: Run) -> str:
    found = sorted(Path(r.fields["profiler"].profile_dir).glob("trace_rank0_*.json"))
    return str(found[0]) if found else ""


def _tb_tags(r: Run) -> dict[str, list[int]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(r.fields["sinks"].tensorboard_dir)
    acc.Reload()
    return {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _statuses(r: Run) -> list[tuple[int, str]]:
    lines = Path(r.fields["rerun"].result_rejected_tracker_filename).read_text().splitlines()
    new = [line for line in lines if "jobID=old" not in line]
    return [
        (int(x.split(" iteration=")[1].split()[0]), x.split(" status=")[1].split()[0]) for x in new
    ]


def _has(key: str) -> Callable[[Run], bool]:
    return lambda r: any(m.get(key) is not None for m in r.training())


def _checkpoint(r: Run, iteration: int) -> bool:
    names = {"lightning": f"iter_{iteration:07d}.ckpt", "hf": f"checkpoint-{iteration}"}
    return (r.save / names.get(r.path, f"iter_{iteration:07d}")).exists()


def _decided(r: Run, iteration: int, inputs: ExitInputs) -> Any:
    """The decision the path's shell makes with its own exit config and spelling."""

    def spell(name: str) -> str:
        return r.spell(name if name in ("train_iters", "save_dir") else f"exit.{name}")

    return decide(iteration, inputs, r.shell.config.exit, spell=spell)


A = dict[tuple[str, str], Callable[[Run], bool]]
CHECKS_A: A = {
    ("", "train_iters"): lambda r: (r.reason()["iteration"] == ITERS == r.training()[-1]["iteration"]),
    ("", "save_dir"): lambda r: (r.reason()["reason"] == "finished" and (r.save / "progress.txt").exists()),
    ("", "run_dir"): lambda r: ((Path(r.fields["run_dir"]) / "memory.json").exists() and not (r.save / "memory.json").exists()),
    ("", "goodput"): lambda r: (not list(r.save.parent.rglob("goodput.jsonl")) and "goodput" not in r.out),
    ("", "seq_length"): _has("tokens_per_second"),
    ("sinks", "metrics_file"): lambda r: len(r.training()) >= ITERS,
    ("sinks", "tensorboard_dir"): lambda r: any(Path(r.fields["sinks"].tensorboard_dir).glob("events.out.tfevents*")),
    ("sinks", "tensorboard_queue_size"): lambda r: r.child(TensorBoardSink)._writer.max_queue == 7,
    ("sinks", "group_metric_tags"): lambda r: r.child(TensorBoardSink)._tag is grouped_name,
    ("sinks", "wandb_project"): lambda r: r.child(WandbSink)._run.project == "p",
    ("sinks", "wandb_exp_name"): lambda r: r.child(WandbSink)._run.name == "e",
    ("sinks", "wandb_save_dir"): lambda r: Path(r.fields["sinks"].wandb_save_dir).is_dir(),
    ("sinks", "wandb_mode"): lambda r: r.child(WandbSink)._run.disabled is True,
    ("timers", "timing_log_level"): lambda r: r.shell.timers.log_level == 2,
    ("timers", "timing_log_option"): lambda r: r.shell.timers.log_option is TimingLogOption.ALL,
    ("timers", "timing_mode"): lambda r: r.shell.timers.mode is TimingMode.EVENTS,
    ("straggler", "log_straggler"): lambda r: isinstance(r.shell.straggler, StragglerDetector),
    ("straggler", "disable_straggler_on_startup"): lambda r: r.shell.straggler.enabled is False,
    ("straggler", "straggler_threshold"): lambda r: r.shell.straggler.threshold == 1.5,
    ("straggler", "straggler_minmax_count"): lambda r: r.shell.straggler.minmax_count == 2,
    ("memory", "log_memory_interval"): lambda r: (_monitor(r).log_memory_interval == 2 and "memory (MB)" in r.out),
    ("memory", "log_memory_to_tensorboard"): lambda r: _monitor(r).to_tensorboard is True,
    ("energy", "log_energy"): lambda r: isinstance(r.shell.energy, EnergyMeter),
    ("dumps", "dump_dir"): lambda r: r.dumps("params").is_dir(),
    ("dumps", "save_activations_interval"): lambda r: _stats_iterations(r) == [3, 6],
    ("dumps", "log_dgrads"): lambda r: (_dumper_built_from_its_fields(r) and _reached("dumps", "log_dgrads")(r)),
    ("dumps", "log_tokens_per_expert"): lambda r: (_dumper_built_from_its_fields(r) and _reached("dumps", "log_tokens_per_expert")(r)),
    ("dumps", "dump_stats_only"): lambda r: (r.dumps("tensor_stats").is_dir() and not r.dumps("activations").exists()),
    ("dumps", "save_dgrads_interval"): lambda r: r.dumps("dgrads", "iter_0000003").exists(),
    ("dumps", "save_wgrads_interval"): lambda r: r.dumps("wgrads", "iter_0000003").exists(),
    ("dumps", "save_tokens_per_expert_interval"): lambda r: (_dumper_built_from_its_fields(r) and r.shell.observer.dumper.config.save_tokens_per_expert_interval == 3),
    ("dumps", "save_params_interval"): lambda r: r.dumps("params", "iter_0000003").exists(),
    ("profiler", "profile"): lambda r: any(Path(r.fields["profiler"].profile_dir).glob("trace_rank0_*.json")),
    ("profiler", "profile_step_start"): lambda r: "_iters2-" in _trace(r),
    ("profiler", "profile_step_end"): lambda r: _trace(r).endswith("-2.json"),
    ("profiler", "profile_ranks"): lambda r: (_reached("profiler", "profile_ranks")(r) and bool(_trace(r))),
    ("profiler", "use_pytorch_profiler"): lambda r: bool(_trace(r)),
    ("profiler", "profile_dir"): lambda r: (Path(_trace(r)).parent == Path(r.fields["profiler"].profile_dir)),
    ("memory_release", "empty_unused_memory_level"): lambda r: r.released >= ITERS,
    ("progress", "log_progress"): lambda r: "Starting job" in (r.save / "progress.txt").read_text(),
    ("log", "log_interval"): lambda r: ([m["iteration"] for m in r.training()] == list(range(1, ITERS + 1))),
    ("log", "tensorboard_log_interval"): lambda r: _tb_tags(r)["batch/batch-size"] == [2, 4, 6],
    ("log", "log_throughput"): lambda r: re.search(r"iteration \(ms\): [\d.]+ \| throughput per GPU \(TFLOP/s/GPU\)", r.out) is not None,
    ("log", "log_num_zeros_in_grad"): _has("num_zeros"),
    ("log", "log_params_norm"): _has("params_norm"),
    ("log", "log_timers_to_tensorboard"): lambda r: any(t.endswith("forward-backward-time") for t in _tb_tags(r)),
    ("log", "log_loss_scale_to_tensorboard"): lambda r: (not any("loss-scale" in t for t in _tb_tags(r))),
    ("log", "log_world_size_to_tensorboard"): lambda r: any(t.endswith("world-size") for t in _tb_tags(r)),
    ("log", "log_validation_ppl_to_tensorboard"): lambda r: any(k.endswith("validation ppl") for m in r.metrics() for k in m),
    ("log", "log_progress_bar"): lambda r: r.shell.log._progress.enabled is True,
    ("log", "log_timestamp"): lambda r: (" iteration        1/" in r.out and not re.search(r"\[20\d\d-", r.out)),
    ("log", "log_format"): lambda r: "| consumed samples: " in r.out,  # Megatron's line
    ("log", "peak_tflops"): _has("mfu_percent"),
    ("log", "log_every_iteration"): lambda r: not iterations_path(r.fields["sinks"].metrics_file).exists(),
    ("rerun", "rerun_mode"): lambda r: (4, "initial_run") in _statuses(r),
    ("rerun", "check_for_nan_in_loss_and_grad"): lambda r: (r.shell.machine.recorder.checks.nan_and_inf is False),
    ("rerun", "check_for_spiky_loss"): lambda r: r.shell.machine.recorder.checks.spiky_loss is True,
    ("rerun", "check_for_large_grads"): lambda r: r.shell.machine.recorder.checks.large_grads is True,
    ("rerun", "error_injection_rate"): lambda r: len(_statuses(r)) >= 2,
    ("rerun", "error_injection_type"): lambda r: ((4, "first_rerun_not_reproducible") in _statuses(r)),
    ("rerun", "error_injection_seed"): lambda r: _reached("rerun", "error_injection_seed")(r),
    ("rerun", "error_injection_iterations"): lambda r: {i for i, _ in _statuses(r)} == {4},
    ("rerun", "error_injection_ranks"): lambda r: r.shell.machine.injector.ranks == {0},
    ("rerun", "error_injection_devices"): lambda r: r.shell.machine.injector.devices == {DEVICE},
    ("rerun", "error_injection_once"): lambda r: (r.save / ".stalwart_rerun_injected_4_0").exists(),
    ("rerun", "result_rejected_tracker_filename"): lambda r: bool(_statuses(r)),
    ("rerun", "iterations_to_skip"): lambda r: (f"skipping iteration 2 ({r.spell('rerun.iterations_to_skip')})" in r.out),
    ("rerun", "spiky_loss_factor"): lambda r: r.shell.machine.recorder.checks.spiky_loss_factor == 5.0,
    ("rerun", "large_grads_factor"): lambda r: r.shell.machine.recorder.checks.large_grads_factor == 6.0,
    ("rerun", "check_weight_hash_across_dp_replicas_interval"): lambda r: (r.shell.machine.replicas.schedule.interval == 2),
    ("rerun", "check_weight_hash_sample_fraction"): lambda r: r.shell.machine.replicas is not None,
    ("rerun", "rerun_peer_replay"): lambda r: r.shell.machine.peer.enabled is False,
    # The injected transient (iteration 4) is counted against the device under continue.
    ("rerun", "rerun_transient_policy"): lambda r: r.shell.machine.remedies.counts == {f"{socket.gethostname()}/{DEVICE}": 1},
    ("rerun", "rerun_transient_budget"): lambda r: r.shell.machine.remedies.budget == 3,
    ("rerun", "rewind_on_spike"): lambda r: r.shell.machine.remedies.may_rewind() is True,
    ("rerun", "rewind_skip_window"): lambda r: r.shell.rewinder.policy.window == 2,
    ("rerun", "rewind_lr_scale"): lambda r: r.shell.rewinder.policy.lr_scale == 0.5,
    ("rerun", "max_rewinds"): lambda r: r.shell.rewinder.policy.max_rewinds == 2,
    ("ft", "enable_ft"): lambda r: isinstance(r.shell.sections, SectionMonitor),
    ("ft", "calc_ft_timeouts"): lambda r: (r.save / "ft_state.json").exists(),
    **{
        ("ft", name): _reached("ft", name)
        for name in (
            "timeouts",
            "ft_num_warmup_iters",
            "safety_factor",
            "blend_alpha",
            "min_learned_timeout_s",
            "min_steps_for_step_update",
            "poll_interval_s",
            "stack_dump_signal",
            "kill_grace_s",
            "stack_dump_wait_s",
            "abort_grace_s",
        )
    },
}  # fmt: skip

CHECKS_B: A = {
    ("exit", "exit_signal_handler"): lambda r: r.reason()["reason"] == "interval",
    ("exit", "exit_signal"): lambda r: bool(r.signals) and r.reason()["iteration"] == 4,
    ("exit", "exit_on_interrupt"): lambda r: (
        r.signals.get("int") not in (signal.default_int_handler, signal.SIG_DFL)
    ),
    ("exit", "exit_interval"): lambda r: (
        (r.reason()["reason"], r.reason()["iteration"]) == ("interval", 4)
    ),
    ("exit", "save_interval"): lambda r: _checkpoint(r, 2) and _checkpoint(r, 4),
    ("exit", "non_persistent_save_interval"): lambda r: (
        r.save / "non_persistent" / "iter_0000003"
    ).exists(),
    ("exit", "phase_transition_iterations"): lambda r: (
        (d := _decided(r, 5, ExitInputs())).reason is ExitReason.PHASE
        and d.detail == r.spell("exit.phase_transition_iterations")
    ),
    ("exit", "exit_duration_in_mins"): lambda r: (
        (d := _decided(r, 1, ExitInputs(elapsed_minutes_max=2e6))).reason is ExitReason.DURATION
        and r.spell("exit.exit_duration_in_mins") in d.detail
    ),
}
CHECKS = {**CHECKS_A, **CHECKS_B}
# Refused in one line at construction (tested below).
REFUSED = {
    ("exit", "non_persistent_save_interval"): FRAMEWORKS,
    **{("rerun", name): FRAMEWORKS for name in REWINDS},
}


def _fields() -> list[tuple[str, str]]:
    config = ShellConfig(train_iters=1)
    out: list[tuple[str, str]] = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            out += [(f.name, g.name) for g in dataclasses.fields(value)]
        else:
            out.append(("", f.name))
    return out


def _set_value(section: str, name: str, root: Path) -> Any:
    fields = {**_run_a(root, "loop"), **_run_b(root, "loop")}
    if not section:
        return fields.get(name)
    return getattr(fields[section], name)


def test_every_shell_field_has_a_check_and_the_runs_set_it_unlike_its_default(
    tmp_path: Path,
) -> None:
    fields = _fields()
    missing = sorted(set(fields) - set(CHECKS))
    assert not missing, f"ShellConfig fields with no parity check (add one to CHECKS): {missing}"
    assert not sorted(set(CHECKS) - set(fields)), "checks of fields that no longer exist"
    defaults = ShellConfig(train_iters=1)
    framework_owned = {("", "train_iters"), ("", "save_dir")}  # each path's own setting
    same = [
        (s, n)
        for s, n in fields
        if (s, n) not in framework_owned
        if _set_value(s, n, tmp_path)
        == (getattr(getattr(defaults, s), n) if s else getattr(defaults, n))
    ]
    # A transient error is the one injected type a run goes on after (its status is checked).
    expected = [("rerun", "error_injection_type")] + (
        [] if HAS_NVML else [("energy", "log_energy")]
    )
    assert sorted(same) == sorted(expected), same  # a check must fail


@pytest.mark.parametrize("path", PATHS)
def test_every_shell_field_has_its_effect_on_each_path(
    path: str, runs: dict[tuple[str, str], Run]
) -> None:
    failed = []
    for checks, run in ((CHECKS_A, runs[(path, "a")]), (CHECKS_B, runs[(path, "b")])):
        for section in run.fields:
            if section in ("run_dir", "goodput", "seq_length"):
                continue
            assert getattr(run.shell.config, section) == run.fields[section], f"{path}: {section}"
        for (section, name), check in checks.items():
            if (section, name) == ("energy", "log_energy") and not HAS_NVML:
                continue
            if path in REFUSED.get((section, name), ()):
                continue
            if not check(run):
                failed.append(f"{section}.{name}" if section else name)
    assert not failed, f"{path}: no effect of {failed}"


def test_iterations_to_skip_and_the_tracker_files_skips_are_counted_skipped_on_each_path(
    runs: dict[tuple[str, str], Run],
) -> None:
    """Iteration 2 (``iterations_to_skip``) and 5 (the tracker file of an earlier job) are
    skipped: announced as the path spells the setting, logged as skipped, not trained."""
    for path in PATHS:
        r = runs[(path, "a")]
        assert f"skipping iteration 5 ({r.spell('rerun.iterations_to_skip')})" in r.out, path
        skipped = {m["iteration"] for m in r.training() if m.get("skipped_iterations")}
        assert skipped == {2, 5}, (path, skipped)


def test_every_iteration_has_its_row_by_default_on_each_path(
    runs: dict[tuple[str, str], Run],
) -> None:
    """Run B keeps the log's defaults: each path writes one row per iteration it completed
    beside its metrics file (run A turns them off: checked above)."""
    for path in PATHS:
        config = runs[(path, "b")].shell.config
        metrics = config.sinks.metrics_path(config.artefact_dir)
        assert metrics is not None, path
        text = iterations_path(metrics).read_text()
        rows = [json.loads(line)["iteration"] for line in text.splitlines()]
        assert rows == list(range(1, 5)), (path, rows)  # the exit interval ends it at 4


@pytest.mark.parametrize("path", FRAMEWORKS)
def test_a_non_persistent_save_interval_is_refused_by_a_framework_in_one_line(path: str) -> None:
    """A framework's checkpoint is persistent: the setting would outlive the job it was meant
    not to. Refused when the callback is built, named as the callback spells it."""
    callback = lightning.StalwartCallback if path == "lightning" else hf.StalwartCallback
    name = re.escape(SPELLING[path].spell("exit.non_persistent_save_interval"))
    with pytest.raises(ValueError, match=rf"^{name}: the framework's checkpoints are persistent"):
        callback(exit=ExitConfig(non_persistent_save_interval=2))


@pytest.mark.parametrize("path", FRAMEWORKS)
def test_a_spike_rewind_is_refused_by_a_framework_in_one_line(path: str, tmp_path: Path) -> None:
    """The framework owns its loop, its loader and its checkpoint load: a rewind cannot restore
    them in the middle of its fit. Refused when the callback is built, named as it spells it."""
    callback = lightning.StalwartCallback if path == "lightning" else hf.StalwartCallback
    rerun = RerunConfig(
        check_for_spiky_loss=True,
        rewind_on_spike=True,
        result_rejected_tracker_filename=str(tmp_path / "t"),
    )
    name = re.escape(SPELLING[path].spell("rerun.rewind_on_spike"))
    with pytest.raises(ValueError, match=rf"^{name}: a rewind restores a snapshot"):
        callback(rerun=rerun)


@pytest.mark.skipif(HAS_NVML, reason="with NVML the energy meter runs (checked above)")
@pytest.mark.parametrize("path", PATHS)
def test_log_energy_without_nvml_is_refused_in_one_line_on_each_path(
    path: str, tmp_path: Path
) -> None:
    probes = {"energy": EnergyConfig(log_energy=True)}
    name = re.escape(SPELLING[path].spell("energy.log_energy"))
    with pytest.raises(ValueError, match=rf"^{name} needs the 'nvidia-ml-py' package"):
        RUNNERS[path](tmp_path / "save", probes)
