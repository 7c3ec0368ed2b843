"""Where this rank stands in the rerun machine's group, and how the machine reports: Megatron's
log lines and the result-rejected tracker file.

One :class:`Reporter` is built by the machine and handed to the parts that report (the peer
replay, the replica gate); it holds no state that changes.
"""

from __future__ import annotations

import logging
import re

import torch.distributed as dist

from stalwart.distributed import collectives
from stalwart.distributed.launch_env import env_int
from stalwart.reliability.rerun.tracker import TrackerFile
from stalwart.reliability.rerun.types import Identity, RerunValidationStatus, device_identity

# The verdict lines keep the logger they always had (log filters select them by name).
logger = logging.getLogger("stalwart.reliability.rerun.verdicts")
# "3" (a CUDA index) or "cpu:1" -> the index Megatron's failure line shows.
_DEVICE_INDEX = re.compile(r"(?:[a-z]+:)?(\d+)")


class Reporter:
    """This rank's place in ``process_group`` and the machine's log and tracker lines.

    Args:
        process_group: the group whose ranks agree (None: the world).
        tracker: the result-rejected tracker file (None: no file).
    """

    def __init__(self, process_group: dist.ProcessGroup | None, tracker: TrackerFile | None):
        self.process_group = process_group
        self.tracker = tracker

    # ------------------------------------------------------------------ place in the group
    @property
    def rank(self) -> int:
        return dist.get_rank() if collectives.is_initialized() else 0

    @property
    def group_rank(self) -> int:
        return dist.get_rank(self.process_group) if collectives.is_initialized() else 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.process_group) if collectives.is_initialized() else 1

    def global_rank(self, group_rank: int) -> int:
        """The global rank of ``group_rank`` in the machine's group."""
        if self.process_group is None or not collectives.is_initialized():
            return group_rank
        return dist.get_global_rank(self.process_group, group_rank)

    # --------------------------------------------------------------------------- log lines
    def _where(self) -> tuple[str, str, str]:
        """(node, device index, the device id in parentheses when it is not the index):
        Megatron's lines name a CUDA device index; a simulated or CPU device id follows."""
        node, device = device_identity()
        digits = _DEVICE_INDEX.fullmatch(device)
        index = digits.group(1) if digits else str(env_int("LOCAL_RANK", 0))
        return node, index, f" (device {device})" if device != index else ""

    def describe(self, iteration: int, message: str) -> str:
        """Megatron's form of the other messages (disabled mode's ``Unexpected result``):
        ``Rank R, node N, device D, iteration I: {message}`` (``iteration`` 0-based)."""
        node, index, where = self._where()
        return (
            f"Rank {self.rank}, node {node}, device {index}, "
            f"iteration {iteration + 1}: {message}{where}"
        )

    def log_failure(self, iteration: int, message: str, fatal: bool, detail: str = "") -> None:
        """Megatron's failure line, ``Rank R, node N, device D, iteration #I: {message}!``
        (ERROR when fatal, else WARNING; a message ending in "!" gives Megatron's "!!", e.g.
        ``Possible transient error!!``). D is the device index (a simulated or CPU device
        id follows in parentheses); ``detail`` (what was seen) follows after a space."""
        node, index, where = self._where()
        line = (
            f"Rank {self.rank}, node {node}, device {index}, iteration #{iteration + 1}: "
            f"{message}!{where}"
        )
        (logger.error if fatal else logger.warning)(f"{line} {detail}" if detail else line)

    def log_repeat_verdict(
        self,
        log: logging.Logger,
        iteration: int,
        who: str,
        where: str,
        *,
        reproducible: bool,
        values: tuple[object, object],
        message: str,
        fatal: bool,
    ) -> None:
        """The lines of a rejected result repeated on another device (``who``: "Second rerun" on
        ``where`` "a different GPU", or "Peer replay" on a peer): the warning on ``log`` (the
        caller's), then Megatron's failure line. Reproducible there, the result was likely
        correct (failure line fatal as ``fatal``); otherwise a possible persistent error."""
        initial, value = values
        if reproducible:
            log.warning(
                "%s: unexpected result is reproducible on %s, therefore it was likely correct "
                "(%s = %s)",
                who,
                where,
                initial,
                value,
            )
            line = f"Correct result (but possible Application error) ({message})"
            self.log_failure(iteration, line, fatal)
            return
        log.warning(
            "%s: unexpected result is not reproducible on %s, therefore was likely incorrect "
            "(%s != %s)",
            who,
            where,
            initial,
            value,
        )
        self.log_failure(iteration, "Possible persistent error!", True, f"(message='{message}')")

    def log0(self, message: str) -> None:
        """A warning on rank 0 only (the lines every rank would print alike)."""
        if self.rank == 0:
            logger.warning(message)

    def track(
        self,
        iteration: int,
        status: RerunValidationStatus,
        result: float,
        message: str,
        *,
        identity: Identity | None = None,
        rank: int | None = None,
    ) -> None:
        """One tracker line (nothing without a tracker file): this rank's, where it computes
        unless ``identity`` / ``rank`` say otherwise."""
        if self.tracker is not None:
            self.tracker.write(
                identity=device_identity() if identity is None else identity,
                rank=self.rank if rank is None else rank,
                iteration=iteration,
                status=status,
                result=result,
                message=message,
            )
