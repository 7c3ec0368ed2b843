"""The one per-iteration agreement across ranks: the rerun verdict flags and the exit inputs.

``IterationAgreement`` is given to the rerun state machine as its ``agreement`` (see
``stalwart.reliability.exit`` for the recipe, which decides on what is agreed here).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from stalwart.distributed import collectives

if TYPE_CHECKING:
    from stalwart.reliability.signals import DistributedSignalHandler


class ExitSource(Protocol):
    """What the probe asks of the exit configuration (an ``ExitConfig``: exit.py imports this
    module, so the type is named by what it provides)."""

    @property
    def needs_agreement(self) -> bool: ...


class ExitProbe:
    """This rank's exit inputs (the signal it received, minutes since ``started``), read locally.

    ``needs_agreement`` is False when no signal is handled and ``--exit-duration-in-mins`` is off:
    nothing needs agreeing then.
    """

    def __init__(
        self,
        config: ExitSource,
        signal_handler: DistributedSignalHandler | None = None,
        started: float | None = None,
    ) -> None:
        self.config = config
        self.signal_handler = signal_handler
        self.started = time.monotonic() if started is None else started

    @property
    def needs_agreement(self) -> bool:
        return self.config.needs_agreement

    def local(self) -> tuple[int, float]:
        """(signal number received, 0 for none; minutes elapsed)."""
        received = self.signal_handler.received_signal if self.signal_handler is not None else None
        return int(received or 0), (time.monotonic() - self.started) / 60.0


@dataclass(frozen=True)
class Agreed:
    """The exit inputs every rank agreed on in the iteration's collective (the highest signal
    number any rank received: a scheduler's SIGTERM wins over a Ctrl-C)."""

    signal_number: int = 0
    elapsed_minutes_max: float = 0.0

    @property
    def signal_received(self) -> bool:
        return self.signal_number != 0


class IterationAgreement:
    """The ONE per-iteration collective: the rerun machine's verdict flags and the exit inputs.

    Give it to the rerun machine as its ``agreement``: the machine's first agreement of an
    iteration (after the initial pass) MAX-reduces ``[flags..., signal, elapsed_minutes]`` in one
    all-reduce; later ones (reruns, rare) reduce only their flags. :meth:`finish` returns the
    agreed exit inputs, running the collective itself only when the machine did not (disabled
    mode) and something needs agreeing. Without a process group nothing is communicated.
    """

    def __init__(self, probe: ExitProbe | None = None, group: Any = None) -> None:
        self.probe = probe
        self.group = group
        self._agreed: Agreed | None = None

    def begin(self) -> None:
        """A new iteration: its first agreement carries the exit inputs."""
        self._agreed = None

    def _local(self) -> tuple[int, float]:
        return self.probe.local() if self.probe is not None else (0, 0.0)

    def __call__(self, flags: list[bool]) -> list[bool]:
        """Element-wise OR of ``flags`` across ranks (the machine's agreement)."""
        values = [1.0 if f else 0.0 for f in flags]
        carry = self._agreed is None
        if carry:
            number, elapsed = self._local()
            values += [float(number), elapsed]
        reduced = self._reduce(values)
        if carry:
            self._agreed = Agreed(int(reduced[-2]), reduced[-1])
            reduced = reduced[:-2]
        return [r > 0.5 for r in reduced]

    def finish(self) -> Agreed:
        """The iteration's agreed exit inputs (one collective here only if none ran yet)."""
        if self._agreed is None:
            number, elapsed = self._local()
            if self.probe is not None and self.probe.needs_agreement:
                # Deliberate sync: the exit agreement when the machine had nothing to agree on.
                high, elapsed = self._reduce([float(number), elapsed])
                number = int(high)
            self._agreed = Agreed(number, elapsed)
        return self._agreed

    def agree_again(self) -> Agreed:
        """Agree on the exit inputs once more in this iteration, after work outside the step
        (evaluation): a signal that arrived meanwhile ends the run at this iteration, as in
        Megatron, not one training iteration later. One collective, only when an exit input
        needs agreeing, and only on the iterations that call it (those that evaluated); what
        the step agreed is kept (the highest of both)."""
        before = self._agreed or Agreed()
        self._agreed = None
        now = self.finish()
        self._agreed = Agreed(
            max(before.signal_number, now.signal_number),
            max(before.elapsed_minutes_max, now.elapsed_minutes_max),
        )
        return self._agreed

    def _reduce(self, values: list[float]) -> list[float]:
        import torch.distributed as dist

        if not collectives.is_initialized() or dist.get_world_size(self.group) == 1:
            return values  # one process: nothing to agree on, no device round trip
        # Deliberate sync: the one per-iteration agreement (rerun verdict, signal, time budget).
        return collectives.all_reduce_floats(values, dist.ReduceOp.MAX, self.group)
