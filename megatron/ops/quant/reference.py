"""The plain torch implementation: the oracle every other implementation must match bit for bit.

Written for clarity, not speed: whole-tensor torch ops, one temporary per step. Runs on any device.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .base import Quantizer, qmax, rotation_scale


def pack_int4(codes: Tensor) -> Tensor:
    """int8 codes in [-7, 7] (even count) -> uint8 bytes, element 2i in the low nibble of byte i."""
    nibbles = codes.view(-1, 2).to(torch.int16) & 0xF
    return (nibbles[:, 0] | (nibbles[:, 1] << 4)).to(torch.uint8)


def unpack_int4(packed: Tensor) -> Tensor:
    """uint8 bytes -> int8 codes (two per byte, low nibble first), sign-extended from 4 bits."""
    wide = packed.to(torch.int16)
    nibbles = torch.stack([wide & 0xF, wide >> 4], dim=1).view(-1)
    return (nibbles - ((nibbles & 0x8) << 1)).to(torch.int8)


def encode_blocks(blocks: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """fp32 blocks [nb, block] -> (flat codes, fp32 scales [nb]) by the format's rule."""
    limit = qmax(bits)
    amax = blocks.abs().amax(dim=1)                      # NaN if the block has a NaN
    # IEEE division by a tensor: CUDA torch turns division by a Python scalar into a multiply by
    # its reciprocal, one ulp off in about half the blocks (seen on an H200: 2026-12-04)
    scales = amax / torch.full_like(amax, float(limit))
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)
    codes = torch.round(blocks / scales[:, None])        # IEEE division, round half to even
    codes = codes.clamp_(-limit, limit).to(torch.int8).view(-1)
    return (codes if bits == 8 else pack_int4(codes)), scales


def decode_blocks(codes: Tensor, scales: Tensor, bits: int, block: int) -> Tensor:
    """(flat codes, scales) -> fp32 blocks [nb, block], value = code * scale."""
    values = codes if bits == 8 else unpack_int4(codes)
    return values.to(torch.float32).view(-1, block) * scales[:, None]


def hadamard_blocks(x: Tensor, block: int) -> Tensor:
    """fp32 x -> its blockwise H_b x / sqrt(b): the butterfly stages in order, then the scale."""
    y = x.view(-1, block)
    half = 1
    while half < block:
        pairs = y.view(y.shape[0], block // (2 * half), 2, half)
        first, second = pairs[:, :, 0], pairs[:, :, 1]
        y = torch.stack([first + second, first - second], dim=2).view(-1, block)
        half *= 2
    return (y * torch.tensor(rotation_scale(block), dtype=torch.float32, device=x.device)).view(-1)


def _flat(rows: Tensor) -> Tensor:
    """Rows of encoded data as one flat tensor (a copy when the rows are not back to back)."""
    return rows.reshape(-1)


def _store(codes: Tensor, scales: Tensor, new_codes: Tensor, new_scales: Tensor) -> None:
    """Write flat encoded data into the output rows."""
    codes.copy_(new_codes.view(codes.shape))
    scales.copy_(new_scales.view(scales.shape))


class ReferenceQuantizer(Quantizer):
    """Block quantization in plain torch (the oracle). Rows are flattened (copied if strided) and
    outputs computed whole, then copied into place: clarity over speed."""

    name = "reference"

    def _quantize(self, x: Tensor, bits: int, block: int, codes: Tensor, scales: Tensor) -> None:
        _store(codes, scales, *encode_blocks(x.to(torch.float32).view(-1, block), bits))

    def _dequantize(self, codes: Tensor, scales: Tensor, bits: int, block: int, out: Tensor) -> None:
        out.copy_(decode_blocks(_flat(codes), _flat(scales), bits, block).view(-1))

    def _sum(self, codes_k: Tensor, scales_k: Tensor, bits: int, block: int) -> Tensor:
        total = torch.zeros(scales_k.shape[1], block, dtype=torch.float32, device=codes_k.device)
        for j in range(codes_k.shape[0]):                # fixed order: chunk 0 first
            total = total + decode_blocks(codes_k[j], scales_k[j], bits, block)
        return total.view(-1)

    def _dequantize_sum(self, codes_k: Tensor, scales_k: Tensor, bits: int, block: int,
                        out: Tensor) -> None:
        out.copy_(self._sum(codes_k, scales_k, bits, block))

    def _reduce_requantize(self, codes_k: Tensor, scales_k: Tensor, bits: int, block: int,
                           residual: Optional[Tensor], codes: Tensor, scales: Tensor) -> None:
        total = self._sum(codes_k, scales_k, bits, block)
        if residual is not None:
            total = total + residual                     # error feedback: sum first, then residual
        new_codes, new_scales = encode_blocks(total.view(-1, block), bits)
        if residual is not None:
            residual.copy_(total - decode_blocks(new_codes, new_scales, bits, block).view(-1))
        _store(codes, scales, new_codes, new_scales)

    def _rotate(self, x: Tensor, block: int) -> Tensor:
        return hadamard_blocks(x, block)
