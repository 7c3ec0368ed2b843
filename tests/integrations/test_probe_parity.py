"""Parity by construction: every field of every probe config (``ShellConfig``'s ``PROBES``) has
an effect on each path (the reference trainer through its CLI flags, Lightning, the Hugging Face
Trainer, a hand-written loop on ``stalwart.loop.Shell``) or is refused there in one line.

One run per path with every field set at once to a value unlike its default; then each field's
effect is read from the files the run wrote and from the components its shell built. ``CHECKS``
is keyed by (probe, field) and walked against the dataclass fields: a probe field without an
entry fails ``test_every_probe_field_has_a_check``. ``log_energy`` needs NVML: without pynvml
every path refuses it at start-up in one line naming ``--log-energy`` (with it, the meter runs).
Dump fields that another field masks by design (``--log-dgrads`` under ``--dump-stats-only``
and a Megatron interval; tokens per expert on a model without MoE routers) are checked on the
dumper the path's shell built from them: its ``DumpConfig`` is the one the fields map to.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

L = pytest.importorskip("lightning.pytorch")
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from stalwart.distributed.process_group import DistributedContext  # noqa: E402
from stalwart.integrations import hf, lightning  # noqa: E402
from stalwart.loop import Names, Shell, ShellConfig  # noqa: E402
from stalwart.loop.shell_config import PROBES  # noqa: E402
from stalwart.observability.dumps import TensorDumpConfig  # noqa: E402
from stalwart.observability.energy import EnergyConfig, EnergyMeter  # noqa: E402
from stalwart.observability.memory import MemoryConfig, MemoryMonitor  # noqa: E402
from stalwart.observability.memory_release import (  # noqa: E402
    MemoryReleaseConfig,
    UnusedMemoryRelease,
)
from stalwart.observability.metric_names import grouped_name  # noqa: E402
from stalwart.observability.profiler import ProfilerConfig  # noqa: E402
from stalwart.observability.progress_log import ProgressLogConfig  # noqa: E402
from stalwart.observability.sinks import SinkConfig, TensorBoardSink, WandbSink  # noqa: E402
from stalwart.observability.straggler import StragglerConfig, StragglerDetector  # noqa: E402
from stalwart.observability.timers import TimerConfig, TimingLogOption, TimingMode  # noqa: E402
from stalwart.observability.train_log import LogConfig  # noqa: E402
from stalwart.reliability.rerun import RerunDataIterator  # noqa: E402
from stalwart.train.trainer import Trainer  # noqa: E402

from train_utils import make_config  # noqa: E402

ITERS, VOCAB, SEQ = 4, 64, 8
PATHS = ("trainer", "lightning", "hf", "loop")
HAS_NVML = importlib.util.find_spec("pynvml") is not None


def _probes(root: Path) -> dict[str, Any]:
    """Every probe field unlike its default (``log_energy`` aside: see the module docstring)."""
    return {
        "sinks": SinkConfig(
            metrics_file=str(root / "m.jsonl"), tensorboard_dir=str(root / "tb"),
            tensorboard_queue_size=7, group_metric_tags=True, wandb_project="p",
            wandb_exp_name="e", wandb_save_dir=str(root / "wb"), wandb_mode="disabled",
        ),
        "timers": TimerConfig(timing_log_level=2, timing_log_option="all", timing_mode="events"),
        "straggler": StragglerConfig(
            log_straggler=True, disable_straggler_on_startup=True, straggler_threshold=1.5,
            straggler_minmax_count=2,
        ),
        "memory": MemoryConfig(log_memory_interval=2, log_memory_to_tensorboard=True),
        "energy": EnergyConfig(log_energy=HAS_NVML),
        "dumps": TensorDumpConfig(
            dump_dir=str(root / "dumps"), save_activations_interval=3, log_dgrads=True,
            log_tokens_per_expert=True, dump_stats_only=True, save_dgrads_interval=2,
            save_wgrads_interval=2, save_tokens_per_expert_interval=2, save_params_interval=2,
        ),
        "profiler": ProfilerConfig(
            profile=True, profile_step_start=1, profile_step_end=2, profile_ranks=[0, 1],
            use_pytorch_profiler=True, profile_dir=str(root / "prof"),
        ),
        "memory_release": MemoryReleaseConfig(empty_unused_memory_level=2),
        "progress": ProgressLogConfig(log_progress=True),
    }  # fmt: skip


def _flags(probes: dict[str, Any]) -> list[str]:
    """The trainer's flags for ``probes``: each field is the flag of the same name."""
    argv: list[str] = []
    for config in probes.values():
        for f in dataclasses.fields(config):
            value = getattr(config, f.name)
            if value == f.default or (value is False and f.default is False):
                continue
            flag = "--" + f.name.replace("_", "-")
            if value is True:
                argv.append(flag)
            elif isinstance(value, list):
                argv += [flag, *map(str, value)]
            else:
                argv += [flag, str(value.value if isinstance(value, enum.Enum) else value)]
    return argv


