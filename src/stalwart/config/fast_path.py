"""What ``--compile --cuda-graph-impl full_iteration --optimizer-cuda-graph`` turns on by itself.

Asking for compiled full-iteration graphs gives every setting measured faster that computes the
same run: bitwise, or within the tolerance the GPU tests hold each one to against the plain step
(losses within 1e-3 relative, the rerun machine's gradient tolerance). Each is on unless the
command line or ``--config`` sets it, and only where it is valid:

* ``--bf16-compute-weights`` (with ``--bf16``, not ``--use-torch-fsdp2``): the bf16 weight copies
  autocast makes in every micro-batch, made once per iteration (the same rounding), and their
  bf16 gradients added into the fp32 ones as autocast's backward adds them; tied embeddings add
  their two fp32 gradients in another order (``stalwart.loop.compute_weights``).
* ``--gradient-accumulation-fusion`` (with the compute weights): the weight-gradient GEMMs sum
  into the fp32 gradients instead of rounding each micro-batch's gradient to bf16 first: closer
  to fp32, within 1% of the unfused gradients, losses within 1e-3
  (``tests/gpu/test_kernel_floor_gpu.py``).
* ``--clip-grad-in-optimizer`` (with ``--clip-grad`` > 0, not FSDP2): the same norm, the clip
  factor applied inside the fused AdamW step; parameters within 2e-6 after 8 clipped steps
  (``tests/gpu/test_gpt2_floor_gpu.py``).
* ``--cross-entropy-loss-fusion`` (not ``--fp16``): the same loss, gradients within 2.1e-5
  relative (``tests/gpu/test_cross_entropy_fusion_gpu.py``).
* ``--inductor-config triton.mix_order_reduction=False`` (where the running torch has the
  option): the same forward, the norms' weight-gradient sums ordered differently (gradient norm
  within 1e-3).
* ``--inductor-config coordinate_descent_tuning=True``: Inductor tunes its Triton kernels' block
  sizes at compile time (the order of a reduction's partial sums; a longer first compile, which
  ``--compile-cache-dir`` keeps for the next launch).

What changes the numerics stays one switch, off unless given: ``--bf16-residual-connection``
(the residual stream rounded to bf16 between layers, Megatron's default under ``--bf16``, whose
``--fp32-residual-connection`` is this switch off): losses move by up to 2e-2 relative over ten
iterations. An explicit value wins: ``--no-bf16-compute-weights``,
``--no-gradient-accumulation-fusion``, ``--no-clip-grad-in-optimizer``,
``--no-cross-entropy-loss-fusion``, ``--inductor-config KEY=VALUE`` for the same key.

    >>> import argparse
    >>> ns = argparse.Namespace(compile=True, cuda_graph_impl="full_iteration",
    ...     optimizer_cuda_graph=True, cuda_graph_include_optimizer=False, bf16=True,
    ...     fp16=False, use_torch_fsdp2=False, clip_grad=1.0, bf16_compute_weights=None,
    ...     gradient_accumulation_fusion=False, clip_grad_in_optimizer=None,
    ...     cross_entropy_loss_fusion=None,
    ...     inductor_config=["coordinate_descent_tuning=False"])
    >>> values = fast_path_values(ns, known_options={"triton.mix_order_reduction": True,
    ...                                              "coordinate_descent_tuning": False})
    >>> sorted(k for k, v in values.items() if v is True)
    ['bf16_compute_weights', 'clip_grad_in_optimizer', 'cross_entropy_loss_fusion']
    >>> values["inductor_config"]
    ['coordinate_descent_tuning=False', 'triton.mix_order_reduction=False']
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

# The switches the fast path turns on, in the order the rules read them.
SWITCHES = (
    "bf16_compute_weights",
    "gradient_accumulation_fusion",
    "clip_grad_in_optimizer",
    "cross_entropy_loss_fusion",
)
# Inductor options (key, value) the fast path passes to the model's torch.compile.
INDUCTOR_OPTIONS = (("triton.mix_order_reduction", False), ("coordinate_descent_tuning", True))


def asks_for_fast_path(ns: argparse.Namespace) -> bool:
    """Compiled full-iteration graphs with the optimizer in its own graph: the measured set."""
    impl = getattr(ns, "cuda_graph_impl", None)
    return bool(
        getattr(ns, "compile", False)
        and getattr(impl, "value", impl) == "full_iteration"
        and getattr(ns, "optimizer_cuda_graph", False)
        and not getattr(ns, "cuda_graph_include_optimizer", False)
    )


def _valid(ns: argparse.Namespace, chosen: Mapping[str, Any]) -> dict[str, bool]:
    """Where each switch can run with the rest of the flags (else it stays off)."""
    fsdp2 = bool(getattr(ns, "use_torch_fsdp2", False))
    bf16 = bool(getattr(ns, "bf16", False))
    fp16 = bool(getattr(ns, "fp16", False))
    clip = getattr(ns, "clip_grad", 1.0) or 0.0
    return {
        "bf16_compute_weights": bf16 and not fsdp2,
        "gradient_accumulation_fusion": bool(chosen.get("bf16_compute_weights")),
        "clip_grad_in_optimizer": clip > 0 and not fsdp2,
        "cross_entropy_loss_fusion": not fp16,
    }


def _inductor_items(ns: argparse.Namespace, known: Mapping[str, Any]) -> list[str] | None:
    """``--inductor-config`` with the fast path's options appended where the user did not set
    the key and this torch has the option; None when nothing is added."""
    given = list(getattr(ns, "inductor_config", None) or [])
    keys = {item.partition("=")[0].strip() for item in given}
    added = [f"{k}={v}" for k, v in INDUCTOR_OPTIONS if k in known and k not in keys]
    return given + added if added else None


def fast_path_values(
    ns: argparse.Namespace, known_options: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The namespace values the fast path sets (``dest -> value``): each unset switch of
    :data:`SWITCHES` that is valid with the other flags turns True (the others stay unset: off),
    and ``inductor_config`` with
    :data:`INDUCTOR_OPTIONS` appended (see the module docstring). Empty unless ``ns`` asks for
    compiled full-iteration graphs with ``--optimizer-cuda-graph``. Pure: ``ns`` is only read;
    ``known_options``: the running torch's Inductor options (read from torch when None)."""
    if not asks_for_fast_path(ns):
        return {}
    chosen: dict[str, Any] = {name: getattr(ns, name, None) for name in SWITCHES}
    values: dict[str, Any] = {}
    for name in SWITCHES:  # in order: the fusion reads the compute weights' resolved value
        if chosen[name] is None and _valid(ns, chosen)[name]:
            chosen[name] = values[name] = True
    if known_options is None:
        from stalwart.config.inductor import known_inductor_options

        known_options = known_inductor_options()
    items = _inductor_items(ns, known_options)
    if items is not None:
        values["inductor_config"] = items
    return values


__all__ = ["INDUCTOR_OPTIONS", "SWITCHES", "asks_for_fast_path", "fast_path_values"]
