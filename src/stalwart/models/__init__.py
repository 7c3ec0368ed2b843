"""Reference GPT (+ optional MoE, Llama switches, activation recompute), presets, FLOPs."""

from stalwart.models.config import GPTConfig, RecomputeGranularity
from stalwart.models.flops import num_floating_point_operations
from stalwart.models.fused_cross_entropy import linear_cross_entropy
from stalwart.models.gpt import GPT
from stalwart.models.moe import MoEMLP
from stalwart.models.presets import PRESET_MICRO_BATCH_SIZE, PRESETS, preset_model_config
from stalwart.models.recompute import layer_units

__all__ = [
    "GPT",
    "PRESETS",
    "PRESET_MICRO_BATCH_SIZE",
    "GPTConfig",
    "MoEMLP",
    "RecomputeGranularity",
    "layer_units",
    "linear_cross_entropy",
    "num_floating_point_operations",
    "preset_model_config",
]
