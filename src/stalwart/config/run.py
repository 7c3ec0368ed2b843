"""``RunConfig``: every component's typed config in one value, built from the CLI namespace.

Each component owns its dataclass (``GPTConfig`` in models, ``RerunConfig`` in reliability, ...);
this module only aggregates them and checks combinations that span components. Any invalid value
raises ``ValueError`` naming the flag; the CLI turns that into exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import sys
import typing
from dataclasses import dataclass, field
from typing import Any

from stalwart.checkpoint.non_persistent import NonPersistentType
from stalwart.config.checks import bounds, check_fields
from stalwart.config.fast_path import fast_path_values
from stalwart.config.megatron_defaults import megatron_default_differences
from stalwart.config.model import architecture_overrides, check_megatron_model_flags
from stalwart.config.training import CheckpointConfig, DataConfig, OptimizerConfig, TrainingConfig
from stalwart.graphs.checks import CudaGraphImpl
from stalwart.loop.naming import Names
from stalwart.loop.plans import EagerPlan, GraphPlan
from stalwart.loop.shell_config import PROBES, ProbeConfigs, ShellConfig
from stalwart.models import PRESET_MICRO_BATCH_SIZE, GPTConfig, preset_model_config
from stalwart.observability.train_log import LogConfig
from stalwart.reliability.exit import ExitConfig
from stalwart.reliability.faults import FaultInjectionConfig
from stalwart.reliability.hang.sections import FaultToleranceConfig, parse_ft_timeouts
from stalwart.reliability.hang.tiers import check_timeout_hierarchy
from stalwart.reliability.inprocess.config import InProcessConfig
from stalwart.reliability.rerun import RerunConfig
from stalwart.reliability.signals import interrupt_handling_default

# `--demo`: the interactive CPU job of `make demo`: the tiny preset narrowed to 0.45M
# parameters, from 3.7M (the embedded corpus is bytes: a 256-token vocabulary loses nothing; the
# preset's 8192 made the output layer most of the compute) and short sequences: a fresh clone's
# `make demo` is then mostly its install (README: the measured time). Its loss falls from 5.3 to
# 2.7 in 100 iterations (the 3.7M model's fell to 2.7 in 150).
DEMO_DEFAULTS: dict[str, Any] = {
    "seq_length": 128,
    "hidden_size": 128,
    "vocab_size": 256,
    "train_iters": 100,
    "lr": 2e-3,
    "min_lr": 2e-4,
    "lr_warmup_iters": 10,
    "log_interval": 10,
    "eval_interval": 25,
    "eval_iters": 4,
    "num_layers": 2,
}

_MOE_FLAGS = {
    "moe_router_topk": "--moe-router-topk",
    "moe_aux_loss_coeff": "--moe-aux-loss-coeff",
    "moe_capacity_factor": "--moe-expert-capacity-factor",
}


def _check_moe_flags(ns: argparse.Namespace, num_experts: int) -> None:
    """MoE settings on a dense model would be accepted and ignored: a different run than asked."""
    given = [flag for dest, flag in _MOE_FLAGS.items() if getattr(ns, dest, None) is not None]
    if given and num_experts == 0:
        verb = "need" if len(given) > 1 else "needs"
        raise ValueError(
            f"{', '.join(given)} {verb} --num-experts N (>= 1); without it the MLP is dense"
        )


DEFAULT_TRAIN_ITERS = 100  # --train-iters without --train-samples

_MODEL_FLAGS = {
    "num_layers": "num_layers",
    "hidden_size": "hidden_size",
    "num_attention_heads": "num_attention_heads",
    "seq_length": "seq_length",
    "ffn_hidden_size": "ffn_hidden_size",
    "vocab_size": "vocab_size",
    "hidden_dropout": "dropout",
    "num_experts": "num_experts",
    "moe_router_topk": "moe_router_topk",
    "moe_aux_loss_coeff": "moe_aux_loss_coeff",
    "moe_capacity_factor": "moe_capacity_factor",
    "init_method_std": "init_std",
}


@dataclass(kw_only=True, frozen=True)
class GraphConfig:
    """CUDA-graph flags (validated against the rest by ``stalwart.graphs.check_graph_config``).

    Frozen; modes are enums (strings from the CLI are converted once, here).
    """

    cuda_graph_impl: CudaGraphImpl = CudaGraphImpl.NONE
    optimizer_cuda_graph: bool = False
    cuda_graph_warmup_steps: int = field(default=3, metadata=bounds(ge=1))
    # Launch the next iteration's forward-backward replay before this one's validation read
    # (gated optimizer graph only; stalwart.loop.lookahead). Not a Megatron flag.
    cuda_graph_speculative_launch: bool = True
    # Clip + fused AdamW captured inside the full-iteration graph (one graph per iteration, no
    # speculative launch; stalwart.loop.optimizer_in_graph). Not a Megatron flag.
    cuda_graph_include_optimizer: bool = False

    def __post_init__(self) -> None:
        allowed = (CudaGraphImpl.NONE, CudaGraphImpl.FULL_ITERATION)
        try:
            impl = CudaGraphImpl(self.cuda_graph_impl)
        except ValueError:
            impl = None
        if impl in (CudaGraphImpl.LOCAL, CudaGraphImpl.TRANSFORMER_ENGINE):
            raise ValueError(
                f"--cuda-graph-impl {impl.value} (Megatron's per-layer graphs) is not implemented "
                "by stalwart, which graphs the whole iteration; allowed: none, full_iteration"
            )
        if impl not in allowed:
            raise ValueError(
                f"--cuda-graph-impl: got {self.cuda_graph_impl!r}, allowed: none, full_iteration"
            )
        # The one conversion (a frozen dataclass sets it through object.__setattr__).
        object.__setattr__(self, "cuda_graph_impl", impl)
        check_fields(self)  # after the conversion: the fields hold enums from here on
        if self.cuda_graph_include_optimizer and not self.full_iteration:
            raise ValueError(
                "--cuda-graph-include-optimizer needs --cuda-graph-impl full_iteration (the "
                "optimizer step is captured inside the full-iteration graph)"
            )

    @property
    def full_iteration(self) -> bool:
        return self.cuda_graph_impl is CudaGraphImpl.FULL_ITERATION

    @property
    def optimizer_captured(self) -> bool:
        """Whether the optimizer step is in a CUDA graph (its own, or the full iteration's):
        it then needs a capturable optimizer with a device-tensor LR."""
        return self.optimizer_cuda_graph or self.cuda_graph_include_optimizer

    @property
    def any(self) -> bool:
        """Whether any CUDA graph is on (the graph config checks then apply)."""
        return self.full_iteration or self.optimizer_cuda_graph

    def build(self) -> EagerPlan | GraphPlan:
        """The guarded step's plan: graphs for what the flags ask (checked before), else eager.
        ``--optimizer-cuda-graph`` alone is an optimizer graph over an eager forward-backward."""
        if not self.any:
            return EagerPlan()
        return GraphPlan(
            full_iteration=self.full_iteration,
            optimizer_graph=self.optimizer_cuda_graph and not self.cuda_graph_include_optimizer,
            warmup_steps=self.cuda_graph_warmup_steps,
            optimizer_in_graph=self.cuda_graph_include_optimizer,
        )


# The shell's fields that are the run's own values elsewhere (one value each, kept equal).
_SHARED = {
    "train_iters": "training.train_iters",
    "save_dir": "checkpoint.save",
    "seq_length": "model.seq_length",
}


@dataclass(kw_only=True, frozen=True)
class RunConfig:
    """The whole run: one field per component; ``shell`` is the :class:`ShellConfig` the
    trainer's shell is built from (its exits, hang detection, rerun machine, log, probes and run
    directory: declared and checked there once). Frozen: values one component's flags set from
    another's are derived before it is built (`derive_combinations`), and `check_combinations`
    only checks; ``dataclasses.replace`` (or :meth:`replace_shared`) makes a changed copy."""

    preset: str
    model: GPTConfig
    shell: ShellConfig
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    faults: FaultInjectionConfig = field(default_factory=FaultInjectionConfig)
    inprocess: InProcessConfig = field(default_factory=InProcessConfig)
    graphs: GraphConfig = field(default_factory=GraphConfig)
    # Not a setting but where the settings came from: the defaults unlike Megatron's that the
    # run relies on (`stalwart.config.megatron_defaults`; the CLI's first lines count them,
    # run.json lists them). Not compared and not in `to_dict`: the same flags are the same run.
    megatron_defaults: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        for name, path in _SHARED.items():
            component, attribute = path.split(".")
            if getattr(self.shell, name) != getattr(getattr(self, component), attribute):
                raise ValueError(f"RunConfig: shell.{name} differs from {path}")

    def replace_shared(self, **values: Any) -> RunConfig:
        """A copy with ``train_iters``/``save_dir``/``run_dir`` changed where they live (the
        shell and its component), e.g. ``--train-samples``' derived iterations."""
        shell = dataclasses.replace(self.shell, **values)
        changes: dict[str, Any] = {"shell": shell}
        if "train_iters" in values:
            changes["training"] = dataclasses.replace(
                self.training, train_iters=values["train_iters"]
            )
        if "save_dir" in values:
            changes["checkpoint"] = dataclasses.replace(self.checkpoint, save=values["save_dir"])
        return dataclasses.replace(self, **changes)

    def compile_cache_location(self) -> tuple[str, str] | None:
        """(flag, directory) of ``--compile``'s persistent cache: ``--compile-cache-dir``, else
        ``<run dir>/compile_cache``; None without ``--compile`` or without a run directory."""
        from stalwart.compile import DEFAULT_CACHE_DIRNAME

        if not self.training.compile:
            return None
        if self.training.compile_cache_dir is not None:
            return "--compile-cache-dir", self.training.compile_cache_dir
        run_dir = self.shell.run_dir
        flag = "--run-dir" if run_dir else "--save"
        run_dir = run_dir or self.checkpoint.save
        if not run_dir:
            return None
        return f"{flag}'s compile cache", os.path.join(run_dir, DEFAULT_CACHE_DIRNAME)

    @property
    def artefact_dir(self) -> str | None:
        """Where run artefacts go: ``--run-dir``, else ``--save``, else nowhere."""
        return self.shell.artefact_dir

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe nested dict (saved in checkpoints and ``run.json``): each component's
        settings under its name, the shell's sub-configs and ``run_dir`` at the top level as
        before the shell held them (its run-wide values are the other components')."""
        flat = _jsonable(dataclasses.asdict(self))
        del flat["megatron_defaults"]  # provenance, not a setting
        shell = flat.pop("shell")
        ordered = {name: shell[name] for name in PROBES}
        for name in ("preset", "model", "data", "optim", "training", "checkpoint"):
            ordered[name] = flat.pop(name)
        for name in ("log", "run_dir", "rerun", "ft", "exit"):
            ordered[name] = shell[name]
        return {**ordered, **flat}

    def manifest(self) -> dict[str, Any]:
        """``run.json``'s ``config``: :meth:`to_dict` and ``megatron_defaults`` (the defaults
        unlike Megatron's the run relies on)."""
        return {**self.to_dict(), "megatron_defaults": list(self.megatron_defaults)}


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, enum.Enum):
        return value.value if not isinstance(value.value, tuple) else value.name
    return value


