"""Peer replay: attribute a reproducible rejection in the same launch, on a peer replica.

Megatron tells a faulty GPU from an application error by saving, exiting 16 and rerunning the
iteration after the scheduler relaunched the job elsewhere. With data parallelism the other GPU
is already in the job, holding bitwise the same weights (the rejected iteration's optimizer step
was skipped on every rank). So, when the in-place rerun reproduced a rejection on rank r:

1. One collective (``all_gather_object`` over the machine's group): every rank sends its
   identity (node, device); each rank that reproduced a rejection also sends a
   :class:`PeerRequest`: the failed call, its initial value, its recorded micro-batches (CPU
   copies: token ids, not activations), its RNG state at the iteration's start and its pending
   error injection. :func:`plan_peer_replay` (pure, the same on every rank) gives each suspect
   a distinct peer that reproduced nothing, preferring another node.
2. One pass on every rank (a DDP backward and a captured graph hold collectives, so all ranks
   run it together): a peer replays its suspect's micro-batches with the suspect's RNG, every
   other rank reruns its own iteration (its values are not used). The checks record *local*
   values: each micro-batch's loss, and per-bucket gradient norms in DDP's comm hook before the
   all-reduce, so the peer computes exactly what rank r computed. The replay runs under
   :class:`ReplayDeterminism` (restored after).
3. One more collective: each peer reports its value of the suspect's failed call, compared with
   the suspect's initial value under the call's own tolerance (loss exact, gradients 0.1%).
   :func:`decide_peer_outcome` (pure): reproducible on the peer -> a correct result (an
   application error: exit 17 for a fatal check, a non-fatal one continues after one clean pass);
   not reproducible -> a persistent fault of rank r's device: the pre-iteration state is saved,
   the suspect is recorded in ``rerun_verdict.json`` and the job exits 17.

No peer (one rank), more suspects than replicas that reproduced nothing, or a check that is not
local (FSDP2 gradient shards are reduce-scattered before they are checked): today's exit-16 flow.
A hand-written Megatron-style loop gets the replay too: the pass reads the same
``RerunDataIterator``, which serves the suspect's micro-batches on the peer.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from stalwart.reliability.rerun.types import CallKey, Identity

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplayDeterminism:
    """What the peer replay sets for its pass only (every setting restored after).

    A replay is compared with a pass that ran under the training settings, so a setting may
    only narrow choices that were non-deterministic anyway; it must not swap a deterministic
    kernel for another one (the loss is compared exactly):

    * ``deterministic_algorithms``: ``torch.use_deterministic_algorithms(True, warn_only=True)``
      (uninitialised-memory filling off): ops with a non-deterministic implementation (atomics
      in scatter/index_add backward, memory-efficient attention backward) take their
      deterministic one, so the replayed gradients vary less than the rerun's.
    * ``cudnn_deterministic``: ``torch.backends.cudnn.deterministic`` (``benchmark`` is left as
      it is: changing it would re-select convolution algorithms).
    * ``sdpa_backends``: names of ``torch.nn.attention.SDPBackend`` to pin (empty: torch's own
      choice, which is what the training pass used on the same hardware; pin only what the
      training run pins too).

    Under a captured full-iteration graph none of these matter: the replay is the same graph.
    """

    deterministic_algorithms: bool = True
    cudnn_deterministic: bool = True
    sdpa_backends: tuple[str, ...] = ()

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """The settings for the duration of the ``with`` block."""
        saved_algorithms = torch.are_deterministic_algorithms_enabled()
        saved_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
        saved_cudnn = torch.backends.cudnn.deterministic
        fill = getattr(torch.utils, "deterministic", None)
        saved_fill = getattr(fill, "fill_uninitialized_memory", None)
        try:
            with contextlib.ExitStack() as stack:
                if self.deterministic_algorithms:
                    torch.use_deterministic_algorithms(True, warn_only=True)
                    if saved_fill is not None:
                        fill.fill_uninitialized_memory = False  # type: ignore[union-attr]
                    stack.enter_context(warnings.catch_warnings())
                    warnings.filterwarnings("ignore", message=".*determinis.*")
                if self.cudnn_deterministic:
                    torch.backends.cudnn.deterministic = True
                if self.sdpa_backends:
                    stack.enter_context(_sdpa_kernel(self.sdpa_backends))
                yield
        finally:
            torch.use_deterministic_algorithms(saved_algorithms, warn_only=saved_warn_only)
            torch.backends.cudnn.deterministic = saved_cudnn
            if saved_fill is not None:
                fill.fill_uninitialized_memory = saved_fill  # type: ignore[union-attr]


def _sdpa_kernel(names: tuple[str, ...]) -> contextlib.AbstractContextManager[Any]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # SDPBackend is a pybind11 enum: members by attribute (not subscriptable, not iterable).
    members = {k.lower(): v for k, v in vars(SDPBackend).items() if isinstance(v, SDPBackend)}
    members.pop("error", None)
    unknown = [name for name in names if name.lower() not in members]
    if unknown:
        allowed = ", ".join(sorted(members))
        raise ValueError(f"ReplayDeterminism.sdpa_backends: {unknown} (allowed: {allowed})")
    return sdpa_kernel([members[name.lower()] for name in names])


@dataclass(frozen=True)
class PeerRequest:
    """What a rank whose rejection reproduced in place ships to its peer (one gather).

    ``rank`` is its rank in the machine's group; ``batches`` one list of micro-batches per data
    iterator (tensors on the CPU); ``rng`` its :func:`portable_rng_state` at the iteration's
    start; ``injection`` its pending error injection of ``key`` (type, identity), if any;
    ``replayable`` False when the check is not local (a gradient check of FSDP2 shards).
    """

    rank: int
    identity: Identity
    key: CallKey
    message: str
    fatal: bool
    tolerance: float
    initial: float
    batches: list[list[Any]]
    rng: dict[str, Any]
    injection: tuple[str, Identity] | None = None
    replayable: bool = True


@dataclass(frozen=True)
class PeerPlan:
    """Which rank replays whose iteration (group ranks); the same on every rank."""

    requests: dict[int, PeerRequest]
    peers: dict[int, int]  # suspect -> its peer
    identities: list[Identity]

    def replaying_for(self, rank: int) -> PeerRequest | None:
        """The request ``rank`` replays as a peer (None: it reruns its own iteration)."""
        for suspect, peer in self.peers.items():
            if peer == rank:
                return self.requests[suspect]
        return None


def plan_peer_replay(
    identities: list[Identity], requests: list[PeerRequest | None]
) -> tuple[PeerPlan | None, str]:
    """Assign each suspect (a rank with a request) a distinct peer that has none (pure).

    A peer on another node is preferred (a node-level fault, e.g. power or cooling, could
    reproduce on its neighbour), then the nearest rank. Returns ``(None, why)`` when there are
    no suspects, a check is not local, or there are more suspects than possible peers.
    """
    suspects = {r.rank: r for r in requests if r is not None}
    if not suspects:
        return None, "no rank reproduced its rejection"
    local = [r for r in suspects.values() if not r.replayable]
    if local:
        return None, f"'{local[0].message}' is not a local value (FSDP2 gradient shards)"
    free = [rank for rank in range(len(identities)) if rank not in suspects]
    peers: dict[int, int] = {}
    for suspect in sorted(suspects):
        if not free:
            return None, f"{len(suspects)} ranks reproduced a rejection: no replica is left"
        node = identities[suspect][0]
        best = min(free, key=lambda p: (identities[p][0] == node, abs(p - suspect), p))
        peers[suspect] = best
        free.remove(best)
    return PeerPlan(suspects, peers, list(identities)), ""


@dataclass(frozen=True)
class PeerReport:
    """A peer's replay of a suspect's failed call (one gather after the pass)."""

    suspect: int
    peer: int
    peer_identity: Identity
    value: float
    comparison: float
    reproducible: bool


@dataclass(frozen=True)
class PeerOutcome:
    """The agreed result of a peer replay: per suspect, whether its peer reproduced it."""

    plan: PeerPlan
    reports: dict[int, PeerReport] = field(default_factory=dict)

    @property
    def persistent(self) -> list[int]:
        """Suspects whose result the peer did not reproduce (their device is at fault)."""
        return [s for s in self.plan.requests if not self._reproduced(s)]

    def _reproduced(self, suspect: int) -> bool:
        report = self.reports.get(suspect)
        return report is not None and report.reproducible

    @property
    def fatal(self) -> bool:
        """Whether any suspect's failed check was fatal (a correct result then still exits)."""
        return any(r.fatal for r in self.plan.requests.values())


def decide_peer_outcome(plan: PeerPlan, reports: list[PeerReport | None]) -> PeerOutcome:
    """The outcome from every rank's report (pure). A suspect without a report counts as not
    reproduced: its peer did not make the call (a replay must make the same calls)."""
    return PeerOutcome(plan, {r.suspect: r for r in reports if r is not None})


def to_cpu(obj: Any) -> Any:
    """``obj`` with every tensor copied to the CPU, in dicts, lists and tuples (shipping a
    recorded micro-batch; a peer moves it to its own device as the pass always does)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_cpu(v) for v in obj]
    if isinstance(obj, tuple):
        items = [to_cpu(v) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj
