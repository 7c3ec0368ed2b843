"""Full-iteration and optimizer CUDA graphs, static inputs, shared pool, config checks.

Composable into any training loop (measurements: ``docs/benchmarks-graphs.md``). A hand-written
loop with validation inside the graph and the optimizer skip decided on the device::

    ctx = GraphContext(device)
    flags = DeviceFlags(["loss"], device)
    gate = torch.zeros((), device=device)            # 1.0 = skip this optimizer step

    def fwd_bwd(*, data_iterator, num_microbatches, model, forward_only=False, **_):
        losses = []
        for _ in range(num_microbatches):
            loss = model(**next(data_iterator))      # device work only, no .item()
            flags.record_nonfinite("loss", loss)     # captured with the rest
            (loss / num_microbatches).backward()
            losses.append(loss.detach())
        flags.update_skip_gate_(gate)                # any check failed -> gate = 1
        return losses

    graph = FullIterationGraph(fwd_bwd, context=ctx, grad_params=model.parameters(),
                               validation_buffer=flags)
    opt = OptimizerGraph(make_capturable_adamw(model.parameters(), lr=lr, device=device,
                                               fused=True),
                         context=ctx, clip_grad=1.0, skip_gate=gate)
    for it in range(iters):
        losses = graph(data_iterator=batches, num_microbatches=4, model=model)
        opt.step(lr=schedule(it), gated=True, overlap=True)  # skips itself on a failure
        report = flags.read()        # the one sync; overlaps the optimizer replay
        opt.join()
        if not report.ok:
            graph.rerun_last()       # same static inputs: transient or persistent?

A skip-and-count loop that never reruns can read one iteration late instead
(``pending = flags.read_async()`` ... ``pending.result()``): no sync on the critical path.
:class:`PipelinedGraphLoop` keeps the rerun and still takes the read off the critical path: it
launches the next iteration's forward-backward before reading the previous one's flags, and on a
rejection discards it and replays the rejected iteration on its own inputs and RNG state.
"""

from __future__ import annotations

from stalwart.graphs.checks import (
    GRAPHABLE_COMPILE_MODES,
    CudaGraphImpl,
    GraphSettings,
    RecomputeGranularity,
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
    ValidationBuffer,
    output_tensors,
)
from stalwart.graphs.optimizer import (
    OptimizerGraph,
    check_optimizer_graphable,
    clip_coefficient,
    clip_grads_,
    grad_norm,
    make_capturable_adamw,
    set_learning_rate,
)
from stalwart.graphs.pipelined import PipelinedGraphLoop, Resolution
from stalwart.graphs.pool import (
    CaptureErrorMode,
    GraphContext,
    supports_generator_registration,
)
from stalwart.graphs.static_inputs import InputSignature, StaticInputs, signature_of
from stalwart.graphs.validation import CheckKind, DeviceFlags, FlagReport, PendingFlags

__all__ = [
    "GRAPHABLE_COMPILE_MODES",
    "CaptureErrorMode",
    "CaptureFailurePolicy",
    "CheckKind",
    "CudaGraphImpl",
    "DeviceFlags",
    "FlagReport",
    "FullIterationGraph",
    "GraphContext",
    "GraphMode",
    "GraphSettings",
    "GraphSignatureError",
    "InputSignature",
    "OptimizerGraph",
    "PendingFlags",
    "PipelinedGraphLoop",
    "RecomputeGranularity",
    "Resolution",
    "SignatureChangePolicy",
    "StagePhase",
    "StaticInputs",
    "ValidationBuffer",
    "check_graph_config",
    "check_optimizer_graphable",
    "clip_coefficient",
    "clip_grads_",
    "compile_for_graph",
    "grad_norm",
    "graph_config_problems",
    "make_capturable_adamw",
    "output_tensors",
    "set_learning_rate",
    "signature_of",
    "supports_generator_registration",
]
