"""Silent-data-corruption check between data-parallel replicas (Megatron's
``--check-weight-hash-across-dp-replicas-interval``).

Data-parallel replicas hold bit-identical weights after every optimizer step; a rank whose weights
drift (a flipped bit in HBM, a faulty SM, a broken all-reduce) trains a silently different model.
Every ``interval`` iterations each rank fingerprints its parameters on the device, the ranks
exchange the fingerprint vectors in one collective, and a pure decision names the ranks that
disagree with the majority and the parameters that differ.

Scope: only meaningful for *replicated* parameters (DDP). FSDP-sharded parameters (``DTensor``,
``--use-torch-fsdp2``) hold different shards on each rank and are not replicas, so
:func:`parameter_fingerprints` refuses them with a ``ValueError``.

Fingerprint: each parameter's bytes are reinterpreted as unsigned integers (16-bit words for
fp16/bf16, 32-bit words for fp32, two 32-bit words per element for fp64); word ``i`` is multiplied
by the odd weight ``2 i + 1`` and the products are summed in int64, wrapping modulo ``2**64``
(two's complement). Addition modulo ``2**64`` is associative, so the value is independent of
reduction order, chunking, device and process. A flipped bit changes one product by
``±2**k (2 i + 1)`` (``k < 32``): non-zero and smaller than ``2**63`` in magnitude, so never a
multiple of ``2**64``; any single bit flip changes the fingerprint, and so does any pair of
single-bit flips in different words (``2**k (2 i + 1) = 2**m (2 j + 1)`` forces ``i = j``) and any
swap of two different words. These guarantees hold for parameters of up to ``2**30`` words; only
integer multiplies, adds and one sum per chunk run on the device (no 64-bit division, which GPUs
emulate slowly).

The one replica check that runs these (in the step, and on the weights before every save) is
:class:`stalwart.reliability.rerun.attribution.replicas.ReplicaCheck`; in a hand-written DDP
loop (collective: every rank calls it at the same iterations)::

    result = check_replica_consistency(model)  # the module DDP wraps
    if not result.consistent:
        log.error(result.describe())
        raise SystemExit(17)  # do not save diverged weights; resume from the last save
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from stalwart.distributed.collectives import all_gather_objects
from stalwart.reliability.rerun.types import Diagnosis, DiagnosisSource, Suspect, device_identity

CHECK_INTERVAL_FLAG: Final = "--check-weight-hash-across-dp-replicas-interval"
FSDP2_FLAG: Final = "--use-torch-fsdp2"

# 4M words per chunk: a handful of int64 temporaries of 32 MiB each, whatever the parameter size.
DEFAULT_CHUNK_WORDS: Final = 1 << 22
# Upper bound of chunk_words (memory only: sums wrap modulo 2**64 whatever the chunk).
_MAX_CHUNK_WORDS: Final = 1 << 31
_DESCRIBE_MAX_PARAMETERS: Final = 5

# dtype -> (integer view of the same bytes, mask that makes the word unsigned). Read-only proxy:
# the module holds no mutable state.
_WORD_VIEWS: Final[Mapping[torch.dtype, tuple[torch.dtype, int]]] = MappingProxyType(
    {
        torch.float32: (torch.int32, 0xFFFF_FFFF),
        torch.float64: (torch.int32, 0xFFFF_FFFF),  # two 32-bit words per element
        torch.bfloat16: (torch.int16, 0xFFFF),
        torch.float16: (torch.int16, 0xFFFF),
    }
)


def _is_dtensor(tensor: torch.Tensor) -> bool:
    """True for FSDP2/TP ``DTensor`` parameters; the import is guarded for minimal torch builds."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed tensor support: nothing can be one
        return False
    return isinstance(tensor, DTensor)


