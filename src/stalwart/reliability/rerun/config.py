"""``RerunConfig``: the rerun-related training flags (Megatron spelling) and their validation."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from stalwart.reliability.rerun.attribution.replicas import ReplicaCheck, ReplicaSchedule
from stalwart.reliability.rerun.injector import RerunErrorInjector
from stalwart.reliability.rerun.machine import Agreement, RerunStateMachine
from stalwart.reliability.rerun.remedies import (
    DEFAULT_TRANSIENT_BUDGET,
    RemedyConfig,
    TransientPolicy,
)
from stalwart.reliability.rerun.tracker import read_iterations_to_skip
from stalwart.reliability.rerun.types import CheckConfig, RerunDiagnostic, RerunMode

DEFAULT_MAX_REWINDS = 3
"""Spike rewinds a run may do (``--max-rewinds``); later spikes train on, as without rewinds."""


@dataclass(kw_only=True)
class RerunConfig:
    """Result validation and rerun flags.

    Attributes:
        rerun_mode: ``--rerun-mode``: disabled | validate_results | report_determinism_stats
            (alias report_stats). Normalised to :class:`RerunMode`.
        check_for_nan_in_loss_and_grad: off with ``--no-check-for-nan-in-loss-and-grad``. Turn it
            off yourself with fp16 dynamic loss scaling (overflow NaNs are expected there).
        check_for_spiky_loss: ``--check-for-spiky-loss`` (non-fatal, factor ``spiky_loss_factor``).
        check_for_large_grads: ``--check-for-large-grads`` (non-fatal, factor
            ``large_grads_factor``).
        error_injection_rate: ``--error-injection-rate``; 0 = off, else 1/rate per validation call.
        error_injection_type: ``--error-injection-type``: transient_error | persistent_error |
            correct_result.
        error_injection_seed: seed of the injector's private RNG.
        error_injection_iterations: ``--error-injection-iterations``: only these iterations may
            be injected (None: any), numbered from 1 as in the training log. With rate 1 this
            targets an iteration exactly.
        error_injection_ranks: ``--error-injection-ranks``: only these ranks inject (None: any).
        error_injection_devices: ``--error-injection-devices``: only processes on these device
            ids inject (None: any): a faulty device, which a relaunch without it does not meet.
        error_injection_once: ``--error-injection-once``: each injection fires once per job
            (a marker in the directory ``build`` is given, the trainer's ``--save``).
        result_rejected_tracker_filename: ``--result-rejected-tracker-filename``.
        iterations_to_skip: ``--iterations-to-skip``: iterations the loop skips, numbered from 1
            like the training log, the tracker file and Megatron's flag.
        spiky_loss_factor / large_grads_factor: threshold factors over the sampled max (10).
        check_weight_hash_across_dp_replicas_interval: every N iterations (0: never) compare
            fingerprints across data-parallel replicas: inside the step, of the all-reduced
            gradients and the weights before the optimizer step (gated: a mismatch is rerun
            and attributed, ``stalwart.reliability.rerun.attribution.replicas``), and of the
            weights after it (also before every save; a mismatch exits 17 without saving).
        check_weight_hash_sample_fraction: ``--check-weight-hash-sample-fraction``: every
            iteration, fingerprint this fraction of the parameters (weights and gradients, a
            seeded random partition: every parameter every ceil(1/fraction) iterations) inside
            the step, as above; 0: off.
        rerun_peer_replay: ``--rerun-peer-replay`` / ``--no-rerun-peer-replay``: attribute a
            rejection that reproduces in place by replaying it on a peer replica within the
            launch (``stalwart.reliability.rerun.attribution.peer``); used when the group has
            more than one rank, else (and when off) Megatron's exit 16 and relaunch.
        rerun_transient_policy: ``--rerun-transient-policy``: what a transient verdict does:
            ``exit`` (Megatron's, the default: a fatal check exits 17 without saving) or
            ``continue`` (the rerun's clean result is applied and training goes on;
            ``stalwart.reliability.rerun.remedies``).
        rerun_transient_budget: ``--rerun-transient-budget``: under ``continue``, a device with
            more transients than this in the run is a suspect: exit 17 naming it (None: 2).
        rewind_on_spike: ``--rewind-on-spike``: a spiky loss the rerun reproduces (on a peer
            replica, or in place with none: the data, not the hardware) restores the newest
            snapshot and skips a window of iterations from the spike on
            (``stalwart.reliability.rewind``; the shell does it). Needs
            ``check_for_spiky_loss`` and the tracker file (the skipped iterations are recorded
            there: a relaunch skips them too).
        rewind_skip_window: ``--rewind-skip-window``: iterations skipped per rewind, the
            spiking one and those after it.
        rewind_lr_scale: ``--rewind-lr-scale``: the learning rate is multiplied by this after
            each rewind, from the restored iteration on (1: unchanged).
        max_rewinds: ``--max-rewinds``: rewinds per run (the tracker file's count across
            relaunches); later spikes train on.
    """

    rerun_mode: RerunMode | str = RerunMode.VALIDATE_RESULTS
    check_for_nan_in_loss_and_grad: bool = True
    check_for_spiky_loss: bool = False
    check_for_large_grads: bool = False
    error_injection_rate: int = 0
    error_injection_type: RerunDiagnostic | str = RerunDiagnostic.TRANSIENT_ERROR
    error_injection_seed: int = 0
    error_injection_iterations: list[int] | None = None
    error_injection_ranks: list[int] | None = None
    error_injection_devices: list[str] | None = None
    error_injection_once: bool = False
    result_rejected_tracker_filename: str | None = None
    iterations_to_skip: list[int] = field(default_factory=list)
    spiky_loss_factor: float = 10.0
    large_grads_factor: float = 10.0
    check_weight_hash_across_dp_replicas_interval: int = 0
    check_weight_hash_sample_fraction: float = 0.0
    rerun_peer_replay: bool = True
    rerun_transient_policy: TransientPolicy | str = TransientPolicy.EXIT
    rerun_transient_budget: int | None = None
    rewind_on_spike: bool = False
    rewind_skip_window: int = 1
    rewind_lr_scale: float = 1.0
    max_rewinds: int = DEFAULT_MAX_REWINDS

    def __post_init__(self) -> None:
        self.rerun_mode = RerunMode.parse(self.rerun_mode)
        self.error_injection_type = RerunDiagnostic.parse(self.error_injection_type)
        rate = self.error_injection_rate
        if isinstance(rate, bool) or not isinstance(rate, int) or rate < 0:
            raise ValueError(f"--error-injection-rate must be an integer >= 0; got {rate!r}")
        bad = [
            i
            for i in self.iterations_to_skip
            if isinstance(i, bool) or not isinstance(i, int) or i < 1
        ]
        if bad:
            raise ValueError(
                f"--iterations-to-skip must be iteration numbers >= 1 (as logged); got {bad}"
            )
        for flag, values, low in (
            ("--error-injection-iterations", self.error_injection_iterations, 1),
            ("--error-injection-ranks", self.error_injection_ranks, 0),
        ):
            if values is not None and not _all_ints_at_least(values, low):
                raise ValueError(f"{flag} must be integers >= {low}; got {list(values)}")
        self.replica_schedule  # noqa: B018 (the schedule refuses a bad interval or fraction)
        for name, value in (  # not flags: fields a hand-written loop sets
            ("RerunConfig.spiky_loss_factor", self.spiky_loss_factor),
            ("RerunConfig.large_grads_factor", self.large_grads_factor),
        ):
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number > 0; got {value!r}")
        targeted = (
            self.error_injection_iterations,
            self.error_injection_ranks,
            self.error_injection_devices,
            self.error_injection_once or None,
        )
        if self.error_injection_rate == 0 and any(v is not None for v in targeted):
            raise ValueError(
                "--error-injection-iterations/--error-injection-ranks/--error-injection-devices/"
                "--error-injection-once need "
                "--error-injection-rate > 0 (1 injects at the first eligible validation call)"
            )
        if self.error_injection_rate > 0 and self.mode is not RerunMode.VALIDATE_RESULTS:
            raise ValueError(
                "--error-injection-rate > 0 needs --rerun-mode validate_results "
                f"(got {self.mode.value})"
            )
        self.rerun_transient_policy = TransientPolicy.parse(self.rerun_transient_policy)
        _check_transients(self)
        _check_rewinds(self)

    @property
    def mode(self) -> RerunMode:
        return RerunMode.parse(self.rerun_mode)

    @property
    def transient_policy(self) -> TransientPolicy:
        return TransientPolicy.parse(self.rerun_transient_policy)

    @property
    def transient_budget(self) -> int:
        """The budget in force (the default when none was given)."""
        budget = self.rerun_transient_budget
        return DEFAULT_TRANSIENT_BUDGET if budget is None else budget

    def remedies(self, rewind: Callable[[], bool] | None = None) -> RemedyConfig:
        """What the machine does instead of exiting (``rewind``: whether the loop may rewind
        now; used with ``rewind_on_spike``)."""
        return RemedyConfig(
            self.transient_policy, self.transient_budget, rewind if self.rewind_on_spike else None
        )

    @property
    def injection_type(self) -> RerunDiagnostic:
        return RerunDiagnostic.parse(self.error_injection_type)

    @property
    def replica_schedule(self) -> ReplicaSchedule:
        """Which parameters the step fingerprints at which iteration."""
        return ReplicaSchedule(
            self.check_weight_hash_across_dp_replicas_interval,
            self.check_weight_hash_sample_fraction,
        )

    @property
    def checks(self) -> CheckConfig:
        """The loss and gradient checks these flags turn on."""
        return CheckConfig(
            nan_and_inf=self.check_for_nan_in_loss_and_grad,
            spiky_loss=self.check_for_spiky_loss,
            large_grads=self.check_for_large_grads,
            spiky_loss_factor=self.spiky_loss_factor,
            large_grads_factor=self.large_grads_factor,
        )

    def build(
        self,
        device: torch.device | str | None = None,
        *,
        state_save_func: Callable[[], Any] | None = None,
        state_restore_func: Callable[[Any], None] | None = None,
        process_group: dist.ProcessGroup | None = None,
        agreement: Agreement | None = None,
        marker_dir: str | None = None,
        rewind: Callable[[], bool] | None = None,
    ) -> RerunStateMachine:
        """The machine (and its injector) these flags describe, its device buffer on ``device``
        (``marker_dir``: where ``error_injection_once`` keeps its markers; ``rewind``: whether a
        spike may rewind now, asked by the machine: the loop that acts on the rewind gives it,
        ``stalwart.loop.Shell`` does).

        Raises:
            ValueError: ``error_injection_once`` without ``marker_dir``; ``rewind_on_spike``
                without ``rewind`` (nothing would restore the snapshot).
        """
        if self.error_injection_once and not marker_dir:
            raise ValueError(
                "--error-injection-once needs --save (the fired-once markers live there)"
            )
        if self.rewind_on_spike and rewind is None:
            raise ValueError(
                "RerunConfig.rewind_on_spike needs the loop that restores the snapshot: build "
                "the machine with stalwart.loop.Shell (ShellConfig(rerun=...).build())"
            )
        injector = RerunErrorInjector(
            self.error_injection_rate,
            self.injection_type,
            seed=self.error_injection_seed,
            ranks=self.error_injection_ranks,
            # The flag counts from 1 like the log; the injector sees the loop's 0-based index.
            at_iterations=(
                None
                if self.error_injection_iterations is None
                else [i - 1 for i in self.error_injection_iterations]
            ),
            devices=self.error_injection_devices,
            marker_dir=marker_dir if self.error_injection_once else None,
        )
        schedule = self.replica_schedule
        return RerunStateMachine(
            mode=self.mode,
            error_injector=injector,
            result_rejected_tracker_filename=self.result_rejected_tracker_filename,
            state_save_func=state_save_func,
            state_restore_func=state_restore_func,
            process_group=process_group,
            checks=self.checks,
            agreement=agreement,
            device=device,
            peer_replay=self.rerun_peer_replay,
            replicas=ReplicaCheck(schedule, process_group) if schedule.enabled else None,
            remedies=self.remedies(rewind),
        )


def _is_int(value: object, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _check_transients(config: RerunConfig) -> None:
    """``--rerun-transient-policy`` / ``--rerun-transient-budget`` (``ValueError``, one line)."""
    budget = config.rerun_transient_budget
    if budget is not None and not _is_int(budget, 0):
        raise ValueError(f"--rerun-transient-budget must be an integer >= 0; got {budget!r}")
    if config.transient_policy is not TransientPolicy.CONTINUE:
        if budget is not None:
            raise ValueError(
                "--rerun-transient-budget needs --rerun-transient-policy continue (with exit, "
                "every fatal transient ends the job)"
            )
        return
    if config.mode is not RerunMode.VALIDATE_RESULTS:
        raise ValueError(
            "--rerun-transient-policy continue needs --rerun-mode validate_results "
            f"(got {config.mode.value})"
        )


def _check_rewinds(config: RerunConfig) -> None:
    """The spike rewind's fields (``ValueError``, one line naming the flag)."""
    window, scale, most = config.rewind_skip_window, config.rewind_lr_scale, config.max_rewinds
    if not _is_int(window, 1):
        raise ValueError(f"--rewind-skip-window must be an integer >= 1; got {window!r}")
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not 0.0 < scale <= 1.0:
        raise ValueError(f"--rewind-lr-scale must be in (0, 1] (1: unchanged); got {scale!r}")
    if not _is_int(most, 1):
        raise ValueError(f"--max-rewinds must be an integer >= 1; got {most!r}")
    if not config.rewind_on_spike:
        for flag, value, default in (
            ("--rewind-skip-window", window, 1),
            ("--rewind-lr-scale", scale, 1.0),
            ("--max-rewinds", most, DEFAULT_MAX_REWINDS),
        ):
            if value != default:
                raise ValueError(f"{flag} needs --rewind-on-spike")
        return
    for missing, needs in (
        (not config.check_for_spiky_loss, "--check-for-spiky-loss (the spike it rewinds)"),
        (config.mode is not RerunMode.VALIDATE_RESULTS, "--rerun-mode validate_results"),
        (
            not config.result_rejected_tracker_filename,
            "--result-rejected-tracker-filename (the skipped iterations are recorded there, "
            "so that a relaunch skips them too)",
        ),
    ):
        if missing:
            raise ValueError(f"--rewind-on-spike needs {needs}")


def _all_ints_at_least(values: list[int], low: int) -> bool:
    return all(not isinstance(v, bool) and isinstance(v, int) and v >= low for v in values)


def resolve_iterations_to_skip(config: RerunConfig) -> list[int]:
    """``--iterations-to-skip`` merged with what the tracker file says (sorted, numbered from 1
    as logged: iteration N is the one whose 0-based loop index is N - 1)."""
    skip = set(config.iterations_to_skip)
    if config.result_rejected_tracker_filename:
        skip.update(read_iterations_to_skip(config.result_rejected_tracker_filename))
    return sorted(skip)
