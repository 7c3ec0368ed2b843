"""bf16 compute weights: copies of the fp32 matmul weights made once per pass.

This is Megatron's ``--bf16`` layout (bf16 parameters over fp32 main parameters and fp32 main
gradients, ``--accumulate-allreduce-grads-in-fp32``) for a model that keeps fp32 parameters and
runs under ``torch.autocast``. Plain autocast casts every fp32 weight to bf16 again in each
micro-batch's forward and casts its bf16 gradient back in each backward. :class:`ComputeWeights`
instead

* makes the bf16 copies once per pass, before its first micro-batch (one foreach copy);
* lets the model's layers run on them: the copies are swapped into the modules for each
  micro-batch's forward and backward (a recomputed layer's second forward sees them too);
* after each micro-batch's backward adds their bf16 gradients into the fp32 parameters' ``.grad``
  (one foreach add), so gradient accumulation stays in fp32; after a pass's first micro-batch,
  whose fp32 gradients are zero, it copies them in instead (``accumulate(overwrite=True)``: the
  same values, without reading the zeros), except into a parameter that also receives gradients
  directly (tied embeddings' lookup), which is still added to.

Numerics are autocast's: the copy rounds as autocast's cast does, and adding a bf16 gradient into
fp32 is the exact conversion followed by the same fp32 add. Only the order of the fp32 additions
into a weight that is used both through a copy and directly differs (tied word embeddings: the
lookup reads the fp32 weight, the output layer its copy).

The parameters stay fp32 and are the only ones the optimizer, ``state_dict`` and checkpoints
see: a copy is present in its module only inside a micro-batch. Both foreach steps are compiled
with Inductor (no CUDA graphs of its own, so they can be captured) where ``torch.compile`` works,
by default on CUDA: eager foreach ops over mixed dtypes fall back to one slow kernel per tensor
(measured on the H200: 2.5 ms per iteration at gpt2-124m, issue 19). If compiling fails, the eager
foreach ops are used, with a warning.

Which parameters get a copy: the model's ``compute_weight_slots()`` when it has one
(``stalwart.models.GPT``: Linear and MoE expert weights and biases, and the output layer's use of
tied embeddings), else every ``nn.Linear``'s weight and bias. A slot is ``(module, attribute,
parameter)``: the attribute is a parameter of the module, or a plain attribute (default ``None``)
that the module's forward reads instead of ``parameter`` when set. The model's
``fp32_grad_slots()`` (GPT: the norms and the learned position embeddings) get fp32 copies: no
precision change, but their gradients join the same one foreach add per micro-batch instead of
one autograd accumulation kernel per parameter.

Example (the step runs the forward under bf16 autocast, as it must)::

    >>> import torch
    >>> from torch import nn
    >>> from stalwart.loop import ComputeWeights
    >>> model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 1))
    >>> weights = ComputeWeights(model)
    >>> weights.refresh()                     # once per pass: bf16 copies of the fp32 weights
    >>> with torch.autocast("cpu", dtype=torch.bfloat16), weights.using():
    ...     model(torch.randn(2, 4)).float().sum().backward()
    >>> weights.accumulate()                  # after each micro-batch: bf16 grads -> fp32 .grad
    >>> {p.dtype for p in model.parameters()}, model[0].weight.grad.dtype
    ({torch.float32}, torch.float32)

``GuardedStep(..., compute_weights=weights)`` does the three calls in every pass, eager or
captured in a full-iteration CUDA graph.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
from torch import nn

from stalwart.models.fused_grad import fp32_wgrad_supported

logger = logging.getLogger(__name__)

Slot = tuple[nn.Module, str, nn.Parameter]
"""``(module, attribute, parameter)``: where a compute copy of ``parameter`` is swapped in."""


def linear_slots(model: nn.Module) -> list[Slot]:
    """The weight and bias of every ``nn.Linear`` in ``model`` that requires grad."""
    return [
        (module, name, param)
        for module in model.modules()
        if isinstance(module, nn.Linear)
        for name, param in module.named_parameters(recurse=False)
        if param.requires_grad
    ]


def compute_weight_slots(model: nn.Module) -> list[Slot]:
    """``model.compute_weight_slots()`` when the model defines it, else :func:`linear_slots`."""
    own = getattr(model, "compute_weight_slots", None)
    return list(own()) if callable(own) else linear_slots(model)


def _foreach_copy(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    torch._foreach_copy_(dst, src)


def _foreach_add(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    torch._foreach_add_(dst, src)


def _foreach_copy_then_add(
    copy_dst: list[torch.Tensor],
    copy_src: list[torch.Tensor],
    add_dst: list[torch.Tensor],
    add_src: list[torch.Tensor],
) -> None:
    torch._foreach_copy_(copy_dst, copy_src)
    if add_dst:
        torch._foreach_add_(add_dst, add_src)


def _pick(tensors: list[torch.Tensor], flags: list[bool], want: bool) -> list[torch.Tensor]:
    return [t for t, flag in zip(tensors, flags, strict=True) if flag is want]


def _used_elsewhere(model: nn.Module, slots: list[Slot]) -> list[bool]:
    """Per slot: whether its parameter also gets gradients some other way: registered outside the
    slots (a tied weight: the module holding it uses the fp32 parameter itself, so autograd adds
    into its ``.grad``), or in several slots (their gradients add up)."""
    slot_keys = {(id(module), name) for module, name, _ in slots}
    direct = {
        id(param)
        for module in model.modules()
        for name, param in module._parameters.items()
        if param is not None and (id(module), name) not in slot_keys
    }
    seen: set[int] = set()
    for _, _, param in slots:
        if id(param) in seen:
            direct.add(id(param))
        seen.add(id(param))
    return [id(param) in direct for _, _, param in slots]


class _Foreach:
    """A foreach function, compiled on first use when asked; eager after a compile failure."""

    def __init__(self, func: Callable[..., None], compiled: bool) -> None:
        self._eager = func
        self._func: Callable[..., Any] = func
        if compiled:
            # Inductor's own CUDA graphs are off: the call may be captured by a full-iteration
            # graph.
            self._func = torch.compile(
                func, fullgraph=True, dynamic=False, options={"triton.cudagraphs": False}
            )
        self.compiled = compiled

    def __call__(self, *lists: list[torch.Tensor]) -> None:
        if not self.compiled:
            self._eager(*lists)
            return
        try:
            self._func(*lists)
        except Exception as err:  # an Inductor/Triton failure must not stop training
            logger.warning(
                "compiling the bf16 compute-weight foreach step failed (%s: %s); using eager "
                "foreach ops (slower with mixed dtypes)",
                type(err).__name__,
                str(err)[:200],
            )
            self.compiled = False
            self._eager(*lists)


class ComputeWeights:
    """bf16 (or fp16) compute copies of a model's matmul weights; see the module docstring.

    Args:
        model: the unwrapped model (not DDP/FSDP: their gradient hooks sit on the fp32
            parameters, which the forward no longer uses; a ``GuardedStep`` given the DDP model
            reduces the gradients itself, `stalwart.loop.data_parallel_grads`; FSDP2 is
            refused). Build it on its final device; the
            parameters must not be replaced afterwards (loading a state dict copies in place).
        dtype: the compute dtype (the autocast dtype of the forward).
        slots: where copies go (default: :func:`compute_weight_slots`).
        compiled: compile the foreach copy and add (default: on CUDA).
        fp32_slots: slots whose copies keep the parameter's dtype (autocast runs them in fp32:
            norms, position embeddings): their gradients join the same one foreach add per
            micro-batch instead of one autograd accumulation per parameter (issue 19: ~200
            small add kernels per iteration at gpt2-124m); numerics unchanged (the same fp32
            additions). Default: the model's ``fp32_grad_slots()`` when ``slots`` is None and
            the model defines it, else none.
        fuse_grad_accumulation: Megatron's ``--gradient-accumulation-fusion``
            (`stalwart.models.fused_grad`): a slot whose module has a ``<attribute>_main_grad``
            hook (`stalwart.models.fused_grad.Linear`, the GPT's tied output layer) adds its
            weight gradient into the fp32 ``.grad`` in its backward, and the model's
            ``fused_grad_direct_uses()`` (the GPT's lookup) likewise; those gradients skip the
            bf16 copy and the foreach add. A parameter that autograd also accumulates into
            directly is not fused (autograd may replace its ``.grad``). Raises if no slot can.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        dtype: torch.dtype = torch.bfloat16,
        slots: list[Slot] | None = None,
        compiled: bool | None = None,
        fp32_slots: list[Slot] | None = None,
        fuse_grad_accumulation: bool = False,
    ) -> None:
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"ComputeWeights dtype must be bfloat16 or float16, got {dtype}")
        self.slots = list(compute_weight_slots(model) if slots is None else slots)
        if not self.slots:
            raise ValueError("ComputeWeights: the model has no Linear layer to make copies of")
        if fp32_slots is None:
            own = getattr(model, "fp32_grad_slots", None)
            fp32_slots = list(own()) if slots is None and callable(own) else []
        self.copy_dtypes = [dtype] * len(self.slots) + [torch.float32] * len(fp32_slots)
        self.slots += fp32_slots
        self.masters = [param for _, _, param in self.slots]
        for param in self.masters:
            if param.dtype != torch.float32 or type(param) is not nn.Parameter:
                raise ValueError(
                    "ComputeWeights needs plain fp32 parameters (not sharded DTensors, not "
                    f"already low precision); got {type(param).__name__} of {param.dtype}"
                )
        self.dtype = dtype
        device = self.masters[0].device
        on_cuda = device.type == "cuda"
        compile_them = on_cuda if compiled is None else compiled
        self._copy = _Foreach(_foreach_copy, compile_them)
        self._add = _Foreach(_foreach_add, compile_them)
        self._first = _Foreach(_foreach_copy_then_add, compile_them)
        self.direct = _used_elsewhere(model, self.slots)
        self.fused, self.fused_uses = _fusion_plan(
            model, self.slots, self.copy_dtypes, fuse_grad_accumulation
        )
        self.fp32_gemm = fuse_grad_accumulation and fp32_wgrad_supported(device, dtype)
        self.copies: list[nn.Parameter] = []

    @property
    def compiled(self) -> bool:
        """Whether the foreach steps run compiled (False after a compile failure)."""
        return self._copy.compiled and self._add.compiled and self._first.compiled

    def refresh(self) -> None:
        """Copy the fp32 parameters into the compute copies (once per pass, before its first
        micro-batch; device work only, so it can be captured)."""
        if not self.copies:
            self.copies = [
                nn.Parameter(torch.empty_like(m, dtype=copy_dtype, requires_grad=False))
                for m, copy_dtype in zip(self.masters, self.copy_dtypes, strict=True)
            ]
        with torch.no_grad():
            self._copy([c.detach() for c in self.copies], [m.detach() for m in self.masters])

    @contextlib.contextmanager
    def using(self) -> Iterator[None]:
        """The copies in place of the parameters in their modules (forward and backward of one
        micro-batch); the parameters are back on exit."""
        if not self.copies:
            raise RuntimeError("ComputeWeights.using() before refresh(): no copies yet")
        previous = [
            _swap(module, name, copy) for (module, name, _), copy in zip(self.slots, self.copies)
        ]
        hooks = self._fusion_hooks() if torch.is_grad_enabled() else []
        for module, attribute, grad in hooks:
            object.__setattr__(module, attribute, grad)
            object.__setattr__(module, "fp32_wgrad", self.fp32_gemm)
        try:
            yield
        finally:
            for (module, name, _), value in zip(self.slots, previous):
                _swap(module, name, value)
            for module, attribute, _ in hooks:
                object.__setattr__(module, attribute, None)

    def _fusion_hooks(self) -> list[tuple[nn.Module, str, torch.Tensor]]:
        """``(module, attribute, fp32 grad)`` for every fused slot and direct use; allocates a
        missing ``.grad`` (zero: the fused ops add into it)."""
        targets = [(m, f"{n}_main_grad", p) for (m, n, p), f in zip(self.slots, self.fused) if f]
        hooks = []
        for module, attribute, param in targets + self.fused_uses:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            hooks.append((module, attribute, param.grad))
        return hooks

    def accumulate(self, overwrite: bool = False) -> None:
        """Add the copies' gradients into the fp32 parameters' ``.grad`` and clear them (after
        each micro-batch's backward). A parameter without ``.grad`` gets a zero one first.

        ``overwrite``: the fp32 gradients are zero (or None) since the pass began, i.e. this is
        its first micro-batch: the copies' gradients are copied in (adding to zero is exact, so
        the values are the same, without reading the zeros), except into parameters that also
        get gradients directly (:attr:`direct`), which are added to as always.
        """
        triples = [
            (m, c.grad, direct and overwrite)
            for m, c, direct, fused in zip(self.masters, self.copies, self.direct, self.fused)
            if c.grad is not None and not fused
        ]
        if not triples:
            return
        for master, _, summed_into in triples:
            if master.grad is None:  # (a copied-into gradient need not be zeroed first)
                fresh = overwrite and not summed_into
                master.grad = torch.empty_like(master) if fresh else torch.zeros_like(master)
        fp32 = [cast(torch.Tensor, m.grad) for m, _, _ in triples]
        bf16 = [cast(torch.Tensor, g) for _, g, _ in triples]
        # Else another list length: do not recompile.
        full = len(triples) == len(self.copies) - sum(self.fused)
        if overwrite:
            flags = [a for _, _, a in triples]
            copied = _pick(fp32, flags, False), _pick(bf16, flags, False)
            summed = _pick(fp32, flags, True), _pick(bf16, flags, True)
            (self._first if full else _foreach_copy_then_add)(*copied, *summed)
        else:
            (self._add if full else _foreach_add)(fp32, bf16)
        for copy_param in self.copies:
            copy_param.grad = None

    def release(self) -> None:
        """Drop the copies (they are made again by the next :meth:`refresh`)."""
        self.copies = []


