"""Triton kernels for GPUs, vendor-neutral (CUDA and ROCm): one program per block.

Only portable Triton is used: `tl.math.div_rn` for IEEE division, integer max over the raw bits of
|x| for the block amax (a float max may drop NaN on GPUs), round half to even by adding and
subtracting 1.5 * 2^23 (no vendor libdevice `rint`), and fp fusion disabled at launch so the
k-chunk sum multiplies and adds separately, as the reference does. Results equal the torch
reference bit for bit. Encoded data is read and written in place as rows at any stride (base.py),
e.g. the engine's messages: no copy packs or unpacks it.

On CPU these kernels run only under the Triton interpreter (`TRITON_INTERPRET=1`, set before
triton is imported), which the tests use with small grids.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
from torch import Tensor

import triton
import triton.language as tl

from .base import Quantizer, QuantizationError, qmax, rotation_scale

ROUND_MAGIC: tl.constexpr = tl.constexpr(12582912.0)  # 1.5 * 2^23

# log2 of the chunks the reduce kernels' runtime loop over K adds per iteration (their loads in flight
# at once): 8 takes a node's GPUs (8 GCDs on Frontier, 8 GPUs on an H100/H200 node) in one iteration,
# as the loop unrolled over all K did. The code size is bounded by it, not by K.
REDUCE_UNROLL_LOG2 = 3


@triton.jit
def _block_scale(abs_bits, QMAX: tl.constexpr):
    """Scale of one block from the raw bits of |x| (masked lanes hold 0): amax / qmax, 0 -> 1."""
    amax = tl.max(abs_bits, axis=0).to(tl.float32, bitcast=True)
    scale = tl.math.div_rn(amax, QMAX)
    return tl.where(scale == 0.0, 1.0, scale)


@triton.jit
def _encode(x, scale, QMAX: tl.constexpr):
    """clamp(round_half_even(x / scale), -qmax, qmax) as int32."""
    v = tl.math.div_rn(x, scale)
    v = (v + ROUND_MAGIC) - ROUND_MAGIC
    v = tl.minimum(tl.maximum(v, -QMAX), QMAX)
    return v.to(tl.int32)


@triton.jit
def _nibble(byte):
    """Sign-extend a 4-bit two's complement value held in an int32."""
    return byte - ((byte & 8) << 1)