# ---------------------------------------------------------------------------- the four paths
def _llama() -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _tokens() -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, VOCAB, (32, SEQ), generator=torch.Generator().manual_seed(7))
    return [{"input_ids": row, "labels": row} for row in ids]


def _trainer(save: Path, probes: dict[str, Any]) -> None:
    config = make_config("--train-iters", str(ITERS), "--save", str(save),
                         "--log-interval", "1", *_flags(probes))  # fmt: skip
    for name, probe in probes.items():
        assert getattr(config.shell, name) == probe, name  # the flags map one to one
    with Trainer(config, DistributedContext()) as trainer:
        trainer.train()


class _Module(lightning.GuardedModule, L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = _llama()

    def forward_step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _lightning(save: Path, probes: dict[str, Any]) -> None:
    callback = lightning.StalwartCallback(str(save), log=LogConfig(log_interval=1), **probes)
    trainer = L.Trainer(
        max_steps=ITERS, accelerator="cpu", devices=1, callbacks=[callback],
        enable_checkpointing=False, logger=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    loader = torch.utils.data.DataLoader(_tokens(), batch_size=4, shuffle=False)
    trainer.fit(_Module(), loader)


def _hf(save: Path, probes: dict[str, Any]) -> None:
    callback = hf.StalwartCallback(log=LogConfig(log_interval=1), **probes)
    args = transformers.TrainingArguments(
        str(save), max_steps=ITERS, per_device_train_batch_size=4, learning_rate=1e-2,
        save_strategy="no", report_to=[], use_cpu=True, seed=3, logging_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    hf.StalwartTrainer(
        model=_llama(), args=args, train_dataset=_tokens(), callbacks=[callback]
    ).train()


def _loop(save: Path, probes: dict[str, Any]) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = RerunDataIterator(iter([torch.randn(4, 4) for _ in range(ITERS)]))
    config = ShellConfig(train_iters=ITERS, save_dir=str(save), log=LogConfig(log_interval=1),
                         **probes)  # fmt: skip
    with config.build() as shell:
        step = shell.step(model, optimizer, lambda b, m: m(b).square().mean(), batches)
        shell.start()
        for _ in range(ITERS):
            with shell.iteration() as it:
                result = step.run(it, launch_next=False)
            shell.record(result, batch_size=4)
            decision = shell.decide(result)
            if decision.exit:
                shell.finish(decision)
                break


SPELLING = {"trainer": Names.CLI, "lightning": Names.LIGHTNING, "hf": Names.HF, "loop": Names.LOOP}
RUNNERS: dict[str, Callable[[Path, dict[str, Any]], None]] = {
    "trainer": _trainer, "lightning": _lightning, "hf": _hf, "loop": _loop,
}  # fmt: skip


@dataclasses.dataclass
class Run:
    shell: Shell
    save: Path
    probes: dict[str, Any]
    released: int  # the memory release's calls

    def child(self, kind: type) -> Any:
        sink = self.shell.sink
        return next(c for c in getattr(sink, "children", (sink,)) if isinstance(c, kind))

    def dumps(self, *parts: str) -> Path:
        return Path(self.probes["dumps"].dump_dir, *parts)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """One run per path, every probe field set; the shell each built and what it wrote."""
    built: list[Shell] = []
    released: list[str] = []
    original_init, original_build = Shell.__init__, MemoryReleaseConfig.build

    def spy(self: Shell, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        built.append(self)

    def release(self: MemoryReleaseConfig, device: torch.device) -> Any:
        original_build(self, device)  # checked as on CUDA; CPU has no cache to empty: count
        return UnusedMemoryRelease(self.empty_unused_memory_level, lambda: released.append("x"))

    out: dict[str, Run] = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Shell, "__init__", spy)
        mp.setattr(MemoryReleaseConfig, "build", release)
        for path in PATHS:
            root = tmp_path_factory.mktemp(path)
            probes = _probes(root)
            released.clear()
            RUNNERS[path](root / "save", probes)
            (shell,) = built[-1:]
            out[path] = Run(shell, root / "save", probes, len(released))
    return out


def _reached(probe: str, name: str) -> Callable[[Run], bool]:
    """The path's shell holds the value set (the adapter dropped nothing)."""
    return lambda r: getattr(getattr(r.shell.config, probe), name) == getattr(r.probes[probe], name)


def _dumper_built_from_its_fields(r: Run) -> bool:
    dumper = r.shell.observer.dumper
    return dumper.config == r.probes["dumps"].dump_config(log_interval=1)


def _stats_iterations(r: Run) -> list[int]:
    lines = r.dumps("tensor_stats", "rank0.jsonl").read_text().splitlines()
    return [int(line.split('"iteration": ')[1].split(",")[0]) for line in lines]


CHECKS: dict[tuple[str, str], Callable[[Run], bool]] = {
    ("sinks", "metrics_file"): lambda r: Path(r.probes["sinks"].metrics_file).read_text().count("\n") >= ITERS,
    ("sinks", "tensorboard_dir"): lambda r: any(Path(r.probes["sinks"].tensorboard_dir).glob("events.out.tfevents*")),
    ("sinks", "tensorboard_queue_size"): lambda r: r.child(TensorBoardSink)._writer.max_queue == 7,
    ("sinks", "group_metric_tags"): lambda r: r.child(TensorBoardSink)._tag is grouped_name,
    ("sinks", "wandb_project"): lambda r: r.child(WandbSink)._run.project == "p",
    ("sinks", "wandb_exp_name"): lambda r: r.child(WandbSink)._run.name == "e",
    ("sinks", "wandb_save_dir"): lambda r: Path(r.probes["sinks"].wandb_save_dir).is_dir(),
    ("sinks", "wandb_mode"): lambda r: r.child(WandbSink)._run.disabled is True,
    ("timers", "timing_log_level"): lambda r: r.shell.timers.log_level == 2,
    ("timers", "timing_log_option"): lambda r: r.shell.timers.log_option is TimingLogOption.ALL,
    ("timers", "timing_mode"): lambda r: r.shell.timers.mode is TimingMode.EVENTS,
    ("straggler", "log_straggler"): lambda r: isinstance(r.shell.straggler, StragglerDetector),
    ("straggler", "disable_straggler_on_startup"): lambda r: r.shell.straggler.enabled is False,
    ("straggler", "straggler_threshold"): lambda r: r.shell.straggler.threshold == 1.5,
    ("straggler", "straggler_minmax_count"): lambda r: r.shell.straggler.minmax_count == 2,
    ("memory", "log_memory_interval"): lambda r: _monitor(r).log_memory_interval == 2,
    ("memory", "log_memory_to_tensorboard"): lambda r: _monitor(r).to_tensorboard is True,
    ("energy", "log_energy"): lambda r: isinstance(r.shell.energy, EnergyMeter),  # with NVML
    ("dumps", "dump_dir"): lambda r: r.dumps("params").is_dir(),
    ("dumps", "save_activations_interval"): lambda r: _stats_iterations(r) == [3],
    ("dumps", "log_dgrads"): lambda r: _dumper_built_from_its_fields(r) and _reached("dumps", "log_dgrads")(r),
    ("dumps", "log_tokens_per_expert"): lambda r: _dumper_built_from_its_fields(r) and _reached("dumps", "log_tokens_per_expert")(r),
    ("dumps", "dump_stats_only"): lambda r: r.dumps("tensor_stats").is_dir() and not r.dumps("activations").exists(),
    ("dumps", "save_dgrads_interval"): lambda r: r.dumps("dgrads", "iter_0000002").exists(),
    ("dumps", "save_wgrads_interval"): lambda r: r.dumps("wgrads", "iter_0000002").exists(),
    ("dumps", "save_tokens_per_expert_interval"): lambda r: _dumper_built_from_its_fields(r) and r.shell.observer.dumper.config.save_tokens_per_expert_interval == 2,
    ("dumps", "save_params_interval"): lambda r: r.dumps("params", "iter_0000002").exists(),
    ("profiler", "profile"): lambda r: any(Path(r.probes["profiler"].profile_dir).glob("trace_rank0_*.json")),
    ("profiler", "profile_step_start"): lambda r: "_iters2-" in _trace(r),  # <start + 1>-<end>
    ("profiler", "profile_step_end"): lambda r: _trace(r).endswith("-2.json"),
    ("profiler", "profile_ranks"): lambda r: _reached("profiler", "profile_ranks")(r) and bool(_trace(r)),
    ("profiler", "use_pytorch_profiler"): lambda r: bool(_trace(r)),
    ("profiler", "profile_dir"): lambda r: Path(_trace(r)).parent == Path(r.probes["profiler"].profile_dir),
    ("memory_release", "empty_unused_memory_level"): lambda r: r.released >= ITERS,
    ("progress", "log_progress"): lambda r: "Starting job" in (r.save / "progress.txt").read_text(),
}  # fmt: skip


def _monitor(r: Run) -> MemoryMonitor:
    return next(p for p in r.shell.log.providers if isinstance(p, MemoryMonitor))


def _trace(r: Run) -> str:
    found = sorted(Path(r.probes["profiler"].profile_dir).glob("trace_rank0_*.json"))
    return str(found[0]) if found else ""


def _fields() -> list[tuple[str, str]]:
    config = ShellConfig(train_iters=1)
    return [(p, f.name) for p in PROBES for f in dataclasses.fields(getattr(config, p))]


def test_every_probe_field_has_a_check_and_the_runs_set_it_unlike_its_default() -> None:
    fields = _fields()
    missing = sorted(set(fields) - set(CHECKS))
    assert not missing, f"probe fields with no parity check (add one to CHECKS): {missing}"
    assert not sorted(set(CHECKS) - set(fields)), "checks of fields that no longer exist"
    probes, defaults = _probes(Path("/r")), ShellConfig(train_iters=1)
    same = [(p, n) for p, n in fields if getattr(probes[p], n) == getattr(getattr(defaults, p), n)]
    assert same == ([] if HAS_NVML else [("energy", "log_energy")]), same  # a check must fail


@pytest.mark.parametrize("path", PATHS)
def test_every_probe_field_has_its_effect_on_each_path(path: str, runs: dict[str, Run]) -> None:
    run = runs[path]
    for name, probe in run.probes.items():
        assert getattr(run.shell.config, name) == probe, f"{path}: {name} not passed through"
    failed = [
        f"{probe}.{name}"
        for probe, name in _fields()
        if (probe, name) != ("energy", "log_energy") or HAS_NVML
        if not CHECKS[(probe, name)](run)
    ]
    assert not failed, f"{path}: no effect of {failed}"


@pytest.mark.skipif(HAS_NVML, reason="with NVML the energy meter runs (checked above)")
@pytest.mark.parametrize("path", PATHS)
def test_log_energy_without_nvml_is_refused_in_one_line_on_each_path(
    path: str, tmp_path: Path
) -> None:
    probes = {"energy": EnergyConfig(log_energy=True)}
    name = re.escape(SPELLING[path].spell("energy.log_energy"))
    with pytest.raises(ValueError, match=rf"^{name} needs the 'nvidia-ml-py' package"):
        RUNNERS[path](tmp_path / "save", probes)