def _swap(module: nn.Module, name: str, value: Any) -> Any:
    """Put ``value`` at ``module.<name>`` (a parameter slot or a plain attribute); return the
    previous value."""
    params = module._parameters
    if name in params:
        previous = params[name]
        params[name] = value
        return previous
    previous = getattr(module, name)
    # object.__setattr__: a Parameter assigned through nn.Module.__setattr__ would be registered.
    object.__setattr__(module, name, value)
    return previous


def _fusion_plan(
    model: nn.Module, slots: list[Slot], dtypes: list[torch.dtype], fuse: bool
) -> tuple[list[bool], list[Slot]]:
    """Which slots add their gradient into the fp32 ``.grad`` themselves, and the model's
    direct uses that do (see ``fuse_grad_accumulation``)."""
    if not fuse:
        return [False] * len(slots), []
    own = getattr(model, "fused_grad_direct_uses", None)
    uses: list[Slot] = list(own()) if callable(own) else []
    covered = {id(p) for _, _, p in uses}
    slot_keys = {(id(module), name) for module, name, _ in slots}
    # Registered outside the slots and not fused: autograd accumulates into .grad directly.
    plain_direct = {
        id(param)
        for module in model.modules()
        for name, param in module._parameters.items()
        if param is not None and (id(module), name) not in slot_keys and id(param) not in covered
    }
    fused = [
        dtype != torch.float32
        and hasattr(module, f"{name}_main_grad")
        and id(param) not in plain_direct
        for (module, name, param), dtype in zip(slots, dtypes, strict=True)
    ]
    if not any(fused):
        raise ValueError(
            "gradient accumulation fusion: no compute-weight slot has a fused-gradient hook (use "
            "stalwart.models.fused_grad.Linear for the model's Linear layers)"
        )
    return fused, uses