def _validated_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Return ``named_parameters()`` after host-only checks (no device work, no sync).

    Raises:
        ValueError: a parameter is a DTensor (sharded, not a replica) or parameters span devices.
        TypeError: a parameter's dtype is not fp32, fp64, bf16 or fp16.
    """
    named = list(module.named_parameters())
    devices = {p.device for _, p in named}
    if len(devices) > 1:
        raise ValueError(
            f"replica check needs all parameters on one device, found {sorted(map(str, devices))}"
        )
    for name, p in named:
        if _is_dtensor(p):
            raise ValueError(
                f"parameter {name!r} is a DTensor: FSDP-sharded parameters ({FSDP2_FLAG}) are not "
                f"replicas, so {CHECK_INTERVAL_FLAG} only applies to DDP-replicated parameters"
            )
        if p.dtype not in _WORD_VIEWS:
            allowed = ", ".join(str(d) for d in _WORD_VIEWS)
            raise TypeError(
                f"cannot fingerprint parameter {name!r} of dtype {p.dtype}; supported: {allowed}"
            )
    return named


def _fingerprint_one(param: torch.Tensor, chunk_words: int) -> torch.Tensor:
    """Fingerprint one parameter as a 0-d int64 tensor on its device (no host sync)."""
    int_dtype, mask = _WORD_VIEWS[param.dtype]
    # contiguous() gives the canonical element order, so layout differences cannot hide changes.
    words = param.detach().contiguous().view(-1).view(int_dtype)
    total: torch.Tensor | None = None  # no zeros-then-add for a one-chunk tensor: fewer kernels
    for start in range(0, words.numel(), chunk_words):
        chunk = words[start : start + chunk_words].to(torch.int64).bitwise_and_(mask)
        end = start + chunk.numel()
        # Odd, distinct weights 2i+1: no change of a word can vanish modulo 2**64.
        weight = torch.arange(2 * start + 1, 2 * end + 1, 2, dtype=torch.int64, device=words.device)
        part = chunk.mul_(weight).sum()  # int64 wraps modulo 2**64: order-independent
        total = part if total is None else total.add_(part)
    if total is None:  # an empty tensor
        return torch.zeros((), dtype=torch.int64, device=words.device)
    return total


def tensor_fingerprints(
    tensors: Sequence[torch.Tensor], *, chunk_words: int = DEFAULT_CHUNK_WORDS
) -> torch.Tensor:
    """One fingerprint per tensor (the same function as :func:`parameter_fingerprints`), as a
    1-D int64 tensor on the first tensor's device, without a host sync (gradients, optimizer
    state). Raises ``TypeError`` for a dtype other than fp32, fp64, bf16 or fp16."""
    if not tensors:
        return torch.zeros(0, dtype=torch.int64)
    for t in tensors:
        if t.dtype not in _WORD_VIEWS:
            allowed = ", ".join(str(d) for d in _WORD_VIEWS)
            raise TypeError(f"cannot fingerprint a tensor of dtype {t.dtype}; supported: {allowed}")
    device = tensors[0].device
    return torch.stack([_fingerprint_one(t, chunk_words).to(device) for t in tensors])


def parameter_fingerprints(
    module: nn.Module, *, chunk_words: int = DEFAULT_CHUNK_WORDS
) -> torch.Tensor:
    """Fingerprint every parameter of ``module`` on its device, without a host sync.

    Returns a 1-D int64 tensor with one entry per parameter, in ``module.named_parameters()``
    order, on the parameters' device (CPU for a module without parameters); entries are int64
    sums wrapped modulo ``2**64``. The values are a pure function of the parameters' bytes and
    positions: identical on every process and device, independent of ``chunk_words``. Any single bit
    flip in a parameter changes that parameter's entry and no other.

    ``chunk_words`` bounds the temporary memory (a few int64 buffers of that many words).

    Raises:
        ValueError: a parameter is a DTensor (``--use-torch-fsdp2``), parameters span devices,
            or ``chunk_words`` is outside ``[1, 2**31]``.
        TypeError: a parameter's dtype is not fp32, fp64, bf16 or fp16.
    """
    if not 1 <= chunk_words <= _MAX_CHUNK_WORDS:
        raise ValueError(f"chunk_words must be in [1, {_MAX_CHUNK_WORDS}], got {chunk_words}")
    named = _validated_parameters(module)
    if not named:
        return torch.zeros(0, dtype=torch.int64)
    return torch.stack([_fingerprint_one(p, chunk_words) for _, p in named])


@dataclass(frozen=True)
class ReplicaCheckResult:
    """Outcome of one replica comparison; identical on every rank of the group.

    ``mismatched_ranks`` are the ranks whose fingerprint vector differs from the reference (the
    majority; on a tie, the group holding the lowest rank). ``mismatched_parameters`` names every
    parameter whose fingerprint is not the same on all ranks, in ``named_parameters()`` order.
    """

    consistent: bool
    mismatched_ranks: list[int]
    mismatched_parameters: list[str]
    # The ranks holding the reference vector, and whether they outnumber every other group (with
    # two replicas, or a tie, nothing tells which side is right).
    reference_ranks: list[int] = dataclasses.field(default_factory=list)
    has_majority: bool = True
    # (node, device) of each mismatched rank, gathered after a mismatch (empty otherwise).
    identities: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    subject: str = "weights"  # what was compared ("weights and gradients" inside the step)

    def diagnosis(self, iteration: int) -> Diagnosis | None:
        """The ``rerun_verdict.json`` record when a strict majority names the disagreeing
        ranks (``replica_corruption``; a relaunch from the last checkpoint refuses their
        devices), else None (two replicas, or a tie: nothing tells which one is right)."""
        if self.consistent or not self.has_majority or not self.identities:
            return None
        suspects = tuple(
            Suspect(rank, node, device)
            for rank, (node, device) in zip(self.mismatched_ranks, self.identities, strict=True)
        )
        return Diagnosis(
            iteration,
            "replica_corruption",
            suspects,
            self.describe(),
            DiagnosisSource.REPLICA_CHECK,
        )

    def describe(self) -> str:
        """One-line summary naming the disagreeing ranks and up to five parameters."""
        if self.consistent:
            return "replica weights consistent across data-parallel ranks"
        shown = self.mismatched_parameters[:_DESCRIBE_MAX_PARAMETERS]
        hidden = len(self.mismatched_parameters) - len(shown)
        params = ", ".join(shown) + (f", +{hidden} more" if hidden else "")
        if self.has_majority:
            who = f"ranks {self.mismatched_ranks} disagree with the majority"
        else:
            who = (
                f"no majority tells which replica is right: ranks {self.reference_ranks} vs "
                f"ranks {self.mismatched_ranks}"
            )
        return (
            f"replica {self.subject} differ: {who}; "
            f"{len(self.mismatched_parameters)} parameter(s) differ: {params}"
        )


def decide_replica_consistency(
    fingerprints_by_rank: list[list[int]], names: list[str]
) -> ReplicaCheckResult:
    """Compare per-rank fingerprint vectors (pure; no torch, no communication).

    ``fingerprints_by_rank[r][i]`` is rank ``r``'s fingerprint of parameter ``names[i]``; ranks
    in the result are indices into ``fingerprints_by_rank``. The reference is the most common
    vector; on a tie, the one held by the lowest rank among the tied groups.

    Raises:
        ValueError: no ranks given, or a rank's vector length differs from ``len(names)``.
    """
    if not fingerprints_by_rank:
        raise ValueError("decide_replica_consistency needs at least one rank's fingerprints")
    for rank, row in enumerate(fingerprints_by_rank):
        if len(row) != len(names):
            raise ValueError(
                f"rank {rank} sent {len(row)} fingerprints for {len(names)} parameters; "
                "every replica must hold the same parameters"
            )
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank, row in enumerate(fingerprints_by_rank):
        groups.setdefault(tuple(row), []).append(rank)
    # Ranks are appended in increasing order, so members[0] is each group's lowest rank.
    reference = max(groups.values(), key=lambda members: (len(members), -members[0]))
    mismatched_ranks = [r for r in range(len(fingerprints_by_rank)) if r not in reference]
    mismatched_parameters = [
        name
        for i, name in enumerate(names)
        if any(row[i] != fingerprints_by_rank[0][i] for row in fingerprints_by_rank)
    ]
    runner_up = max((len(m) for m in groups.values() if m is not reference), default=0)
    return ReplicaCheckResult(
        consistent=len(groups) == 1,
        mismatched_ranks=mismatched_ranks,
        mismatched_parameters=mismatched_parameters,
        reference_ranks=list(reference),
        has_majority=len(reference) > runner_up,
    )


def gather_fingerprints(local: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Every rank's fingerprint vector, ``[world, k]`` (one all-gather, device work; the buffer
    lives where the backend wants it: CUDA for NCCL, the CPU for gloo and the rest)."""
    world = dist.get_world_size(group) if collectives_initialized() else 1
    if world == 1:
        return local.unsqueeze(0)
    if dist.get_backend(group) == "nccl":
        cuda = torch.device("cuda", torch.cuda.current_device())
        comm = local if local.device.type == "cuda" else local.to(cuda)
    else:
        comm = local.to("cpu")
    parts = [torch.empty_like(comm) for _ in range(world)]
    # List form rather than all_gather_into_tensor: it is supported by gloo as well as NCCL.
    dist.all_gather(parts, comm, group=group)
    return torch.stack(parts)


