"""Custom numerical kernels used by the engine (block quantization lives in `megatron.ops.quant`)."""