class NullComputeWeights:
    """No compute copies (the default): every hook is a no-op."""

    def refresh(self) -> None:
        pass

    def using(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def accumulate(self, overwrite: bool = False) -> None:
        pass

    def release(self) -> None:
        pass


NO_COMPUTE_WEIGHTS = NullComputeWeights()


def check_compute_weights(
    weights: ComputeWeights | None, model: nn.Module, autocast: Callable[..., Any] | None
) -> None:
    """Compute copies need the forward under autocast (their matmuls take the activations in
    the copies' dtype) and the fp32 parameters' ``.grad`` filled by them, not by FSDP2's
    hooks (DDP's reduction the step does itself)."""
    if weights is None:
        return
    if autocast is None:
        raise ValueError(
            "GuardedStep(compute_weights=...) needs autocast= to the copies' dtype (--bf16)"
        )
    if hasattr(model, "set_requires_gradient_sync"):
        raise ValueError(FSDP2_COMPUTE_WEIGHTS_MESSAGE)


FSDP2_COMPUTE_WEIGHTS_MESSAGE = (
    "--bf16-compute-weights is not supported with --use-torch-fsdp2: FSDP2 reduces the sharded "
    "fp32 parameters' gradients in its own hooks, which the copies bypass. FSDP2's equivalent "
    "is its MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) "
    "(fully_shard(..., mp_policy=...): bf16 parameters gathered from the fp32 shards, fp32 "
    "gradient reduction); the reference trainer's --use-torch-fsdp2 runs under bf16 autocast"
)

__all__ = [
    "FSDP2_COMPUTE_WEIGHTS_MESSAGE",
    "NO_COMPUTE_WEIGHTS",
    "ComputeWeights",
    "NullComputeWeights",
    "Slot",
    "check_compute_weights",
    "compute_weight_slots",
    "linear_slots",
]