def check_replica_consistency(
    module: nn.Module, process_group: ProcessGroup | None = None
) -> ReplicaCheckResult:
    """Compare ``module``'s parameters across the ranks of ``process_group`` (default: world).

    Collective: call on every rank of the group with the same module structure. Costs the
    fingerprint kernels, one all-gather of one int64 per parameter and one deliberate host read;
    every rank returns the same result. Ranks in the result are global ranks. Without an
    initialised process group, or with a group of one rank, returns a consistent result without
    communicating (after the same host-only parameter validation).

    Raises:
        ValueError / TypeError: as :func:`parameter_fingerprints`, on every rank alike.
    """
    named = _validated_parameters(module)
    if not (dist.is_available() and dist.is_initialized()):
        return ReplicaCheckResult(True, [], [])
    world = dist.get_world_size(process_group)
    if world == 1 or not named:
        return ReplicaCheckResult(True, [], [])
    gathered = gather_fingerprints(parameter_fingerprints(module), process_group)
    # Deliberate sync: the decision needs the gathered fingerprints on the host, once per check.
    rows = gathered.tolist()
    result = decide_replica_consistency(rows, [name for name, _ in named])
    if not result.consistent:  # the same on every rank: all of them gather (rare path)
        everyone = cast(
            "list[tuple[str, str]]", all_gather_objects(device_identity(), process_group)
        )
        identities = [(str(everyone[r][0]), str(everyone[r][1])) for r in result.mismatched_ranks]
        result = dataclasses.replace(result, identities=identities)
    if process_group is None:
        return result
    # Report global ranks: a group-local index does not identify the faulty node.
    return dataclasses.replace(
        result,
        mismatched_ranks=[dist.get_global_rank(process_group, r) for r in result.mismatched_ranks],
        reference_ranks=[dist.get_global_rank(process_group, r) for r in result.reference_ranks],
    )


