"""Full-iteration and optimizer CUDA graphs, static inputs, shared pool, config checks.

The mechanism only: capture, replay, the memory pool and streams, static input buffers, and the
config rules. What runs inside the graph (the loss and gradient checks writing the rerun
machine's device buffer, the skip gate, the gated optimizer replay and the look-ahead launch)
is the guarded step's: ``stalwart.loop.GuardedStep(..., plan=GraphPlan())``. Measurements:
``docs/benchmarks-graphs.md``. A bare use::

    ctx = GraphContext(device)
    graph = FullIterationGraph(forward_backward_func, context=ctx, grad_params=model.parameters())
    opt = OptimizerGraph(make_capturable_adamw(model.parameters(), lr=lr, device=device),
                         context=ctx, clip_grad=1.0)
    for it in range(iters):
        losses = graph(data_iterator=batches, num_microbatches=4, model=model)
        opt.step(lr=schedule(it))
"""

from __future__ import annotations

from stalwart.graphs.checks import (
    CudaGraphImpl,
    GraphSettings,
    check_graph_config,
    graph_config_problems,
)
from stalwart.graphs.compile import compile_for_graph
from stalwart.graphs.full_iteration import (
    CaptureFailurePolicy,
    FullIterationGraph,
    GraphMode,
    GraphSignatureError,
    SignatureChangePolicy,
    StagePhase,
)
from stalwart.graphs.optimizer import (
    GradNormSource,
    OptimizerGraph,
    check_optimizer_graphable,
    clip_coefficient,
    clip_for_step,
    clip_grads_,
    clip_in_optimizer_step,
    clip_scale_of,
    grad_norm,
    make_capturable_adamw,
    set_learning_rate,
    shared_norm,
)
from stalwart.graphs.pool import GraphContext
from stalwart.graphs.static_inputs import InputSignature, StaticInputs, signature_of

__all__ = [
    "CaptureFailurePolicy",
    "CudaGraphImpl",
    "FullIterationGraph",
    "GradNormSource",
    "GraphContext",
    "GraphMode",
    "GraphSettings",
    "GraphSignatureError",
    "InputSignature",
    "OptimizerGraph",
    "SignatureChangePolicy",
    "StagePhase",
    "StaticInputs",
    "check_graph_config",
    "check_optimizer_graphable",
    "clip_coefficient",
    "clip_for_step",
    "clip_grads_",
    "clip_in_optimizer_step",
    "clip_scale_of",
    "compile_for_graph",
    "grad_norm",
    "graph_config_problems",
    "make_capturable_adamw",
    "set_learning_rate",
    "shared_norm",
    "signature_of",
]
