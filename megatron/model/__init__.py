"""The GPT-NeoX model (no distributed code) and its size / FLOPs arithmetic."""
from megatron.model.gpt_neox import GPTNeoX, ModelConfigError, validate_model_config
from megatron.model.kv_cache import KVCache
from megatron.model.sizes import (model_flops_per_token, num_parameters, parameter_count, unit_flops_per_token,
                                  unit_parameter_counts)

__all__ = [
    "GPTNeoX",
    "KVCache",
    "ModelConfigError",
    "validate_model_config",
    "model_flops_per_token",
    "num_parameters",
    "parameter_count",
    "unit_flops_per_token",
    "unit_parameter_counts",
]
