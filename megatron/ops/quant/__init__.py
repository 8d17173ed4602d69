"""Block-wise symmetric quantization (INT8, packed INT4) for the engine's quantized collectives.

    q = get_quantizer()                                    # auto: triton on GPU, C++ on CPU
    n = padded_numel(numel, block, multiple=group_size)    # no block straddles a shard
    codes, scales = q.quantize(x, bits=4, block=block)
    y = q.dequantize(codes, scales, bits=4, block=block, numel=numel, dtype=torch.bfloat16)
    codes, scales = q.reduce_requantize(codes_k, scales_k, k, bits=4, block=block)

The format and rounding rule are in `base.py`; `reference.py` is the oracle; `docs/quantization.md`
explains the choice of DEFAULT_BLOCK with benchmark numbers.
"""
from .base import (DEFAULT_BLOCK, QuantizationError, Quantizer, codes_dtype, codes_numel,
                   padded_numel, qmax)
from .select import IMPLS, get_quantizer

__all__ = [
    "DEFAULT_BLOCK", "IMPLS", "QuantizationError", "Quantizer", "codes_dtype",
    "codes_numel", "get_quantizer", "padded_numel", "qmax",
]