def _pick(ns: argparse.Namespace, cls: type, renames: dict[str, str] | None = None) -> Any:
    """Build dataclass ``cls`` from the namespace entries whose names match its fields."""
    renames = renames or {}
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in vars(ns).items():
        target = renames.get(key, key)
        if target in names and value is not None:
            kwargs[target] = value
    return cls(**kwargs)


def _apply_demo_defaults(ns: argparse.Namespace, argv_flags: set[str]) -> None:
    for key, value in DEMO_DEFAULTS.items():
        if key == "train_iters" and getattr(ns, "train_samples", None) is not None:
            continue  # --train-samples counts the run instead
        if key not in argv_flags:
            setattr(ns, key, value)


def _check_sample_flags(ns: argparse.Namespace) -> None:
    """``--train-samples`` and its sample-based LR flags exclude the iteration-based ones.

    ``--train-iters`` is None unless given (its default, 100, is set here), so that a config
    printed by ``--print-config`` and read back stays the same run."""
    if ns.train_samples is None:
        if ns.train_iters is None:
            ns.train_iters = DEFAULT_TRAIN_ITERS
        if ns.lr_warmup_samples or ns.lr_decay_samples is not None:
            raise ValueError("--lr-warmup-samples/--lr-decay-samples need --train-samples")
        return
    if ns.train_iters is not None:
        raise ValueError("--train-iters and --train-samples are mutually exclusive: pick one")
    if ns.lr_warmup_iters or ns.lr_decay_iters is not None:
        raise ValueError(
            "with --train-samples the LR schedule counts samples: use --lr-warmup-samples and "
            "--lr-decay-samples instead of --lr-warmup-iters/--lr-decay-iters"
        )


