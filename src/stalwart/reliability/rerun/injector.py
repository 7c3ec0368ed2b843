"""Error injection to rehearse every diagnosis path of the rerun state machine.

The injector corrupts the *observed* value of one validation call (it becomes NaN and the call is
reported as rejected), so the reruns perform real comparisons:

* ``transient_error``: only the initial run is corrupted, the in-place rerun is clean;
* ``persistent_error``: every run on the same (node, device) is corrupted; after a restart on a
  different device (``$STALWART_DEVICE_ID`` changed) the value is clean;
* ``correct_result``: every run is corrupted, wherever it runs.

A peer replay (``stalwart.reliability.rerun.attribution.peer``) of an injected call follows the
same rules on the peer's device: the injecting rank ships its pending injection with the replay's
inputs.

``devices`` ties the injection to devices rather than ranks (``--error-injection-devices``: a
faulty device, which a relaunch without it no longer meets); ``marker_dir``
(``--error-injection-once``) makes each (iteration, rank) injection fire once per job: a relaunch
that trains the iteration again finds the marker
``<marker_dir>/.stalwart_rerun_injected_<it>_<rank>`` (created with O_CREAT|O_EXCL before the
injection) and stays clean, as a real transient fault would.

Decisions are made on the host with the injector's own seeded ``random.Random``; the global
Python RNG is never touched, so enabling injection does not change training randomness.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Collection
from typing import Any

from stalwart.reliability.rerun.types import CallKey, Identity, RerunDiagnostic, RerunState

logger = logging.getLogger(__name__)

_LABELS = {
    RerunDiagnostic.CORRECT_RESULT: "Expected result",
    RerunDiagnostic.TRANSIENT_ERROR: "Transient error",
    RerunDiagnostic.PERSISTENT_ERROR: "Persistent error",
}


class RerunErrorInjector:
    """Decides which validation call to corrupt.

    Args:
        error_injection_rate: 0 disables injection; otherwise each eligible validation call of an
            initial run is corrupted with probability ``1 / rate`` (at most one pending injection).
        error_injection_type: a :class:`RerunDiagnostic` or its string value.
        seed: seed of the private RNG (same on every rank; the rank offsets the draw).
        ranks: if given, only these ranks inject.
        at_iterations: if given, only these 0-based iterations are eligible (rehearsals, tests).
        devices: if given, only processes on these device ids (the device part of
            ``device_identity()``) inject.
        marker_dir: if given, each (iteration, rank) injection fires once per job (see module
            docstring).
    """

    def __init__(
        self,
        error_injection_rate: int = 0,
        error_injection_type: RerunDiagnostic | str = RerunDiagnostic.TRANSIENT_ERROR,
        *,
        seed: int = 0,
        ranks: Collection[int] | None = None,
        at_iterations: Collection[int] | None = None,
        devices: Collection[str] | None = None,
        marker_dir: str | None = None,
    ) -> None:
        if error_injection_rate < 0:
            raise ValueError(f"--error-injection-rate must be >= 0; got {error_injection_rate}")
        self.error_injection_rate = int(error_injection_rate)
        self.error_injection_type = RerunDiagnostic.parse(error_injection_type)
        self.ranks = frozenset(ranks) if ranks is not None else None
        self.at_iterations = frozenset(at_iterations) if at_iterations is not None else None
        self.devices = frozenset(devices) if devices is not None else None
        self.marker_dir = marker_dir
        self._rng = random.Random(seed)
        # The pending injection: which call, which type, and where it was injected.
        self.pending: tuple[CallKey, RerunDiagnostic, Identity] | None = None

    @property
    def enabled(self) -> bool:
        return self.error_injection_rate > 0

    def maybe_inject(self, key: CallKey, iteration: int, rank: int, identity: Identity) -> bool:
        """Called for each validation call of an initial run; True means corrupt this call."""
        if not self.enabled or self.pending is not None:
            return False
        if self.ranks is not None and rank not in self.ranks:
            return False
        if self.at_iterations is not None and iteration not in self.at_iterations:
            return False
        if self.devices is not None and identity[1] not in self.devices:
            return False
        rate = self.error_injection_rate
        if (self._rng.randrange(rate) + rank) % rate != 0:
            return False
        if self.marker_dir is not None and not self._first_time(iteration, rank):
            return False
        self.pending = (key, self.error_injection_type, identity)
        logger.warning("Injecting error type %s", _LABELS[self.error_injection_type])
        return True

    def _first_time(self, iteration: int, rank: int) -> bool:
        """Create this injection's marker; False when an earlier launch of the job created it."""
        assert self.marker_dir is not None
        path = os.path.join(self.marker_dir, f".stalwart_rerun_injected_{iteration + 1}_{rank}")
        try:
            os.makedirs(self.marker_dir, exist_ok=True)
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
        except FileExistsError:
            logger.warning(
                "not injecting at iteration %d: %s exists (fired once)", iteration + 1, path
            )
            return False
        return True

    def should_corrupt(self, key: CallKey, state: RerunState, identity: Identity) -> bool:
        """Whether the rerun of an injected call must observe the corruption again."""
        if self.pending is None or self.pending[0] != key:
            return False
        _, kind, injected_on = self.pending
        if state not in (RerunState.RERUNNING_IN_PLACE, RerunState.RERUNNING_FROM_CHECKPOINT):
            return False
        if kind is RerunDiagnostic.TRANSIENT_ERROR:
            return False
        if kind is RerunDiagnostic.PERSISTENT_ERROR:
            return identity == injected_on
        return True

    def injection_for(self, key: CallKey) -> tuple[RerunDiagnostic, Identity] | None:
        """The pending injection of ``key`` (its type and where it was injected), if any: what
        a peer needs to replay the injected call faithfully."""
        if self.pending is None or self.pending[0] != key:
            return None
        return self.pending[1], self.pending[2]

    @staticmethod
    def corrupts_replay(kind: RerunDiagnostic, injected_on: Identity, here: Identity) -> bool:
        """Whether a peer's replay (on ``here``) of a call injected on ``injected_on`` observes
        the corruption: a correct result everywhere, a persistent error only on the device it
        was injected on, a transient error never (the in-place rerun was already clean)."""
        if kind is RerunDiagnostic.CORRECT_RESULT:
            return True
        return kind is RerunDiagnostic.PERSISTENT_ERROR and tuple(here) == tuple(injected_on)

    def is_pending_for(self, key: CallKey | None) -> bool:
        return self.pending is not None and self.pending[0] == key

    def clear(self) -> None:
        """Forget the pending injection (its event is resolved, or another call failed first)."""
        self.pending = None

    def state_dict(self) -> dict[str, Any]:
        """JSON-friendly: lists, strings and numbers."""
        pending = None
        if self.pending is not None:
            key, kind, ident = self.pending
            pending = [list(key), kind.value, list(ident)]
        version, internal, gauss = self._rng.getstate()
        return {
            "error_injection_rate": self.error_injection_rate,
            "error_injection_type": self.error_injection_type.value,
            "pending": pending,
            "rng": [version, list(internal), gauss],
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore the pending injection and RNG stream; rate and type stay as configured now."""
        pending = sd.get("pending")
        if pending is not None:
            key, kind, ident = pending
            restored = (tuple(key), RerunDiagnostic(kind), tuple(ident))
            self.pending = restored  # type: ignore[assignment]
        else:
            self.pending = None
        if sd.get("rng") is not None:
            version, internal, gauss = sd["rng"]
            self._rng.setstate((version, tuple(internal), gauss))
