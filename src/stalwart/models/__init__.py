"""Reference GPT (+ optional MoE), model presets and FLOPs accounting."""

from stalwart.models.flops import num_floating_point_operations
from stalwart.models.gpt import GPT, GPTConfig
from stalwart.models.moe import MoEMLP, MoERouter
from stalwart.models.presets import PRESET_MICRO_BATCH_SIZE, PRESETS, preset_model_config

__all__ = [
    "GPT",
    "PRESETS",
    "PRESET_MICRO_BATCH_SIZE",
    "GPTConfig",
    "MoEMLP",
    "MoERouter",
    "num_floating_point_operations",
    "preset_model_config",
]
