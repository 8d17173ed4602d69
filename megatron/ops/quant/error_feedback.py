"""Error feedback for one quantized reduction hop.

Quantizing a gradient loses up to half a step per element, and those losses are biased: the same
small components round away step after step. Error feedback keeps this hop's local residual
(what went in minus what the quantized message decodes to) and adds it to the next step's input,
so the error is paid back later instead of accumulating: with it, sum_t (q_t - g_t) equals minus
the last residual (bounded by half a step per element); without it, that sum grows with t.

Keep one `ErrorFeedback` per (unit, hop): the residual has the shape of what this rank quantizes
on that hop, and it is local state (checkpoint it with `state_dict` to resume exactly).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .base import QuantizationError, Quantizer


class ErrorFeedback:
    """The fp32 quantization residual of one reduction hop, carried into the next step."""

    def __init__(self) -> None:
        self.residual: Optional[Tensor] = None

    def compensate(self, x: Tensor) -> Tensor:
        """x + residual in fp32 (just x in fp32 before the first update)."""
        x32 = x.to(torch.float32)
        if self.residual is None:
            return x32
        if self.residual.shape != x.shape or self.residual.device != x.device:
            raise QuantizationError(
                f"error feedback residual is {tuple(self.residual.shape)} on {self.residual.device} "
                f"but this hop's input is {tuple(x.shape)} on {x.device}; use one ErrorFeedback per hop")
        return x32 + self.residual

    def update(self, x_in: Tensor, x_deq: Tensor) -> None:
        """Remember x_in - x_deq: x_in is what was quantized (the compensated input), x_deq what the
        sent codes decode to."""
        if x_in.shape != x_deq.shape:
            raise QuantizationError(
                f"error feedback update: input {tuple(x_in.shape)} and decoded "
                f"{tuple(x_deq.shape)} differ in shape")
        self.residual = x_in.to(torch.float32) - x_deq.to(torch.float32)

    def quantize(self, quantizer: Quantizer, x: Tensor, bits: int,
                 block: int) -> tuple[Tensor, Tensor]:
        """Compensate, quantize and update in one call; returns (codes, scales) to send."""
        x_in = self.compensate(x)
        codes, scales = quantizer.quantize(x_in, bits, block)
        self.update(x_in, quantizer.dequantize(codes, scales, bits, block))
        return codes, scales

    def reduce_requantize(self, quantizer: Quantizer, codes_k: Tensor, scales_k: Tensor, k: int,
                          bits: int, block: int) -> tuple[Tensor, Tensor]:
        """The fused reduction hop with feedback: quantize (sum of the k chunks) + residual and
        update the residual in the same pass (bit for bit what compensate/update would do)."""
        numel = codes_k.numel() // max(k, 1) * (1 if bits == 8 else 2)
        if self.residual is None:
            self.residual = torch.zeros(numel, dtype=torch.float32, device=codes_k.device)
        return quantizer.reduce_requantize(codes_k, scales_k, k, bits, block,
                                           residual=self.residual)

    def reset(self) -> None:
        """Forget the residual (e.g. after a layout change, when it no longer lines up)."""
        self.residual = None

    def state_dict(self) -> dict:
        return {"residual": self.residual}

    def load_state_dict(self, state: dict) -> None:
        residual = state.get("residual")
        if residual is not None and residual.dtype != torch.float32:
            raise QuantizationError(f"error feedback residual must be float32, got {residual.dtype}")
        self.residual = residual
