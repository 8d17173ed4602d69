"""Test oracles for the quantized collectives: plain, unfused reference behaviour that the fused
kernels and the engine are checked against. Nothing in megatron/ imports this.

``ErrorFeedback``: the error feedback of one quantized reduction hop written out step by step. The
engine keeps its residuals itself (``FlatUnit.residuals``, updated inside the fused
``reduce_requantize(..., residual=r)``); this class is the readable form those are compared with.
Quantizing loses up to half a step per element, with a bias (the same small components round away
every step); feeding the loss into the next step's input pays it back, so sum_t (q_t - g_t) stays
minus the last residual instead of growing with t.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from megatron.ops.quant import QuantizationError, Quantizer


class ErrorFeedback:
    """The fp32 residual of one hop (``None`` until the first update), carried into the next step."""

    def __init__(self) -> None:
        self.residual: Optional[Tensor] = None

    def compensate(self, x: Tensor) -> Tensor:
        """``x`` in fp32 plus the residual (just ``x`` in fp32 before any update)."""
        wide = x.to(torch.float32)
        if self.residual is None:
            return wide
        if self.residual.shape != x.shape or self.residual.device != x.device:
            raise QuantizationError(f"residual {tuple(self.residual.shape)} on {self.residual.device} cannot "
                                    f"compensate an input {tuple(x.shape)} on {x.device}: use one ErrorFeedback per hop")
        return wide + self.residual

    def update(self, x_in: Tensor, x_deq: Tensor) -> None:
        """The new residual: what was quantized (``x_in``, compensated) minus what its codes decode to."""
        if x_in.shape != x_deq.shape:
            raise QuantizationError(f"error feedback update: the input {tuple(x_in.shape)} and the decoded "
                                    f"values {tuple(x_deq.shape)} differ in shape")
        self.residual = x_in.to(torch.float32) - x_deq.to(torch.float32)

    def quantize(self, quantizer: Quantizer, x: Tensor, bits: int, block: int) -> tuple[Tensor, Tensor]:
        """compensate, quantize, update: the (codes, scales) a first hop sends."""
        x_in = self.compensate(x)
        codes, scales = quantizer.quantize(x_in, bits, block)
        self.update(x_in, quantizer.dequantize(codes, scales, bits, block))
        return codes, scales

    def reduce_requantize(self, quantizer: Quantizer, codes_k: Tensor, scales_k: Tensor, k: int, bits: int,
                          block: int) -> tuple[Tensor, Tensor]:
        """A later hop through the fused kernel, which updates the residual in place."""
        if self.residual is None:
            per_chunk = codes_k.numel() // max(k, 1) * (2 if bits == 4 else 1)  # INT4: two codes a byte
            self.residual = torch.zeros(per_chunk, dtype=torch.float32, device=codes_k.device)
        return quantizer.reduce_requantize(codes_k, scales_k, k, bits, block, residual=self.residual)

    def reset(self) -> None:
        self.residual = None

    def state_dict(self) -> dict:
        return {"residual": self.residual}

    def load_state_dict(self, state: dict) -> None:
        residual = state.get("residual")
        if residual is not None and residual.dtype != torch.float32:
            raise QuantizationError(f"an error feedback residual must be float32, got {residual.dtype}")
        self.residual = residual
