"""Typed configs owned by the trainer: optimizer, schedule, batch/precision, data and checkpoints.

Each dataclass validates itself in ``__post_init__`` and raises ``ValueError`` naming the offending
flag in Megatron spelling and the allowed values. Component-specific configs (model, rerun, fault
tolerance, logging, graphs) live next to their components and are aggregated by ``RunConfig``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from stalwart.checkpoint import CheckpointManager
from stalwart.data.blend import parse_data_blend


class LRDecayStyle(enum.StrEnum):
    """``--lr-decay-style`` values."""

    CONSTANT = "constant"
    LINEAR = "linear"
    COSINE = "cosine"


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass(kw_only=True)
class OptimizerConfig:
    """AdamW and learning-rate schedule (``--lr``, ``--min-lr``, ``--lr-warmup-iters``, ...)."""

    lr: float = 3e-4
    min_lr: float = 0.0
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    lr_warmup_iters: int = 0
    lr_decay_iters: int | None = None
    lr_warmup_samples: int = 0  # with --train-samples: the schedule counts samples
    lr_decay_samples: int | None = None
    lr_decay_style: LRDecayStyle = LRDecayStyle.COSINE

    def __post_init__(self) -> None:
        if isinstance(self.lr_decay_style, str):
            allowed = ", ".join(s.value for s in LRDecayStyle)
            try:
                self.lr_decay_style = LRDecayStyle(self.lr_decay_style)
            except ValueError:
                raise ValueError(
                    f"--lr-decay-style: got {self.lr_decay_style!r}, allowed: {allowed}"
                ) from None
        _require(self.lr > 0, f"--lr must be > 0 (got {self.lr})")
        _require(0 <= self.min_lr <= self.lr, f"--min-lr must be in [0, --lr] (got {self.min_lr})")
        _require(self.weight_decay >= 0, f"--weight-decay must be >= 0 (got {self.weight_decay})")
        _require(
            0 <= self.adam_beta1 < 1, f"--adam-beta1 must be in [0, 1) (got {self.adam_beta1})"
        )
        _require(
            0 <= self.adam_beta2 < 1, f"--adam-beta2 must be in [0, 1) (got {self.adam_beta2})"
        )
        _require(self.adam_eps > 0, f"--adam-eps must be > 0 (got {self.adam_eps})")
        _require(
            self.clip_grad >= 0, f"--clip-grad must be >= 0, 0 disables (got {self.clip_grad})"
        )
        _require(
            self.lr_warmup_iters >= 0,
            f"--lr-warmup-iters must be >= 0 (got {self.lr_warmup_iters})",
        )
        _require(
            self.lr_decay_iters is None or self.lr_decay_iters > 0,
            f"--lr-decay-iters must be > 0 (got {self.lr_decay_iters})",
        )
        _require(
            self.lr_warmup_samples >= 0,
            f"--lr-warmup-samples must be >= 0 (got {self.lr_warmup_samples})",
        )
        _require(
            self.lr_decay_samples is None or self.lr_decay_samples > 0,
            f"--lr-decay-samples must be > 0 (got {self.lr_decay_samples})",
        )


@dataclass(kw_only=True)
class TrainingConfig:
    """Batch sizes, iterations, precision, evaluation and devices."""

    micro_batch_size: int = 8
    global_batch_size: int | None = None
    rampup_batch_size: list[int] | None = None  # START INCREMENT RAMP_SAMPLES (Megatron)
    train_iters: int = 100
    train_samples: int | None = None  # --train-samples: train_iters is derived from it
    seed: int = 1234
    bf16: bool = False
    fp16: bool = False
    initial_loss_scale: float = 2.0**16
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    eval_interval: int = 0
    eval_iters: int = 10
    use_cpu: bool = False
    use_torch_fsdp2: bool = False
    compile: bool = False
    distributed_timeout_minutes: float = 10.0
    manual_gc: bool = False  # --manual-gc: Python's GC only at fixed iterations, on every rank
    manual_gc_interval: int = 0
    manual_gc_eval: bool = True

    def __post_init__(self) -> None:
        _require(
            self.micro_batch_size > 0,
            f"--micro-batch-size must be > 0 (got {self.micro_batch_size})",
        )
        _require(
            self.global_batch_size is None or self.global_batch_size > 0,
            f"--global-batch-size must be > 0 (got {self.global_batch_size})",
        )
        _require(self.train_iters > 0, f"--train-iters must be > 0 (got {self.train_iters})")
        _require(
            self.train_samples is None or self.train_samples > 0,
            f"--train-samples must be > 0 (got {self.train_samples})",
        )
        _require(
            not (self.bf16 and self.fp16), "--bf16 and --fp16 are mutually exclusive: pick one"
        )
        _require(self.initial_loss_scale > 0, "--initial-loss-scale must be > 0")
        _require(self.min_loss_scale > 0, "--min-loss-scale must be > 0")
        _require(self.loss_scale_window > 0, "--loss-scale-window must be > 0")
        _require(self.hysteresis > 0, "--hysteresis must be > 0")
        _require(
            self.eval_interval >= 0, f"--eval-interval must be >= 0 (got {self.eval_interval})"
        )
        _require(self.eval_iters >= 0, f"--eval-iters must be >= 0 (got {self.eval_iters})")
        _require(
            self.manual_gc_interval >= 0,
            f"--manual-gc-interval must be >= 0 (got {self.manual_gc_interval})",
        )


@dataclass(kw_only=True)
class DataConfig:
    """Where training tokens come from (``--data-path``; none = the embedded stdlib corpus)."""

    data_path: str | list[str] | None = None  # one path, paths, or weight-path pairs
    data_dtype: str = "uint16"
    valid_fraction: float = 0.02
    shuffle: bool = True
    num_workers: int = 0  # --num-workers: DataLoader processes reading ahead (0: in the loop)

    def __post_init__(self) -> None:
        _require(
            not isinstance(self.num_workers, bool)
            and isinstance(self.num_workers, int)
            and self.num_workers >= 0,
            f"--num-workers must be an integer >= 0 (got {self.num_workers!r})",
        )
        if isinstance(self.data_path, list | tuple):
            # One path stays a string (as before); a blend is checked for its syntax now.
            paths = [str(p) for p in self.data_path]
            self.data_path = paths[0] if len(paths) == 1 else paths
        parse_data_blend(self.data_path)
        _require(
            self.data_dtype in ("uint16", "uint32"),
            f"--data-dtype: got {self.data_dtype!r}, allowed: uint16, uint32",
        )
        _require(
            0.0 < self.valid_fraction < 0.5,
            f"--valid-fraction must be in (0, 0.5) (got {self.valid_fraction})",
        )


@dataclass(kw_only=True)
class CheckpointConfig:
    """Checkpoint saving and loading (``--save``, ``--load``, ``--save-interval``, ...)."""

    save: str | None = None
    load: str | None = None
    save_interval: int = 0
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False
    ckpt_keep_last: int | None = None
    ckpt_fallback: bool = False
    async_save: bool = False
    non_persistent_save_interval: int = 0
    non_persistent_ckpt_dir: str | None = None
    save_on_exit: bool = True
    extra: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _require(
            self.save_interval >= 0, f"--save-interval must be >= 0 (got {self.save_interval})"
        )
        _require(
            self.ckpt_keep_last is None or self.ckpt_keep_last > 0,
            f"--ckpt-keep-last must be > 0 (got {self.ckpt_keep_last})",
        )
        _require(
            self.non_persistent_save_interval >= 0,
            "--non-persistent-save-interval must be >= 0",
        )
        if self.non_persistent_save_interval and not self.save:
            # Saving and resuming are keyed on --save; the directory defaults to <save>/non_persistent.
            raise ValueError(
                "--non-persistent-save-interval needs --save "
                "(--non-persistent-ckpt-dir defaults to <save>/non_persistent)"
            )
        if self.save_interval and not self.save:
            raise ValueError("--save-interval needs --save (a checkpoint directory)")
        if self.async_save and not self.save:
            raise ValueError("--async-save needs --save (a checkpoint directory)")

    @property
    def load_dir(self) -> str | None:
        """``--load`` defaults to ``--save`` (auto-resume)."""
        return self.load if self.load is not None else self.save

    def build(self) -> CheckpointManager:
        """The checkpoint manager; ``--save`` is probed for writing first (before any work)."""
        manager = CheckpointManager(
            self.save,
            self.load_dir,
            keep_last=self.ckpt_keep_last,
            async_save=self.async_save,
            fallback=self.ckpt_fallback,
            non_persistent_dir=self.non_persistent_ckpt_dir,
        )
        if self.save:
            manager.check_writable()
        return manager
