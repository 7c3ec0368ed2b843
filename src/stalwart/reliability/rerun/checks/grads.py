"""The gradient checks: local gradient norms per DDP bucket, recorded on the device.

None of this syncs: the norms go to the recorder's device buffer (``Recorder.check_grad_norms``),
which the machine reads once per iteration (and which can gate the optimizer step on the
device). Gradient checks run per bucket, before the data-parallel reduction, as Megatron's
``check_grads`` does; their messages and rules are in ``rules``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from stalwart.reliability.rerun.checks.recorder import Recorder

# Default DDP bucket size (torch's bucket_cap_mb=25): the fixed layout of the gradient checks.
DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _grads_of(params: Sequence[torch.nn.Parameter]) -> list[torch.Tensor]:
    """The gradients of ``params``, every one of which has one."""
    return [p.grad for p in params if p.grad is not None]


def local_grad_norm(parameters: Iterable[torch.nn.Parameter]) -> torch.Tensor:
    """L2 norm of all local gradients, in float64 so squares cannot overflow (device ops only)."""
    # FSDP2 gradients are DTensors: this rank's shard is what it computed and must check.
    grads = [_local(p.grad) for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    return torch.linalg.vector_norm(_stacked_norms(grads))


def _stacked_norms(grads: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of every tensor (``torch._foreach_norm``: a few kernels per dtype), stacked
    as float64: one stack and one conversion, however many tensors."""
    norms = torch._foreach_norm(grads)
    if all(n.dtype == norms[0].dtype for n in norms):
        return torch.stack(norms).to(torch.float64)
    return torch.stack([n.to(torch.float64) for n in norms])