def explicit_flags(ns: argparse.Namespace, argv: list[str] | None) -> set[str]:
    """Destinations the user set: flags on the command line and keys of ``--config``."""
    return {
        a.split("=")[0].lstrip("-").replace("-", "_") for a in (argv or []) if a[:2] == "--"
    } | set(getattr(ns, "config_file_keys", ()))  # values from --config count as given


def build_run_config(ns: argparse.Namespace, argv: list[str] | None = None) -> RunConfig:
    """Typed, validated config from parsed flags (``argv`` tells which flags were explicit)."""
    explicit = explicit_flags(ns, argv)
    if getattr(ns, "demo", False):
        _apply_demo_defaults(ns, explicit)
    vars(ns).update(fast_path_values(ns))  # compiled full-iteration graphs: the fast same run
    overrides = {
        dst: getattr(ns, src) for src, dst in _MODEL_FLAGS.items() if getattr(ns, src) is not None
    }
    overrides.update(architecture_overrides(ns))  # Llama switches and activation recompute
    model = preset_model_config(ns.preset, **overrides)
    _check_moe_flags(ns, model.num_experts)
    check_megatron_model_flags(ns, model)
    if ns.micro_batch_size is None:
        ns.micro_batch_size = PRESET_MICRO_BATCH_SIZE[ns.preset]
    _check_sample_flags(ns)
    training = _pick(ns, TrainingConfig)
    checkpoint = _pick(ns, CheckpointConfig)
    shell = _shell_config(ns, training, checkpoint.save, model.seq_length)
    config = RunConfig(
        preset=ns.preset,
        model=model,
        shell=shell,
        data=_pick(ns, DataConfig),
        optim=_pick(ns, OptimizerConfig),
        training=training,
        checkpoint=checkpoint,
        faults=_pick(ns, FaultInjectionConfig),
        inprocess=_pick(ns, InProcessConfig),
        graphs=_pick(ns, GraphConfig),
    )
    check_combinations(config)
    relied_on = tuple(megatron_default_differences(config, explicit))
    return dataclasses.replace(config, megatron_defaults=relied_on)


