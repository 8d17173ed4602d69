"""The GPT-NeoX model (no distributed code) and its size / FLOPs arithmetic."""
from megatron.model.gpt_neox import GPTNeoX, ModelConfigError, validate_model_config
from megatron.model.sizes import model_flops_per_token, num_parameters, parameter_count, unit_parameter_counts

__all__ = [
    "GPTNeoX",
    "ModelConfigError",
    "validate_model_config",
    "model_flops_per_token",
    "num_parameters",
    "parameter_count",
    "unit_parameter_counts",
]
