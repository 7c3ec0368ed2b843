"""Typed configs owned by the trainer: optimizer, schedule, batch/precision, data and checkpoints.

Each dataclass validates itself in ``__post_init__`` and raises ``ValueError`` naming the offending
flag in Megatron spelling and the allowed values: every field's type, finiteness and declared range
(``metadata=bounds(...)``) by `stalwart.config.checks.check_fields`, then the rules that relate
several fields. Component-specific configs (model, rerun, fault
tolerance, logging, graphs) live next to their components and are aggregated by ``RunConfig``.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from stalwart.checkpoint import CheckpointManager
from stalwart.checkpoint.in_memory import InMemorySnapshots
from stalwart.checkpoint.non_persistent import LocalAlgo, NonPersistentType, build_copies
from stalwart.config.checks import SEED_MAX, bounds, check_fields
from stalwart.config.inductor import parse_inductor_options
from stalwart.data.blend import parse_data_blend

# Absurd values are refused up front: an lr of 1e3 or a timeout of a year is a typo, and it would
# otherwise surface much later as a NaN loss ("resume on other hardware") or a job that never ends.
LR_MAX = 10.0
DISTRIBUTED_TIMEOUT_MAX_MINUTES = 7 * 24 * 60.0


class LRDecayStyle(enum.StrEnum):
    """``--lr-decay-style`` values."""

    CONSTANT = "constant"
    LINEAR = "linear"
    COSINE = "cosine"


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass(kw_only=True, frozen=True)
class OptimizerConfig:
    """AdamW and learning-rate schedule (``--lr``, ``--min-lr``, ``--lr-warmup-iters``, ...)."""

    lr: float = field(default=3e-4, metadata=bounds(gt=0, le=LR_MAX))
    min_lr: float = field(default=0.0, metadata=bounds(ge=0, le=LR_MAX))
    weight_decay: float = field(default=0.1, metadata=bounds(ge=0))
    adam_beta1: float = field(default=0.9, metadata=bounds(ge=0, lt=1))
    adam_beta2: float = field(default=0.95, metadata=bounds(ge=0, lt=1))
    adam_eps: float = field(default=1e-8, metadata=bounds(gt=0, le=1))
    clip_grad: float = field(default=1.0, metadata=bounds(ge=0))  # 0 disables
    # --clip-grad-in-optimizer: the clip factor rides on the fused AdamW step's grad_scale
    # instead of a separate pass over the gradients (stalwart.graphs.clip_in_optimizer_step).
    clip_grad_in_optimizer: bool = False
    lr_warmup_iters: int = field(default=0, metadata=bounds(ge=0))
    lr_decay_iters: int | None = field(default=None, metadata=bounds(gt=0))
    # With --train-samples the schedule counts samples.
    lr_warmup_samples: int = field(default=0, metadata=bounds(ge=0))
    lr_decay_samples: int | None = field(default=None, metadata=bounds(gt=0))
    lr_decay_style: LRDecayStyle = LRDecayStyle.COSINE
    # Resuming with another LR schedule (Megatron's rule, stalwart.train.schedule_resume):
    # refused unless one of these says which schedule wins.
    override_opt_param_scheduler: bool = False
    use_checkpoint_opt_param_scheduler: bool = False

    def __post_init__(self) -> None:
        _to_enum(self, "lr_decay_style", LRDecayStyle, "--lr-decay-style")
        check_fields(self)
        _require(
            self.clip_grad > 0 or not self.clip_grad_in_optimizer,
            "--clip-grad-in-optimizer needs --clip-grad > 0 (with 0 there is no clipping to fuse)",
        )
        _require(self.min_lr <= self.lr, f"--min-lr must be in [0, --lr] (got {self.min_lr})")
        for unit, warmup, decay in (
            ("iters", self.lr_warmup_iters, self.lr_decay_iters),
            ("samples", self.lr_warmup_samples, self.lr_decay_samples),
        ):  # warm-up past the end of decay: the peak LR is never reached, then drops to --min-lr
            _require(
                decay is None or warmup <= decay,
                f"--lr-warmup-{unit} ({warmup}) must be <= --lr-decay-{unit} ({decay})",
            )
        _require(
            not (self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler),
            "--override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler are "
            "mutually exclusive: pick the schedule that wins on resume",
        )


@dataclass(kw_only=True, frozen=True)
class TrainingConfig:
    """Batch sizes, iterations, precision, evaluation and devices."""

    micro_batch_size: int = field(default=8, metadata=bounds(gt=0))
    global_batch_size: int | None = field(default=None, metadata=bounds(gt=0))
    # START INCREMENT RAMP_SAMPLES (Megatron); the ramp rules are checked by the batch schedule.
    rampup_batch_size: list[int] | None = field(default=None, metadata=bounds(ge=0))
    train_iters: int = field(default=100, metadata=bounds(gt=0))
    # --train-samples: train_iters is derived from it.
    train_samples: int | None = field(default=None, metadata=bounds(gt=0))
    seed: int = field(default=1234, metadata=bounds(ge=0, le=SEED_MAX))
    bf16: bool = False
    fp16: bool = False
    # --bf16-compute-weights: the Linear layers run on bf16 copies of the fp32 weights made once
    # per iteration; gradients accumulate into fp32 per micro-batch (stalwart.loop.ComputeWeights).
    bf16_compute_weights: bool = False
    # --gradient-accumulation-fusion: the compute copies' weight gradients go straight into the
    # fp32 grads (stalwart.models.fused_grad); needs bf16_compute_weights.
    gradient_accumulation_fusion: bool = False
    initial_loss_scale: float = field(default=2.0**16, metadata=bounds(gt=0))
    min_loss_scale: float = field(default=1.0, metadata=bounds(gt=0))
    loss_scale_window: int = field(default=1000, metadata=bounds(gt=0))
    hysteresis: int = field(default=2, metadata=bounds(gt=0))
    eval_interval: int = field(default=0, metadata=bounds(ge=0))
    eval_iters: int = field(default=10, metadata=bounds(ge=0))
    use_cpu: bool = False
    use_torch_fsdp2: bool = False
    compile: bool = False
    # --inductor-config KEY=VALUE (repeatable): options of the model's torch.compile.
    inductor_config: list[str] | None = None
    # --compile-cache-dir: torch's persistent compile caches (default: <run dir>/compile_cache).
    compile_cache_dir: str | None = None
    distributed_timeout_minutes: float = field(
        default=10.0, metadata=bounds(gt=0, le=DISTRIBUTED_TIMEOUT_MAX_MINUTES)
    )
    manual_gc: bool = False  # --manual-gc: Python's GC only at fixed iterations, on every rank
    manual_gc_interval: int = field(default=0, metadata=bounds(ge=0))
    manual_gc_eval: bool = field(default=True, metadata=bounds(flag="--no-manual-gc-eval"))

    def __post_init__(self) -> None:
        check_fields(self)
        _require(
            not (self.bf16 and self.fp16), "--bf16 and --fp16 are mutually exclusive: pick one"
        )
        _require(
            self.bf16 or not self.bf16_compute_weights,
            "--bf16-compute-weights needs --bf16 (the forward runs under bf16 autocast on the "
            "copies)",
        )
        _require(
            self.bf16_compute_weights or not self.gradient_accumulation_fusion,
            "--gradient-accumulation-fusion needs --bf16-compute-weights (it fuses the copies' "
            "gradient accumulation into the fp32 grads)",
        )
        _require(
            self.compile or not self.inductor_config,
            "--inductor-config needs --compile (they are options of the model's torch.compile)",
        )
        parse_inductor_options(self.inductor_config)  # ValueError naming the flag
        _require(
            self.compile or self.compile_cache_dir is None,
            "--compile-cache-dir needs --compile (it holds what torch.compile compiled)",
        )
        _require(
            not self.eval_interval or self.eval_iters > 0,
            f"--eval-interval {self.eval_interval} needs --eval-iters >= 1 (with 0 every "
            "evaluation is empty)",
        )
        _require(
            self.manual_gc or (not self.manual_gc_interval and self.manual_gc_eval),
            "--manual-gc-interval and --no-manual-gc-eval need --manual-gc (without it Python's "
            "automatic collector runs and they would do nothing)",
        )
        _require(
            self.min_loss_scale <= self.initial_loss_scale,
            "--min-loss-scale must be <= --initial-loss-scale",
        )


@dataclass(kw_only=True, frozen=True)
class DataConfig:
    """Where training tokens come from (``--data-path``; none = the embedded stdlib corpus)."""

    data_path: str | list[str] | None = None  # one path, paths, or weight-path pairs
    data_dtype: str = "uint16"
    valid_fraction: float = field(default=0.02, metadata=bounds(gt=0, lt=0.5))
    shuffle: bool = field(default=True, metadata=bounds(flag="--no-shuffle"))
    # --num-workers: DataLoader processes reading ahead (0: in the loop).
    num_workers: int = field(default=0, metadata=bounds(ge=0, le=1024))

    def __post_init__(self) -> None:
        check_fields(self)
        if isinstance(self.data_path, list | tuple):
            # One path stays a string (as before); a blend is checked for its syntax now.
            paths = [str(p) for p in self.data_path]
            object.__setattr__(self, "data_path", paths[0] if len(paths) == 1 else paths)
        parse_data_blend(self.data_path)
        _require(
            self.data_dtype in ("uint16", "uint32"),
            f"--data-dtype: got {self.data_dtype!r}, allowed: uint16, uint32",
        )
        blend = parse_data_blend(self.data_path) or []
        _require(  # else accepted and ignored: text files and the corpus are read as bytes
            self.data_dtype == "uint16" or any(p.endswith(".bin") for _, p in blend),
            f"--data-dtype {self.data_dtype} applies to .bin files only, and --data-path names "
            "none (other files and the embedded corpus are read as bytes)",
        )


@dataclass(kw_only=True, frozen=True)
class CheckpointConfig:
    """Checkpoint saving and loading (``--save``, ``--load``, ``--async-save``, ...). When to
    save (``--save-interval``, ``--non-persistent-save-interval``) is the shell's
    ``ExitConfig``: one decision over every save and exit."""

    save: str | None = None
    load: str | None = None
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False
    ckpt_keep_last: int | None = field(default=None, metadata=bounds(gt=0))
    ckpt_fallback: bool = False
    verify_checkpoint_on_load: bool = False
    async_save: bool = False
    non_persistent_ckpt_dir: str | None = None  # = --non-persistent-global-ckpt-dir
    # Megatron's non-persistent checkpoint types (stalwart.checkpoint.non_persistent): where
    # the --non-persistent-save-interval saves go, and the local type's directory and replicas.
    non_persistent_ckpt_type: NonPersistentType = NonPersistentType.GLOBAL
    non_persistent_local_ckpt_dir: str | None = None
    non_persistent_local_ckpt_algo: LocalAlgo | None = None  # unset: fully_parallel
    replication: bool = False
    replication_jump: int | None = field(default=None, metadata=bounds(gt=0))
    replication_factor: int | None = field(default=None, metadata=bounds(ge=2))

    def __post_init__(self) -> None:
        for name, kind, flag in (
            ("non_persistent_ckpt_type", NonPersistentType, "--non-persistent-ckpt-type"),
            ("non_persistent_local_ckpt_algo", LocalAlgo, "--non-persistent-local-ckpt-algo"),
        ):
            _to_enum(self, name, kind, flag)
        check_fields(self)
        if self.async_save and not self.save:
            raise ValueError("--async-save needs --save (a checkpoint directory)")
        self._check_non_persistent_type()

    def _check_non_persistent_type(self) -> None:
        """Every flag of a type applies to it: each other combination is one refusal."""
        kind = self.non_persistent_ckpt_type
        flag = f"--non-persistent-ckpt-type {kind.value}"
        _require(
            kind is NonPersistentType.GLOBAL or self.non_persistent_ckpt_dir is None,
            f"--non-persistent-ckpt-dir (--non-persistent-global-ckpt-dir) is the global "
            f"type's directory; {flag} does not use it",
        )
        local = kind is NonPersistentType.LOCAL
        for given, name in (
            (self.non_persistent_local_ckpt_dir is not None, "--non-persistent-local-ckpt-dir"),
            (self.non_persistent_local_ckpt_algo is not None, "--non-persistent-local-ckpt-algo"),
            (self.replication, "--replication"),
        ):
            _require(local or not given, f"{name} applies to --non-persistent-ckpt-type local")
        _require(
            not local or bool(self.non_persistent_local_ckpt_dir),
            f"{flag} needs --non-persistent-local-ckpt-dir (a directory on each node: local "
            "NVMe or /dev/shm)",
        )
        for value, name in (
            (self.replication_jump, "--replication-jump"),
            (self.replication_factor, "--replication-factor"),
        ):
            _require(value is None or self.replication, f"{name} applies with --replication")
        if local:
            _check_local_dir(
                self.non_persistent_local_ckpt_dir or "", self.save, self.non_persistent_ckpt_dir
            )

    @property
    def load_dir(self) -> str | None:
        """``--load`` defaults to ``--save`` (auto-resume)."""
        return self.load if self.load is not None else self.save

    def build(
        self,
        before_commit: Callable[[int], None] | None = None,
        snapshots: InMemorySnapshots | None = None,
    ) -> CheckpointManager:
        """The checkpoint manager; ``--save`` is probed for writing and locked first (before any
        work; if building fails, atexit releases the lock). ``before_commit``: see the manager.
        ``snapshots``: an in-process restart's in-memory snapshots (``in_memory``), which outlive
        this manager. Collective with ``local`` (the copies' own group)."""
        copies = build_copies(
            self.non_persistent_ckpt_type,
            local_dir=self.non_persistent_local_ckpt_dir,
            algo=self.non_persistent_local_ckpt_algo or LocalAlgo.FULLY_PARALLEL,
            replication=self.replication,
            jump=self.replication_jump,
            factor=self.replication_factor,
            job=os.path.realpath(self.save) if self.save else None,
            snapshots=snapshots,
        )
        manager = CheckpointManager(
            self.save,
            self.load_dir,
            keep_last=self.ckpt_keep_last,
            async_save=self.async_save,
            fallback=self.ckpt_fallback,
            verify_on_load=self.verify_checkpoint_on_load,
            non_persistent_dir=self.non_persistent_ckpt_dir,
            before_commit=before_commit,
            copies=copies,
        )
        if self.save:
            manager.check_writable()
        return manager


def _to_enum(config: object, name: str, kind: type[enum.Enum], flag: str) -> None:
    """A flag's string value as its enum (``ValueError`` naming ``flag`` and the values)."""
    value = getattr(config, name)
    if isinstance(value, str) and not isinstance(value, kind):
        allowed = ", ".join(str(m.value) for m in kind)
        try:  # the one conversion (frozen: through object.__setattr__)
            object.__setattr__(config, name, kind(value))
        except ValueError:
            raise ValueError(f"{flag}: got {value!r}, allowed: {allowed}") from None


def _check_local_dir(local: str, save: str | None, global_dir: str | None) -> None:
    """The local copies' directory is one of its own: the same directory as --save or the
    global type's would put two locks of one job on it."""
    here = os.path.realpath(local)
    for other, name in ((save, "--save"), (global_dir, "--non-persistent-ckpt-dir")):
        if other is not None and os.path.realpath(other) == here:
            raise ValueError(
                f"--non-persistent-local-ckpt-dir {local} is the same directory as {name}; "
                "give the local copies a directory of their own (on each node's local disk)"
            )