def _shell_config(
    ns: argparse.Namespace, training: TrainingConfig, save: str | None, seq_length: int
) -> ShellConfig:
    """The shell's part of the run from its flags (the run-wide values are the components')."""
    exit_config = ExitConfig(
        exit_signal_handler=ns.exit_signal_handler,
        exit_signal=ns.exit_signal,
        exit_duration_in_mins=ns.exit_duration_in_mins,
        exit_interval=ns.exit_interval,
        phase_transition_iterations=tuple(ns.phase_transition_iterations or ()),
        save_interval=ns.save_interval or None,
        non_persistent_save_interval=ns.non_persistent_save_interval or None,
        # Ctrl-C saves and exits 130: default on for one process on a terminal (same on all ranks).
        exit_on_interrupt=ns.exit_on_interrupt
        if getattr(ns, "exit_on_interrupt", None) is not None
        else interrupt_handling_default(os.environ, sys.stdin, sys.stdout),
    )
    probes = typing.get_type_hints(ProbeConfigs)
    log, rerun = derive_combinations(
        training,
        _pick(ns, LogConfig, {"progress_bar": "log_progress_bar"}),
        _pick(ns, RerunConfig),
    )
    return ShellConfig(
        train_iters=training.train_iters,
        save_dir=save,
        run_dir=ns.run_dir,
        seq_length=seq_length,
        log=log,
        **{name: _pick(ns, probes[name]) for name in PROBES},  # each from its flags
        rerun=rerun,
        ft=_ft_config(ns),
        exit=exit_config,
    )


def _ft_config(ns: argparse.Namespace) -> FaultToleranceConfig:
    ft_kwargs: dict[str, Any] = {
        "enable_ft": ns.enable_ft,
        "calc_ft_timeouts": ns.calc_ft_timeouts,
        "ft_num_warmup_iters": ns.ft_num_warmup_iters,
    }
    if ns.ft_timeouts:
        ft_kwargs["timeouts"] = parse_ft_timeouts(ns.ft_timeouts)
    return FaultToleranceConfig(**ft_kwargs)


def derive_combinations(
    training: TrainingConfig, log: LogConfig, rerun: RerunConfig
) -> tuple[LogConfig, RerunConfig]:
    """The values one component's flags set from another's, before `RunConfig` is built.

    Pure: returns new configs (``dataclasses.replace``), the arguments are left as they were.
    """
    if log.log_progress_bar is True:
        log = dataclasses.replace(log, log_progress_bar=None)  # default: only on a TTY
    if training.fp16 and rerun.check_for_nan_in_loss_and_grad:
        # Overflow NaN/Inf is expected with dynamic loss scaling (Megatron turns the check off too).
        rerun = dataclasses.replace(rerun, check_for_nan_in_loss_and_grad=False)
    return log, rerun


