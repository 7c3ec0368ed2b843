"""Full-iteration and optimizer CUDA graphs, static inputs, shared pool, config checks.

Composable into any training loop; see ``docs/benchmarks-graphs.md`` and the class docstrings
for the integration recipe.
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
    "RecomputeGranularity",
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
