"""The spike rewind, done by the shell (``--rewind-on-spike``; the policy and its record are
``stalwart.reliability.rewind``): restore the newest snapshot, skip the window from the
spike, record it in the tracker file, scale the learning rate from the restored iteration on.

The rerun machine decides (a spiky loss reproduced: the data's); every rank gets the same
:class:`~stalwart.reliability.rerun.types.SpikeRewind` verdict and :meth:`Rewinder.rewind` runs
on every rank (the load is collective). The step was not applied: the machine restored the
iteration's start and put its micro-batches back, so with no snapshot yet the rewind skips the
spiking iteration in place.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from stalwart.checkpoint import CheckpointError
from stalwart.loop.naming import Names
from stalwart.loop.plans import GraphPlan
from stalwart.observability.goodput import Bucket
from stalwart.observability.run_dir import EventKind
from stalwart.reliability.hang.sections import Section
from stalwart.reliability.rerun import RerunDataIterator
from stalwart.reliability.rerun.types import RerunValidationStatus, SpikeRewind
from stalwart.reliability.rewind import RewindPolicy, RewindRecord

if TYPE_CHECKING:
    from stalwart.loop.checkpointing import Checkpointer
    from stalwart.loop.shell_settings import ShellSettings
    from stalwart.loop.shell_view import ShellView


class Rewinder:
    """The shell's side of the spike rewinds: the learning-rate factor around each iteration and
    the rewind itself.

    Args:
        policy: the settings and the rewinds so far (:class:`RewindPolicy`).
    """

    def __init__(self, policy: RewindPolicy) -> None:
        self.policy = policy

    @contextlib.contextmanager
    def scaled_lr(self, optimizer: torch.optim.Optimizer | None, number: int) -> Iterator[None]:
        """Iteration ``number`` with every group's learning rate times the rewinds' factor (none
        at 1.0), then each put back exactly as the loop's schedule had set it (a scheduler that
        multiplies the current rate must not compound the factor)."""
        factor = self.policy.scale_at(number)
        if optimizer is None or factor == 1.0:
            yield
            return
        saved = [group["lr"] for group in optimizer.param_groups]
        kept = [lr.clone() if isinstance(lr, torch.Tensor) else lr for lr in saved]
        for group, lr in zip(optimizer.param_groups, saved, strict=True):
            if isinstance(lr, torch.Tensor):
                lr.mul_(factor)  # a graph-captured optimizer reads its device LR in place
            else:
                group["lr"] = lr * factor
        try:
            yield
        finally:
            for group, lr, old in zip(optimizer.param_groups, saved, kept, strict=True):
                if isinstance(lr, torch.Tensor):
                    lr.copy_(old)  # after the step on the stream: run() joined it
                else:
                    group["lr"] = old

    def rewind(
        self, shell: ShellView, request: SpikeRewind, checkpointer: Checkpointer | None
    ) -> RewindRecord:
        """Restore ``checkpointer``'s newest snapshot (collective; None or no snapshot yet: the
        iteration's start, already restored), skip the window, record it (see the module
        docstring). Returns the rewind's record."""
        spike = request.iteration + 1
        if shell.guarded is not None:
            shell.guarded.settle()
        loaded = None
        if checkpointer is not None:
            _finalize(shell, checkpointer)  # a pending async save may be the newest snapshot
            with shell.sections.section(Section.CHECKPOINTING), shell.ledger.span(Bucket.RESTART):
                loaded = checkpointer.load()
        restored = shell.completed if loaded is None else loaded.iteration
        if restored >= spike:
            raise CheckpointError(
                f"spike rewind: the newest checkpoint ({loaded.path if loaded else '?'}, "
                f"iteration {restored}) is not before the spike at iteration {spike}"
            )
        record = self.policy.plan(spike, restored)
        self.policy.add(record)
        shell.iterations.add_skips(record.skipped)
        shell.ledger.rewound(spike - 1)
        self._report(shell, request, record, loaded)
        return record

    def _report(
        self, shell: ShellView, request: SpikeRewind, record: RewindRecord, loaded: Any
    ) -> None:
        """The tracker lines (rank 0: one per skipped iteration), the run's event, one line."""
        policy, reporter = self.policy, shell.machine.reporter
        if shell.rank == 0:
            for number in record.skipped:
                status = RerunValidationStatus.REWIND_SKIPPED
                reporter.track(number - 1, status, request.value, record.message(request.message))
        where = f"{loaded.path} ({record.restored} iterations)" if loaded else "no snapshot yet"
        scale = policy.scale_at(record.restored + 1)
        lr = (
            f"; learning rate x {scale:g} from iteration {record.restored + 1}"
            if scale != 1
            else ""
        )
        line = (
            f"spike rewind {len(policy.records)} of {policy.max_rewinds}: {request.message} "
            f"{request.value:.6g} at iteration {record.spike} reproduced "
            f"({request.attribution.replace('_', ' ')}); restored {where}; skipping "
            f"{record.describe()}{lr}"
        )
        shell.print(line)
        shell.event(EventKind.RERUN, line, iteration=record.restored)


def _finalize(shell: ShellView, checkpointer: Checkpointer) -> None:
    """Complete a pending async save, timed as an exit completes it."""
    if not checkpointer.async_save:
        return
    with (
        shell.sections.section(Section.CHECKPOINTING, is_async_finalization=True),
        shell.saves.finalizing(),
    ):
        checkpointer.finalize()
    shell.saves.finalized_all()


def check_rewindable(
    config: ShellSettings, names: Names, data: Any, plan: Any, *, registered: bool = True
) -> None:
    """``rerun.rewind_on_spike`` needs a data iterator that can go back to a snapshot's
    position (and is registered with the checkpointer: ``registered``), and no captured graph
    (a restored optimizer state is not what a graph captured): ``ValueError`` naming the
    setting as ``names`` spells it."""
    if not config.rerun.rewind_on_spike:
        return
    what = names.spell("rerun.rewind_on_spike")
    if isinstance(data, RerunDataIterator) and not data.rewindable:
        raise ValueError(
            f"{what}: the data iterator cannot go back to a snapshot's position; give "
            "RerunDataIterator a sequence or a resumable source (state_dict/load_state_dict)"
        )
    if not registered:
        raise ValueError(
            f"{what}: a rewind restores the data position with the snapshot; register the "
            "data iterator: shell.checkpointer(..., data=...)"
        )
    if isinstance(plan, GraphPlan):
        raise ValueError(f"{what} is not supported under CUDA graphs (GraphPlan) yet")


__all__ = ["Rewinder", "check_rewindable"]