def bucket_layout(
    parameters: Sequence[torch.nn.Parameter], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> list[int]:
    """Bucket index of every parameter: DDP's initial layout (reverse order, ``bucket_bytes``).

    Fixed for the whole job, whatever DDP rebuilds after its first iteration, so the checks of
    an iteration and of its rerun (also after a restart) are the same calls.
    """
    index = [0] * len(parameters)
    bucket, filled = 0, 0
    for i in reversed(range(len(parameters))):
        size = parameters[i].numel() * parameters[i].element_size()
        if filled and filled + size > bucket_bytes:
            bucket, filled = bucket + 1, 0
        index[i] = bucket
        filled += size
    return index


class GradCheckState:
    """Per-bucket gradient checks of the local gradients (DDP comm hook or after backward).

    Each backward's per-parameter norms are summed into the fixed buckets of
    :func:`bucket_layout`; once all are in, one check per bucket is recorded. With DDP this runs
    in the comm hook, before each bucket's all-reduce averages the gradients.
    """

    def __init__(
        self,
        recorder: Recorder,
        parameters: Sequence[torch.nn.Parameter],
        process_group: dist.ProcessGroup | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        self.recorder = recorder
        self.process_group = process_group
        self.params = [p for p in parameters if p.requires_grad]
        layout = bucket_layout(self.params, bucket_bytes)
        self.num_buckets = max(layout, default=-1) + 1
        self._bucket_of = {id(p): b for p, b in zip(self.params, layout, strict=True)}
        self._sum_sq: torch.Tensor | None = None
        # Bucket index tensors per DDP bucket, made in the first (eager) backward: a capture
        # must not copy from the host.
        self._index: dict[tuple[int, ...], torch.Tensor] = {}
        # The one-bucket check's global norm, written in place every pass (a captured graph
        # keeps its address), and the parameters it is the norm of (None: not shareable).
        self._norm_out: torch.Tensor | None = None
        self._norm_params: list[torch.nn.Parameter] | None = None

    def add_grads(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
        """Accumulate squared norms of ``grads`` (of ``params``) into their buckets."""
        if not grads:
            return
        device = grads[0].device
        if self._sum_sq is None:
            self._sum_sq = torch.zeros(self.num_buckets, dtype=torch.float64, device=device)
        squares = _stacked_norms([_local(g) for g in grads]).square()
        ids = tuple(id(p) for p in params)
        index = self._index.get(ids)
        if index is None:
            buckets = [self._bucket_of[i] for i in ids]
            index = self._index[ids] = torch.tensor(buckets, device=device)
        self._sum_sq.index_add_(0, index, squares)

    def finish(self) -> None:
        """Record the checks of every bucket (one call, device work only) and start over."""
        if self._sum_sq is None:
            return
        norms, self._sum_sq = self._sum_sq.sqrt(), None
        self.recorder.check_grad_norms(norms)

    def check_after_backward(self) -> None:
        """Without DDP: check the local gradients now (after backward, before any step)."""
        params = [p for p in self.params if p.grad is not None]
        # A plain tensor's missing ``to_local`` costs a raised AttributeError: only others ask.
        grads = [g if type(g) is torch.Tensor else _local(g) for g in _grads_of(params)]
        if self.num_buckets == 1 and self._sum_sq is None and grads:
            # One bucket, one call: the norm of the per-tensor norms in one reduction, in their
            # dtype as the clip computes it (fp32 grads: Megatron's fp32 norm; a few kernels
            # fewer per pass than the buckets' sums of squares). The record widens it exactly.
            norms = torch._foreach_norm(grads)
            if all(n.dtype == norms[0].dtype for n in norms):
                total = self._total_like(norms[0])
                torch.linalg.vector_norm(torch.stack(norms), out=total)
                self._norm_params = params if self._shareable(params, grads, total) else None
                # 0-d: its one element is the one bucket's (record_run broadcasts it).
                self.recorder.check_grad_norms(total)
                return
        self._norm_params = None
        self.add_grads(params, grads)
        self.finish()

    def _total_like(self, norm: torch.Tensor) -> torch.Tensor:
        """The persistent 0-d tensor of the one-bucket norm (allocated in an eager pass)."""
        out = self._norm_out
        if out is None or out.dtype != norm.dtype or out.device != norm.device:
            out = self._norm_out = torch.empty((), dtype=norm.dtype, device=norm.device)
        return out

    def _shareable(
        self,
        params: list[torch.nn.Parameter],
        grads: list[torch.Tensor],
        total: torch.Tensor,
    ) -> bool:
        """Whether ``total`` is bitwise the clip's norm: float32 (the clip computes in float32),
        one rank's own full gradients (no process group, no DTensor shards)."""
        if total.dtype != torch.float32 or self.process_group is not None:
            return False
        return all(g is p.grad for g, p in zip(grads, params, strict=True))

    def norm_of(self, params: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """The global L2 norm of ``params``' gradients as the last check computed it, or None.

        Without DDP the check after the backward computes, for float32 gradients in one
        bucket, exactly what the clip computes (``torch._foreach_norm``, then the norm of the
        stacked norms: :func:`stalwart.graphs.grad_norm`), so the clip can take it instead of
        reading every gradient again (a :class:`stalwart.graphs.GradNormSource`). The tensor is
        rewritten in place by the next pass's check (stream-ordered); None when the last check
        took another path or checked other parameters (identity and order compared).
        """
        checked = self._norm_params
        if checked is None or len(checked) != len(params):
            return None
        if any(a is not b for a, b in zip(checked, params, strict=True)):
            return None
        return self._norm_out


def _grad_check_allreduce_hook(state, bucket):  # type: ignore[no-untyped-def]
    # Left unannotated on purpose: DDP inspects the signature and rejects string annotations.
    buffer = bucket.buffer()
    state.add_grads(bucket.parameters(), bucket.gradients())
    if bucket.is_last():
        state.finish()
    group = state.process_group
    buffer.div_(dist.get_world_size(group))
    fut = dist.all_reduce(buffer, group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def register_grad_check_hook(
    ddp_model: torch.nn.parallel.DistributedDataParallel,
    recorder: Recorder,
    process_group: dist.ProcessGroup | None = None,
) -> GradCheckState:
    """Register the gradient checks' comm hook on a DDP model (before the first backward): it
    checks the local gradients of each backward per bucket on the device before the all-reduce,
    then averages them like DDP's default hook. The recorder's ``checks`` say which checks run.
    Returns the hook's state."""
    params = list(ddp_model.module.parameters())
    # The same bucket size as DDP's, so the fixed layout is its initial one.
    size = int(getattr(ddp_model, "bucket_bytes_cap", DEFAULT_BUCKET_BYTES))
    state = GradCheckState(recorder, params, process_group, bucket_bytes=size)
    hook = _grad_check_allreduce_hook
    ddp_model.register_comm_hook(state, hook)  # type: ignore[arg-type]
    return state