@triton.jit
def _to_output(v, out_ptr):
    """Cast fp32 values to the output element type, rounding to nearest even.

    bf16 is rounded with integer ops (what the GPU's conversion does) so that the result is the
    same under the CPU interpreter, whose own fp32 -> bf16 cast truncates; NaN becomes 0x7FC0 as in
    torch.
    """
    if out_ptr.dtype.element_ty == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(v != v, 0x7FC0, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return v.to(out_ptr.dtype.element_ty)


# Encoded blocks are addressed through rows (base.py, "implementation hooks"): a pointer, the
# stride between rows (bytes for codes, floats for scales) and the blocks per row, so the kernels
# read and write the engine's messages in place. Offsets are int64 (from the program id): a
# message buffer can exceed 2^31 bytes.

@triton.jit
def _row_offset(i, per_row, row_stride, step):
    """Offset of block i (int64) of rows of per_row blocks: row i // per_row, row_stride apart;
    within it block i % per_row, step apart (the block's bytes for codes, 1 for scales)."""
    return (i // per_row) * row_stride + (i % per_row) * step


@triton.jit
def _quantize8_kernel(x_ptr, codes_ptr, code_stride, scales_ptr, scale_stride, per_row, block,
                      QMAX: tl.constexpr, SPAN: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, SPAN)
    mask = offs < block
    x = tl.load(x_ptr + b * block + offs, mask=mask, other=0.0).to(tl.float32)
    scale = _block_scale(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, QMAX)
    tl.store(scales_ptr + _row_offset(b, per_row, scale_stride, 1), scale)
    tl.store(codes_ptr + _row_offset(b, per_row, code_stride, block) + offs,
             _encode(x, scale, QMAX).to(tl.int8), mask=mask)


@triton.jit
def _pairs(v, HALF_SPAN: tl.constexpr):
    """Split [2 * HALF_SPAN] values into the even (low nibble) and odd (high nibble) elements."""
    return tl.split(tl.reshape(v, [HALF_SPAN, 2]))


@triton.jit
def _interleave(lo, hi, HALF_SPAN: tl.constexpr):
    """The inverse of _pairs: lo[i], hi[i] at 2i, 2i + 1."""
    return tl.reshape(tl.join(lo, hi), [2 * HALF_SPAN])


# The INT4 kernels read and write the fp32 side contiguously and split it into pairs in registers
# (_pairs / _interleave): two loads at stride 2 cannot be vectorised, one contiguous load can.
# STRIDED (StridedInt4Quantizer, a benchmark's baseline only) makes the two stride-2 accesses
# instead, as before 145ef0a, so the device can time the one against the other; same bits.

@triton.jit
def _load_pairs(ptr, block, HALF_SPAN: tl.constexpr, STRIDED: tl.constexpr):
    """The even and odd fp32 elements of a block (zeros past its end)."""
    if STRIDED:
        pairs = tl.arange(0, HALF_SPAN)
        mask = pairs < block // 2
        lo = tl.load(ptr + 2 * pairs, mask=mask, other=0.0).to(tl.float32)
        hi = tl.load(ptr + 2 * pairs + 1, mask=mask, other=0.0).to(tl.float32)
    else:
        offs = tl.arange(0, 2 * HALF_SPAN)
        lo, hi = _pairs(tl.load(ptr + offs, mask=offs < block, other=0.0).to(tl.float32), HALF_SPAN)
    return lo, hi


@triton.jit
def _store_pairs(ptr, lo, hi, block, HALF_SPAN: tl.constexpr, STRIDED: tl.constexpr):
    """The inverse of _load_pairs (values already in the output's dtype)."""
    if STRIDED:
        pairs = tl.arange(0, HALF_SPAN)
        mask = pairs < block // 2
        tl.store(ptr + 2 * pairs, lo, mask=mask)
        tl.store(ptr + 2 * pairs + 1, hi, mask=mask)
    else:
        offs = tl.arange(0, 2 * HALF_SPAN)
        tl.store(ptr + offs, _interleave(lo, hi, HALF_SPAN), mask=offs < block)


@triton.jit
def _quantize4_kernel(x_ptr, codes_ptr, code_stride, scales_ptr, scale_stride, per_row, block,
                      QMAX: tl.constexpr, HALF_SPAN: tl.constexpr, STRIDED: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    x_lo, x_hi = _load_pairs(x_ptr + b * block, block, HALF_SPAN, STRIDED)
    scale = _block_scale(tl.maximum(x_lo.to(tl.int32, bitcast=True) & 0x7FFFFFFF,
                                    x_hi.to(tl.int32, bitcast=True) & 0x7FFFFFFF), QMAX)
    tl.store(scales_ptr + _row_offset(b, per_row, scale_stride, 1), scale)
    lo = _encode(x_lo, scale, QMAX) & 0xF
    hi = _encode(x_hi, scale, QMAX) & 0xF
    pairs = tl.arange(0, HALF_SPAN)
    tl.store(codes_ptr + _row_offset(b, per_row, code_stride, block // 2) + pairs,
             (lo | (hi << 4)).to(tl.uint8), mask=pairs < block // 2)


@triton.jit
def _dequantize8_kernel(codes_ptr, code_stride, scales_ptr, scale_stride, per_row, out_ptr, block,
                        SPAN: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, SPAN)
    mask = offs < block
    scale = tl.load(scales_ptr + _row_offset(b, per_row, scale_stride, 1))
    codes = tl.load(codes_ptr + _row_offset(b, per_row, code_stride, block) + offs, mask=mask,
                    other=0).to(tl.float32)
    out = codes * scale
    tl.store(out_ptr + b * block + offs, _to_output(out, out_ptr), mask=mask)


@triton.jit
def _dequantize4_kernel(codes_ptr, code_stride, scales_ptr, scale_stride, per_row, out_ptr, block,
                        HALF_SPAN: tl.constexpr, STRIDED: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    pairs = tl.arange(0, HALF_SPAN)
    scale = tl.load(scales_ptr + _row_offset(b, per_row, scale_stride, 1))
    byte = tl.load(codes_ptr + _row_offset(b, per_row, code_stride, block // 2) + pairs,
                   mask=pairs < block // 2, other=0).to(tl.int32)
    lo = _nibble(byte & 0xF).to(tl.float32) * scale
    hi = _nibble(byte >> 4).to(tl.float32) * scale
    _store_pairs(out_ptr + b * block, _to_output(lo, out_ptr), _to_output(hi, out_ptr), block, HALF_SPAN, STRIDED)


# The reduce kernels: program b sums block b of the K input rows (chunks), row j's at
# codes_b + j * code_stride and scales_b + j * scale_stride, codes_b and scales_b being block b of
# row 0; the result goes to block b of the output rows (their own stride and blocks per row).

@triton.jit
def _add_chunks8(acc, codes_b, code_stride, scales_b, scale_stride, first, offs, mask, N: tl.constexpr):
    """acc plus block b of INT8 chunks first .. first + N - 1, one chunk at a time in chunk order;
    unrolled, so the N chunks' loads are in flight at once."""
    for u in tl.static_range(N):
        j = tl.cast(first + u, tl.int64)  # j * code_stride can pass 2^31 (K messages of 16M codes)
        scale_j = tl.load(scales_b + j * scale_stride)
        codes = tl.load(codes_b + j * code_stride + offs, mask=mask, other=0)
        acc = acc + codes.to(tl.float32) * scale_j
    return acc


@triton.jit(do_not_specialize=["K"])
def _reduce8_kernel(codes_ptr, code_stride, scales_ptr, scale_stride,
                    out_codes_ptr, out_code_stride, out_scales_ptr, out_scale_stride, out_per_row,
                    out_sum_ptr, res_ptr, block, K, QMAX: tl.constexpr, SPAN: tl.constexpr,
                    REQUANTIZE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, UNROLL_LOG2: tl.constexpr):
    """Sum block b of the K INT8 chunks in fp32 (chunk 0 first); requantize or store the sum.

    K is a runtime argument, not specialised on: one compiled kernel serves every group size. A loop
    unrolled over a compile-time K grew with K and took 117 s to compile for an MI250X (gfx90a, on
    a 2-core VM) at K = 384, a quantized hop over 48 Frontier nodes, inside the first backward.
    The runtime loop adds 2^UNROLL_LOG2 chunks per iteration, unrolled, so their loads are in
    flight at once (one chunk per iteration serialised them: 133 GB/s at K = 8 on an H200); the
    K mod 2^UNROLL_LOG2 chunks left follow in groups of halving size, each taken or skipped whole.
    Every chunk is added on its own, in chunk order, exactly as in the reference.

    With HAS_RESIDUAL (requantize only): quantize sum + residual and store the loss as residual.
    """
    UNROLL: tl.constexpr = 1 << UNROLL_LOG2
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, SPAN)
    mask = offs < block
    codes_b = codes_ptr + b * block
    scales_b = scales_ptr + b
    acc = tl.zeros([SPAN], dtype=tl.float32)
    whole = K - K % UNROLL
    for first in range(0, whole, UNROLL):
        acc = _add_chunks8(acc, codes_b, code_stride, scales_b, scale_stride, first, offs, mask, UNROLL)
    first = whole
    for halving in tl.static_range(1, UNROLL_LOG2 + 1):  # the rest: UNROLL / 2, UNROLL / 4, ..., 1
        if K - first >= UNROLL >> halving:
            acc = _add_chunks8(acc, codes_b, code_stride, scales_b, scale_stride, first, offs, mask,
                               UNROLL >> halving)
            first += UNROLL >> halving
    if REQUANTIZE:
        if HAS_RESIDUAL:
            acc = acc + tl.load(res_ptr + b * block + offs, mask=mask, other=0.0)
        scale = _block_scale(acc.to(tl.int32, bitcast=True) & 0x7FFFFFFF, QMAX)
        tl.store(out_scales_ptr + _row_offset(b, out_per_row, out_scale_stride, 1), scale)
        codes = _encode(acc, scale, QMAX)
        tl.store(out_codes_ptr + _row_offset(b, out_per_row, out_code_stride, block) + offs,
                 codes.to(tl.int8), mask=mask)
        if HAS_RESIDUAL:
            tl.store(res_ptr + b * block + offs, acc - codes.to(tl.float32) * scale, mask=mask)
    else:
        tl.store(out_sum_ptr + b * block + offs, acc, mask=mask)


@triton.jit
def _add_chunks4(acc_lo, acc_hi, codes_b, code_stride, scales_b, scale_stride, first, pairs, mask,
                 N: tl.constexpr):
    """_add_chunks8 for packed INT4 chunks, their even and odd elements summed apart."""
    for u in tl.static_range(N):
        j = tl.cast(first + u, tl.int64)
        scale_j = tl.load(scales_b + j * scale_stride)
        byte = tl.load(codes_b + j * code_stride + pairs, mask=mask, other=0).to(tl.int32)
        acc_lo = acc_lo + _nibble(byte & 0xF).to(tl.float32) * scale_j
        acc_hi = acc_hi + _nibble(byte >> 4).to(tl.float32) * scale_j
    return acc_lo, acc_hi


@triton.jit(do_not_specialize=["K"])
def _reduce4_kernel(codes_ptr, code_stride, scales_ptr, scale_stride,
                    out_codes_ptr, out_code_stride, out_scales_ptr, out_scale_stride, out_per_row,
                    out_sum_ptr, res_ptr, block, K, QMAX: tl.constexpr, HALF_SPAN: tl.constexpr,
                    REQUANTIZE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, UNROLL_LOG2: tl.constexpr,
                    STRIDED: tl.constexpr):
    """Sum block b of the K packed INT4 chunks in fp32 (chunk 0 first); requantize or store (the
    loop over K: as _reduce8_kernel's; unrolled over a compile-time K, this one took 339 s to
    compile at K = 384).

    With HAS_RESIDUAL (requantize only): quantize sum + residual and store the loss as residual.
    """
    UNROLL: tl.constexpr = 1 << UNROLL_LOG2
    b = tl.program_id(0).to(tl.int64)
    pairs = tl.arange(0, HALF_SPAN)
    mask = pairs < block // 2
    codes_b = codes_ptr + b * (block // 2)
    scales_b = scales_ptr + b
    acc_lo = tl.zeros([HALF_SPAN], dtype=tl.float32)
    acc_hi = tl.zeros([HALF_SPAN], dtype=tl.float32)
    whole = K - K % UNROLL
    for first in range(0, whole, UNROLL):
        acc_lo, acc_hi = _add_chunks4(acc_lo, acc_hi, codes_b, code_stride, scales_b, scale_stride,
                                      first, pairs, mask, UNROLL)
    first = whole
    for halving in tl.static_range(1, UNROLL_LOG2 + 1):  # the rest: UNROLL / 2, UNROLL / 4, ..., 1
        if K - first >= UNROLL >> halving:
            acc_lo, acc_hi = _add_chunks4(acc_lo, acc_hi, codes_b, code_stride, scales_b, scale_stride,
                                          first, pairs, mask, UNROLL >> halving)
            first += UNROLL >> halving
    if REQUANTIZE:
        res = res_ptr + b * block
        if HAS_RESIDUAL:
            res_lo, res_hi = _load_pairs(res, block, HALF_SPAN, STRIDED)
            acc_lo = acc_lo + res_lo
            acc_hi = acc_hi + res_hi
        bits = tl.maximum(acc_lo.to(tl.int32, bitcast=True) & 0x7FFFFFFF,
                          acc_hi.to(tl.int32, bitcast=True) & 0x7FFFFFFF)
        scale = _block_scale(bits, QMAX)
        tl.store(out_scales_ptr + _row_offset(b, out_per_row, out_scale_stride, 1), scale)
        lo = _encode(acc_lo, scale, QMAX)
        hi = _encode(acc_hi, scale, QMAX)
        packed = (lo & 0xF) | ((hi & 0xF) << 4)
        tl.store(out_codes_ptr + _row_offset(b, out_per_row, out_code_stride, block // 2) + pairs,
                 packed.to(tl.uint8), mask=mask)
        if HAS_RESIDUAL:
            _store_pairs(res, acc_lo - lo.to(tl.float32) * scale, acc_hi - hi.to(tl.float32) * scale, block,
                         HALF_SPAN, STRIDED)
    else:
        _store_pairs(out_sum_ptr + b * block, acc_lo, acc_hi, block, HALF_SPAN, STRIDED)


@triton.jit
def _hadamard_kernel(x_ptr, out_ptr, scale, BLOCK: tl.constexpr, LOG2_BLOCK: tl.constexpr):
    """One block: the butterfly stages in increasing stride ((u, v) -> (u + v, u - v)), each as a
    reshape that puts the two partners of every pair side by side, then the scale (base.py)."""
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    v = tl.load(x_ptr + b * BLOCK + offs)
    for stage in tl.static_range(LOG2_BLOCK):
        half: tl.constexpr = 1 << stage
        pairs = tl.permute(tl.reshape(v, [BLOCK // (2 * half), 2, half]), [0, 2, 1])
        first, second = tl.split(pairs)
        v = tl.reshape(tl.permute(tl.join(first + second, first - second), [0, 2, 1]), [BLOCK])
    tl.store(out_ptr + b * BLOCK + offs, v * scale)


def interpreter_active() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _span(bits: int, block: int) -> int:
    """Power-of-two lane count covering one block (INT4 kernels work on pairs)."""
    return triton.next_power_of_2(block if bits == 8 else block // 2)


class TritonQuantizer(Quantizer):
    """Triton kernels for CUDA/ROCm tensors (CPU tensors only under TRITON_INTERPRET=1)."""

    name = "triton"

    strided_int4 = False  # StridedInt4Quantizer

    def _int4_flags(self, bits: int) -> dict:
        return {"STRIDED": self.strided_int4} if bits == 4 else {}

    def _check_device(self, t: Tensor) -> None:
        if t.device.type != "cuda" and not interpreter_active():
            raise QuantizationError(
                f"the triton quantizer needs a CUDA/ROCm tensor (or TRITON_INTERPRET=1); got {t.device}")

    def _quantize(self, x: Tensor, bits: int, block: int, codes: Tensor, scales: Tensor) -> None:
        self._check_device(x)
        n_blocks = x.numel() // block
        if n_blocks:
            kernel = _quantize8_kernel if bits == 8 else _quantize4_kernel
            kernel[(n_blocks,)](x, codes, codes.stride(0), scales, scales.stride(0), scales.shape[1],
                                block, float(qmax(bits)), _span(bits, block), **self._int4_flags(bits))

    def _dequantize(self, codes: Tensor, scales: Tensor, bits: int, block: int, out: Tensor) -> None:
        self._check_device(codes)
        n_blocks = out.numel() // block
        if n_blocks:
            kernel = _dequantize8_kernel if bits == 8 else _dequantize4_kernel
            kernel[(n_blocks,)](codes, codes.stride(0), scales, scales.stride(0), scales.shape[1], out,
                                block, _span(bits, block), **self._int4_flags(bits))

    def _reduce(self, codes_k: Tensor, scales_k: Tensor, bits: int, block: int, requantize: bool,
                codes: Tensor, scales: Tensor, total: Tensor, residual: Optional[Tensor] = None) -> None:
        """Sum the rows of codes_k/scales_k: requantized into the rows codes/scales, or into the flat
        fp32 total. The other mode's outputs are not touched (any valid tensors)."""
        self._check_device(codes_k)
        n_blocks = scales_k.shape[1]
        if n_blocks:
            kernel = _reduce8_kernel if bits == 8 else _reduce4_kernel
            res = residual if residual is not None else total  # unused without a residual
            kernel[(n_blocks,)](codes_k, codes_k.stride(0), scales_k, scales_k.stride(0),
                                codes, codes.stride(0), scales, scales.stride(0), scales.shape[1],
                                total, res, block, codes_k.shape[0], float(qmax(bits)), _span(bits, block),
                                requantize, residual is not None, REDUCE_UNROLL_LOG2, enable_fp_fusion=False,
                                **self._int4_flags(bits))

    def _reduce_requantize(self, codes_k: Tensor, scales_k: Tensor, bits: int, block: int,
                           residual: Optional[Tensor], codes: Tensor, scales: Tensor) -> None:
        self._reduce(codes_k, scales_k, bits, block, True, codes, scales, scales, residual)

    def _dequantize_sum(self, codes_k: Tensor, scales_k: Tensor, bits: int, block: int,
                        out: Tensor) -> None:
        unused = out.view(1, -1)  # as the output rows, which this mode does not write
        self._reduce(codes_k, scales_k, bits, block, False, unused, unused, out)

    def _rotate(self, x: Tensor, block: int) -> Tensor:
        self._check_device(x)
        out = torch.empty_like(x)
        n_blocks = x.numel() // block
        if n_blocks:
            _hadamard_kernel[(n_blocks,)](x, out, rotation_scale(block), block, block.bit_length() - 1)
        return out


class StridedInt4Quantizer(TritonQuantizer):
    """The INT4 kernels with their fp32 side read and written at stride 2 (two accesses per pair), as
    before 145ef0a: not an implementation to train with, the baseline bench/quant_kernels.py times
    the in-register split against on a device (``--impls triton,triton_strided4``). Same bits."""

    name = "triton_strided4"
    strided_int4 = True