def replicas_agree(
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    process_group: ProcessGroup | None = None,
) -> bool:
    """Whether every rank of the group holds bitwise the same parameters and optimizer state
    (floating-point tensors of ``optimizer.state``), e.g. before saving from any replica.

    Collective (one all-gather of one int64 per tensor, one deliberate read); True without a
    group. Raises ``ValueError`` for DTensor (sharded) parameters, as the replica check does.
    """
    named = _validated_parameters(module)
    if not collectives_initialized() or dist.get_world_size(process_group) == 1:
        return True
    tensors: list[torch.Tensor] = [p.detach() for _, p in named]
    if optimizer is not None:
        for group in optimizer.param_groups:
            for param in group["params"]:
                state = optimizer.state.get(param, {})
                tensors += [
                    v
                    for _, v in sorted(state.items(), key=lambda kv: str(kv[0]))
                    if isinstance(v, torch.Tensor) and v.dtype in _WORD_VIEWS
                ]
    local = tensor_fingerprints([t.to(tensors[0].device) for t in tensors])
    gathered = gather_fingerprints(local, process_group)
    # Deliberate sync: a save decision (rare path).
    return bool(all(torch.equal(g, gathered[0]) for g in gathered))


def collectives_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


# (word index within element 0, bit) of the third-highest mantissa bit: a 6.25-12.5% relative change
# that later updates cannot round away (the lowest bit can vanish in the next AdamW step).
_DEFAULT_FLIP: Final[Mapping[torch.dtype, tuple[int, int]]] = MappingProxyType(
    {
        torch.float32: (0, 20),
        torch.float64: (1, 17),  # little-endian: word 1 holds sign, exponent, top mantissa
        torch.bfloat16: (0, 4),
        torch.float16: (0, 7),
    }
)


def flip_parameter_bit(module: nn.Module, name: str | None = None, bit: int | None = None) -> str:
    """Flip one bit of element 0 of parameter ``name`` (default: the first), in place.

    A stand-in for silent data corruption (``--inject-fault bitflip``). By default a high
    mantissa bit (the value changes by 6.25-12.5%, it stays finite and training goes on normally
    while this replica silently differs); ``bit`` picks a bit of the element's first word.
    Returns a description of what was flipped.
    """
    named = dict(_validated_parameters(module))
    if not named:
        raise ValueError("flip_parameter_bit: the module has no parameters")
    name = name if name is not None else next(iter(named))
    return _flip_bit(named[name].data, bit, name)


def flip_gradient_bit(module: nn.Module, name: str | None = None, bit: int | None = None) -> str:
    """Flip one bit of element 0 of the gradient of parameter ``name`` (default: the first with
    a gradient), in place: a finite silent corruption of this replica's (all-reduced) gradient
    (``--inject-fault grad_corruption``). Returns a description of what was flipped."""
    named = {n: p for n, p in _validated_parameters(module) if p.grad is not None}
    if not named:
        raise ValueError("flip_gradient_bit: no parameter has a gradient")
    name = name if name is not None else next(iter(named))
    grad = named[name].grad
    assert grad is not None
    return "gradient: " + _flip_bit(grad, bit, name)


def _flip_bit(tensor: torch.Tensor, bit: int | None, name: str) -> str:
    int_dtype, _ = _WORD_VIEWS[tensor.dtype]
    word, default_bit = _DEFAULT_FLIP[tensor.dtype]
    if bit is None:
        bit = default_bit
    else:
        word = 0
    width = torch.iinfo(int_dtype).bits
    if not 0 <= bit < width:
        raise ValueError(f"bit must be in [0, {width}), got {bit}")
    with torch.no_grad():
        words = tensor.view(-1).view(int_dtype)
        # The top bit as a signed constant of the word type.
        mask = (1 << bit) if bit < width - 1 else -(1 << bit)
        words[word : word + 1].bitwise_xor_(
            torch.tensor(mask, dtype=int_dtype, device=words.device)
        )
    return f"flipped bit {bit} of word {word} of {name}[0]"
