"""The four paths of the parity test (``test_probe_parity.py``): the reference trainer (its
flags, then its Python config), Lightning, the Hugging Face Trainer and a hand-written loop,
each run with a ``ShellConfig``'s fields; and the two runs' settings."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
import transformers

from stalwart.checkpoint import CheckpointManager
from stalwart.distributed.process_group import DistributedContext
from stalwart.integrations import hf, lightning
from stalwart.loop import ShellConfig
from stalwart.loop.shell_config import PROBES
from stalwart.observability.dumps import TensorDumpConfig
from stalwart.observability.energy import EnergyConfig
from stalwart.observability.memory import MemoryConfig
from stalwart.observability.memory_release import MemoryReleaseConfig
from stalwart.observability.profiler import ProfilerConfig
from stalwart.observability.progress_log import ProgressLogConfig
from stalwart.observability.sinks import SinkConfig
from stalwart.observability.straggler import StragglerConfig
from stalwart.observability.timers import TimerConfig
from stalwart.observability.train_log import LogConfig
from stalwart.reliability.exit import ExitConfig
from stalwart.reliability.hang.sections import FaultToleranceConfig, SectionTimeouts
from stalwart.reliability.rerun import RerunConfig, RerunDataIterator
from stalwart.train.trainer import Trainer

from train_utils import make_config

ITERS, VOCAB, SEQ = 6, 64, 8
HAS_NVML = importlib.util.find_spec("pynvml") is not None
DEVICE = "parity-dev"  # STALWART_DEVICE_ID of every run: the injection targets it
FRAMEWORKS = ("lightning", "hf")  # their checkpoints are persistent; they own their loop
REWINDS = {
    "rewind_on_spike": True,
    "rewind_skip_window": 2,
    "rewind_lr_scale": 0.5,
    "max_rewinds": 2,
}


# ------------------------------------------------------------------------------- the settings
def _probes(root: Path) -> dict[str, Any]:
    """Every probe field unlike its default (``log_energy`` aside: see the module docstring)."""
    return {
        "sinks": SinkConfig(
            metrics_file=str(root / "m.jsonl"),
            tensorboard_dir=str(root / "tb"),
            tensorboard_queue_size=7,
            group_metric_tags=True,
            wandb_project="p",
            wandb_exp_name="e",
            wandb_save_dir=str(root / "wb"),
            wandb_mode="disabled",
        ),
        "timers": TimerConfig(timing_log_level=2, timing_log_option="all", timing_mode="events"),
        "straggler": StragglerConfig(
            log_straggler=True,
            disable_straggler_on_startup=True,
            straggler_threshold=1.5,
            straggler_minmax_count=2,
        ),
        "memory": MemoryConfig(log_memory_interval=2, log_memory_to_tensorboard=True),
        "energy": EnergyConfig(log_energy=HAS_NVML),
        "dumps": TensorDumpConfig(
            dump_dir=str(root / "dumps"),
            save_activations_interval=3,
            log_dgrads=True,
            log_tokens_per_expert=True,
            dump_stats_only=True,
            save_dgrads_interval=3,
            save_wgrads_interval=3,
            save_tokens_per_expert_interval=3,
            save_params_interval=3,
        ),
        "profiler": ProfilerConfig(
            profile=True,
            profile_step_start=1,
            profile_step_end=2,
            profile_ranks=[0, 1],
            use_pytorch_profiler=True,
            profile_dir=str(root / "prof"),
        ),
        "memory_release": MemoryReleaseConfig(empty_unused_memory_level=2),
        "progress": ProgressLogConfig(log_progress=True),
    }


def _tracker(root: Path) -> str:
    """A tracker file from an earlier job: iteration 5 reproduced twice on rank 0 (a skip)."""
    path = root / "tracker.txt"
    line = (
        "ts=2026-01-01 node=n device=d jobID=old rank=0 iteration=5 "
        "status=first_rerun_reproducible result=1.0 message='x'\n"
    )
    path.write_text(line * 2)
    return str(path)


def _run_a(root: Path, path: str) -> dict[str, Any]:
    """Run A: every field but the exits', each unlike its default (a framework refuses the
    spike rewind: tested below)."""
    rewinds = {} if path in FRAMEWORKS else REWINDS
    return {
        **_probes(root),
        "run_dir": str(root / "run"),
        "goodput": False,
        "seq_length": SEQ,
        "log": LogConfig(
            log_interval=1,
            tensorboard_log_interval=2,
            log_throughput=True,
            log_num_zeros_in_grad=True,
            log_params_norm=True,
            log_timers_to_tensorboard=True,
            log_loss_scale_to_tensorboard=False,
            log_world_size_to_tensorboard=True,
            log_validation_ppl_to_tensorboard=True,
            log_progress_bar=True,
            log_timestamp=False,
            log_format="megatron",
            peak_tflops=1.0,
            log_every_iteration=False,
        ),
        "rerun": RerunConfig(
            rerun_mode="validate_results",
            check_for_nan_in_loss_and_grad=False,
            check_for_spiky_loss=True,
            check_for_large_grads=True,
            error_injection_rate=1,
            error_injection_type="transient_error",
            error_injection_seed=7,
            error_injection_iterations=[4],
            error_injection_ranks=[0],
            error_injection_devices=[DEVICE],
            error_injection_once=True,
            result_rejected_tracker_filename=_tracker(root),
            iterations_to_skip=[2],
            spiky_loss_factor=5.0,
            large_grads_factor=6.0,
            check_weight_hash_across_dp_replicas_interval=2,
            check_weight_hash_sample_fraction=0.5,
            rerun_peer_replay=False,
            rerun_transient_policy="continue",
            rerun_transient_budget=3,
            **rewinds,
        ),
        "ft": FaultToleranceConfig(
            enable_ft=True,
            calc_ft_timeouts=True,
            ft_num_warmup_iters=1,
            safety_factor=7.0,
            timeouts=SectionTimeouts(setup=300, step=301, checkpointing=302, out_of_section=303),
            blend_alpha=0.25,
            min_learned_timeout_s=31.0,
            min_steps_for_step_update=2,
            poll_interval_s=0.5,
            stack_dump_signal="SIGHUP",
            kill_grace_s=1.0,
            stack_dump_wait_s=2.0,
            abort_grace_s=3.0,
        ),
    }


def _run_b(root: Path, path: str) -> dict[str, Any]:
    """Run B: the exits (a framework refuses the non-persistent interval: tested below)."""
    non_persistent = None if path in FRAMEWORKS else 3
    exits = ExitConfig(
        exit_signal_handler=False,
        exit_signal="SIGUSR1",
        exit_duration_in_mins=1e6,
        exit_interval=4,
        phase_transition_iterations=(5,),
        save_interval=2,
        non_persistent_save_interval=non_persistent,
        exit_on_interrupt=True,
    )
    return {"exit": exits}


# ---------------------------------------------------------------------------- the four paths
class Signals:
    """What the first forward saw: the SIGUSR1 it sent was caught (not the default action, which
    ends the process) and the handlers then installed."""

    def __init__(self) -> None:
        self.armed = False
        self.seen: dict[str, Any] = {}

    def maybe_send(self) -> None:
        if self.armed:
            self.armed = False
            self.seen = {"int": signal.getsignal(signal.SIGINT)}
            os.kill(os.getpid(), signal.SIGUSR1)


SIGNALS = Signals()


def _llama() -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=SEQ,
    )
    return transformers.LlamaForCausalLM(config)


def _tokens(n: int = 48) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(7))
    return [{"input_ids": row, "labels": row} for row in ids]


def _trainer(save: Path, fields: dict[str, Any]) -> None:
    probes = {name: fields[name] for name in PROBES if name in fields}
    flags = [
        "--train-iters",
        str(ITERS),
        "--save",
        str(save),
        "--log-interval",
        "1",
        "--eval-interval",
        "3",
        "--eval-iters",
        "1",
        *_flags(probes),
    ]
    config = make_config(*flags)
    for name, probe in probes.items():
        assert getattr(config.shell, name) == probe, name  # the flags map one to one
    rest = {
        k: v for k, v in fields.items() if k not in PROBES and k not in ("run_dir", "seq_length")
    }
    config = dataclasses.replace(config, shell=dataclasses.replace(config.shell, **rest))
    if "run_dir" in fields:
        config = config.replace_shared(run_dir=fields["run_dir"])
    with Trainer(config, DistributedContext()) as trainer:
        trainer.train()


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
                argv += [flag, str(getattr(value, "value", value))]
    return argv


class _Module(lightning.GuardedModule, L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = _llama()

    def forward_step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        SIGNALS.maybe_send()
        return self.model(**batch).loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _lightning(save: Path, fields: dict[str, Any]) -> None:
    callback = lightning.StalwartCallback(str(save), **fields)
    trainer = L.Trainer(
        max_steps=ITERS,
        accelerator="cpu",
        devices=1,
        callbacks=[callback],
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        val_check_interval=3,
        limit_val_batches=1,
        num_sanity_val_steps=0,
    )
    loader = torch.utils.data.DataLoader(_tokens(), batch_size=4, shuffle=False)
    val = torch.utils.data.DataLoader(_tokens(4), batch_size=4)
    trainer.fit(_Module(), loader, val)


class _HFModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = _llama()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        if self.training:
            SIGNALS.maybe_send()
        return self.model(input_ids=input_ids, labels=labels)


def _hf(save: Path, fields: dict[str, Any]) -> None:
    callback = hf.StalwartCallback(**fields)
    args = transformers.TrainingArguments(
        str(save),
        max_steps=ITERS,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=3,
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        eval_strategy="steps",
        eval_steps=3,
        per_device_eval_batch_size=4,
    )
    hf.StalwartTrainer(
        model=_HFModel(),
        args=args,
        train_dataset=_tokens(),
        eval_dataset=_tokens(4),
        callbacks=[callback],
    ).train()


def _loop(save: Path, fields: dict[str, Any]) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    data = RerunDataIterator([torch.randn(4, 4) for _ in range(2 * ITERS)])  # rewindable

    def forward(batch: torch.Tensor, m: torch.nn.Module) -> torch.Tensor:
        SIGNALS.maybe_send()
        return m(batch).square().mean()

    config = ShellConfig(train_iters=ITERS, save_dir=str(save), **fields)
    with config.build() as shell:
        step = shell.step(model, optimizer, forward, data)
        if shell.config.log.log_throughput:
            shell.set_flops(6 * 4 * 41)  # 6 x the samples x the parameters (a Linear stack)
        ckpt = shell.checkpointer(CheckpointManager(str(save)), model, optimizer, data=data)
        shell.start(ckpt)
        while True:
            with shell.iteration() as it:
                result = step.run(it, launch_next=it.number % 3 != 0)
            shell.record(result, batch_size=4)
            if shell.completed % 3 == 0 and not result.verdict.exit:
                with shell.evaluation():
                    shell.record_eval(step.evaluate(iter([torch.randn(4, 4)]), 1))
            if shell.act(shell.decide(result), ckpt) is not None:
                break
        ckpt.close()


RUNNERS: dict[str, Callable[[Path, dict[str, Any]], None]] = {
    "trainer": _trainer,
    "lightning": _lightning,
    "hf": _hf,
    "loop": _loop,
}