def check_combinations(config: RunConfig) -> None:
    """Cross-component rules (each component validated its own fields already): raises
    ``ValueError`` naming the flags, changes nothing."""
    config.shell.check(Names.CLI)  # the shell's own rules (its device rules: before start)
    _check_timeout_hierarchy(config)
    _check_restart_copies(config)
    if config.faults.inject_fault and not config.checkpoint.save:
        raise ValueError("--inject-fault needs --save (the fired-once marker lives there)")
    for flag, value in (
        (
            "--check-weight-hash-across-dp-replicas-interval",
            config.shell.rerun.check_weight_hash_across_dp_replicas_interval,
        ),
        (
            "--check-weight-hash-sample-fraction",
            config.shell.rerun.check_weight_hash_sample_fraction,
        ),
    ):
        if value and config.training.use_torch_fsdp2:
            raise ValueError(
                f"{flag} compares replicated weights; with --use-torch-fsdp2 every rank holds "
                "a different shard (use it with DDP)"
            )
    _check_rewind(config)
    if config.optim.clip_grad_in_optimizer and config.training.use_torch_fsdp2:
        raise ValueError(
            "--clip-grad-in-optimizer is not supported with --use-torch-fsdp2 (the fused step's "
            "grad_scale is a plain tensor; FSDP2's gradients are sharded DTensors)"
        )
    if config.training.bf16_compute_weights and config.training.use_torch_fsdp2:
        # Refused here for any world size (the builder refuses it again for FSDP2 across ranks):
        # a run that starts on one rank must not change meaning when it scales out.
        raise ValueError(
            "--bf16-compute-weights is not supported with --use-torch-fsdp2 (FSDP2 reduces the "
            "sharded fp32 gradients in its own hooks, which the bf16 copies bypass; use --bf16)"
        )
    if config.model.cross_entropy_loss_fusion and config.training.fp16:
        raise ValueError(
            "--cross-entropy-loss-fusion is not supported with --fp16 (the loss's gradient is "
            "written in the forward, before the loss scale, and would underflow in fp16; use "
            "--bf16)"
        )
    if config.model.bf16_residual_connection and not config.training.bf16:
        raise ValueError(
            "--bf16-residual-connection needs --bf16 (the norms read the bf16 stream under bf16 "
            "autocast)"
        )
    if config.training.rampup_batch_size and config.graphs.full_iteration:
        raise ValueError(
            "--rampup-batch-size with --cuda-graph-impl full_iteration is not supported: every "
            "batch-size step changes the micro-batch count and would re-capture the graph"
        )


def _check_restart_copies(config: RunConfig) -> None:
    """What a restart resumes from: a checkpoint directory, and non-persistent copies that exist."""
    if config.inprocess.inprocess_restart and not config.checkpoint.save:
        raise ValueError("--inprocess-restart needs --save (it resumes from the latest checkpoint)")
    if (
        config.checkpoint.non_persistent_ckpt_type is NonPersistentType.IN_MEMORY
        and not config.inprocess.inprocess_restart
    ):  # a relaunched process has no memory of the last one: only a restart in it can use them
        raise ValueError("--non-persistent-ckpt-type in_memory needs --inprocess-restart")
    if (
        config.checkpoint.non_persistent_ckpt_type is not NonPersistentType.GLOBAL
        and not config.shell.exit.non_persistent_save_interval
    ):  # the type says where the non-persistent saves go: without their interval there are none
        raise ValueError(
            f"--non-persistent-ckpt-type {config.checkpoint.non_persistent_ckpt_type.value} needs "
            "--non-persistent-save-interval (without it nothing is saved there)"
        )


def _check_rewind(config: RunConfig) -> None:
    """``--rewind-on-spike`` restores the newest checkpoint of the directory the run saves to,
    eagerly (a restored optimizer state is not what a captured graph holds)."""
    if not config.shell.rerun.rewind_on_spike:
        return
    if config.graphs.any:
        raise ValueError(
            "--rewind-on-spike is not supported with --cuda-graph-impl full_iteration or "
            "--optimizer-cuda-graph yet (a captured graph holds the optimizer state a rewind "
            "restores)"
        )
    save, load = config.checkpoint.save, config.checkpoint.load_dir
    if load is not None and save is not None and os.path.realpath(load) != os.path.realpath(save):
        raise ValueError(
            "--rewind-on-spike restores the newest checkpoint of --save; with --load elsewhere "
            "it would go back to --load's: resume with --load equal to --save"
        )


def _check_timeout_hierarchy(config: RunConfig) -> None:
    """Refuse hang-handling timeouts where a lower tier can never fire first (one line)."""
    ft, inprocess = config.shell.ft, config.inprocess
    check_timeout_hierarchy(
        step_s=ft.timeouts.step if ft.enable_ft else None,
        checkpointing_s=ft.timeouts.checkpointing if ft.enable_ft else None,
        escalation=ft.escalation,
        process_group_timeout_s=config.training.distributed_timeout_minutes * 60.0,
        inprocess_soft_timeout_s=(
            inprocess.inprocess_soft_timeout if inprocess.inprocess_restart else None
        ),
    )
