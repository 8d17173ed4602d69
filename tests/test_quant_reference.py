"""The torch reference (the oracle) against hand computations and an independent numpy formula."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron.ops.quant import QuantizationError, codes_numel, get_quantizer, padded_numel, qmax
from megatron.ops.quant.reference import ReferenceQuantizer, pack_int4, unpack_int4
from megatron.ops.quant.selfcheck import CASES, check_case

REF = ReferenceQuantizer()


def numpy_quantize(x: np.ndarray, bits: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """The format's rule written independently in numpy float32 (unpacked int codes)."""
    limit = np.float32(qmax(bits))
    blocks = x.astype(np.float32).reshape(-1, block)
    scales = np.abs(blocks).max(axis=1) / limit
    scales[scales == 0] = 1
    codes = np.clip(np.rint(blocks / scales[:, None]), -limit, limit).astype(np.int8)
    return codes.reshape(-1), scales.astype(np.float32)


def unpacked(codes: torch.Tensor, bits: int) -> torch.Tensor:
    return codes if bits == 8 else unpack_int4(codes)


@pytest.mark.parametrize("bits", [8, 4])
def test_reference_equals_independent_numpy_formula(bits):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64 * 50, generator=gen) * torch.logspace(-20, 20, 64 * 50)
    x[::7] = torch.round(x[::7])                       # some exact integers and ties
    codes, scales = REF.quantize(x, bits, 64)
    want_codes, want_scales = numpy_quantize(x.numpy(), bits, 64)
    assert np.array_equal(scales.numpy().view(np.uint32), want_scales.view(np.uint32))
    assert np.array_equal(unpacked(codes, bits).numpy(), want_codes)


def test_int8_hand_example():
    # amax 2 -> scale 2/127; x/scale = 63.5 (tie -> 64), -31.75, 15.875, 127
    x = torch.tensor([1.0, -0.5, 0.25, 2.0])
    codes, scales = REF.quantize(x, 8, 4)
    assert scales.item() == np.float32(2.0) / np.float32(127.0)
    assert codes.tolist() == [64, -32, 16, 127]
    assert codes.dtype == torch.int8 and scales.dtype == torch.float32


@pytest.mark.parametrize("bits", [8, 4])
def test_ties_round_half_to_even(bits):
    limit = qmax(bits)
    # amax = qmax -> scale exactly 1, so x / scale is exactly the half-integers below
    x = torch.tensor([float(limit), 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5])
    codes, scales = REF.quantize(x, bits, 8)
    assert scales.tolist() == [1.0]
    assert unpacked(codes, bits).tolist() == [limit, 0, 2, 2, 0, -2, -2, 4]


@pytest.mark.parametrize("bits", [8, 4])
def test_zero_block_has_scale_one(bits):
    x = torch.zeros(16)
    x[8:] = torch.arange(1.0, 9.0)
    codes, scales = REF.quantize(x, bits, 8)
    assert scales[0].item() == 1.0
    assert unpacked(codes, bits)[:8].tolist() == [0] * 8
    assert REF.dequantize(codes, scales, bits, 8)[:8].tolist() == [0.0] * 8


@pytest.mark.parametrize("bits", [8, 4])
def test_constant_blocks_hit_qmax(bits):
    x = torch.tensor([3.0] * 4 + [-0.1] * 4)
    codes, scales = REF.quantize(x, bits, 4)
    limit = qmax(bits)
    assert unpacked(codes, bits).tolist() == [limit] * 4 + [-limit] * 4
    assert scales.tolist() == [np.float32(3.0) / np.float32(limit),
                               np.float32(0.1) / np.float32(limit)]


def test_underflowing_scale_becomes_one():
    x = torch.tensor([2.0 ** -149, -2.0 ** -149])       # amax / 127 rounds to 0
    codes, scales = REF.quantize(x, 8, 2)
    assert scales.tolist() == [1.0] and codes.tolist() == [0, 0]


def test_int4_nibble_order_even_index_low():
    # scale 1: codes 1, -1, 7, -7 -> bytes 0xF1 (low 1, high -1) and 0x97 (low 7, high -7)
    x = torch.tensor([1.0, -1.0, 7.0, -7.0])
    codes, _ = REF.quantize(x, 4, 4)
    assert codes.dtype == torch.uint8
    assert codes.tolist() == [0xF1, 0x97]


def test_int4_pack_unpack_round_trip_every_byte():
    every_byte = torch.arange(256, dtype=torch.int16).to(torch.uint8)
    values = unpack_int4(every_byte)
    assert values.min().item() == -8 and values.max().item() == 7
    assert torch.equal(pack_int4(values), every_byte)
    assert values[0::2].tolist()[:3] == [0, 1, 2]      # low nibble of bytes 0, 1, 2


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_error_at_most_half_a_step(bits, dtype):
    gen = torch.Generator().manual_seed(bits)
    block = 128
    magnitudes = torch.logspace(-4, 4, 40).repeat_interleave(block)
    x = (torch.randn(40 * block, generator=gen) * magnitudes).to(dtype)
    codes, scales = REF.quantize(x, bits, block)
    y = REF.dequantize(codes, scales, bits, block).double()
    err = (y - x.double()).abs().view(-1, block)
    half_step = scales.double()[:, None] / 2
    # half a step, up to fp32 rounding of x / scale and code * scale (|code| <= 127: < 2^-15 step)
    assert torch.all(err <= half_step * (1 + 2.0 ** -14))
    assert torch.all(err.amax(dim=1) > 0)              # the bound is not met by luck of zero error


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_input_is_upcast_exactly(dtype):
    x = torch.randn(256, generator=torch.Generator().manual_seed(3)).to(dtype)
    for bits in (8, 4):
        got = REF.quantize(x, bits, 64)
        want = REF.quantize(x.float(), bits, 64)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_dequantize_dtype_and_unpadding():
    x = torch.randn(128, generator=torch.Generator().manual_seed(4))
    codes, scales = REF.quantize(x, 8, 32)
    y = REF.dequantize(codes, scales, 8, 32, numel=100, dtype=torch.bfloat16)
    full = REF.dequantize(codes, scales, 8, 32)
    assert y.dtype == torch.bfloat16 and y.numel() == 100
    assert torch.equal(y, full[:100].to(torch.bfloat16))


@pytest.mark.parametrize("bits", [8, 4])
def test_reduce_requantize_is_sum_then_quantize(bits):
    gen = torch.Generator().manual_seed(5)
    k, n, block = 4, 256, 32
    parts = [torch.randn(n, generator=gen) * (j + 1) for j in range(k)]
    encoded = [REF.quantize(p, bits, block) for p in parts]
    codes_k = torch.cat([c for c, _ in encoded])
    scales_k = torch.cat([s for _, s in encoded])
    total = torch.zeros(n)
    for codes, scales in encoded:                       # chunk 0 first, fp32
        total = total + REF.dequantize(codes, scales, bits, block)
    assert torch.equal(REF.dequantize_sum(codes_k, scales_k, k, bits, block), total)
    fused = REF.reduce_requantize(codes_k, scales_k, k, bits, block)
    want = REF.quantize(total, bits, block)
    assert torch.equal(fused[0], want[0]) and torch.equal(fused[1], want[1])
    # and the sum is within k half-steps of the true sum of the inputs
    bound = torch.stack([s for _, s in encoded]).sum(0).repeat_interleave(block) / 2
    assert torch.all((total - sum(parts)).abs() <= bound * (1 + 2.0 ** -12))


@pytest.mark.parametrize("bits", [8, 4])
def test_fused_residual_equals_unfused_error_feedback(bits):
    from quant_oracles import ErrorFeedback  # the unfused oracle (tests/quant_oracles.py)
    gen = torch.Generator().manual_seed(6)
    k, n, block = 3, 192, 64
    encoded = [REF.quantize(torch.randn(n, generator=gen), bits, block) for _ in range(k)]
    codes_k = torch.cat([c for c, _ in encoded])
    scales_k = torch.cat([s for _, s in encoded])
    residual = 0.05 * torch.randn(n, generator=gen)
    unfused = ErrorFeedback()
    unfused.residual = residual.clone()
    x_in = unfused.compensate(REF.dequantize_sum(codes_k, scales_k, k, bits, block))
    want = REF.quantize(x_in, bits, block)
    unfused.update(x_in, REF.dequantize(*want, bits, block))
    got = REF.reduce_requantize(codes_k, scales_k, k, bits, block, residual=residual)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(residual, unfused.residual)


def test_padded_numel():
    assert padded_numel(0, 64) == 0
    assert padded_numel(1, 64) == 64
    assert padded_numel(777, 96, 3) == 864
    assert padded_numel(864, 96, 3) == 864
    for n in (1, 100, 1000, 4097):
        for block, multiple in ((64, 1), (48, 8), (2, 3)):
            m = padded_numel(n, block, multiple)
            assert m >= n and m % (block * multiple) == 0 and m - n < block * multiple
    with pytest.raises(QuantizationError):
        padded_numel(10, 0)


def test_codes_numel():
    assert codes_numel(128, 8) == 128 and codes_numel(128, 4) == 64


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_non_finite_input_is_refused(bad, dtype):
    x = torch.ones(96, dtype=dtype)
    x[70] = bad
    with pytest.raises(QuantizationError, match=r"NaN or inf in block 2 \(elements 64\.\.95\)"):
        REF.quantize(x, 8, 32)


def test_overflowing_reduction_is_refused():
    codes, scales = REF.quantize(torch.full((4,), 3e38), 8, 4)
    with pytest.raises(QuantizationError, match="reduce_requantize: NaN or inf"):
        REF.reduce_requantize(torch.cat([codes, codes]), torch.cat([scales, scales]), 2, 8, 4)


@pytest.mark.parametrize("call, message", [
    (lambda: REF.quantize(torch.ones(100), 8, 64), "not a multiple of block=64"),
    (lambda: REF.quantize(torch.ones(64), 3, 64), "bits must be 8 or 4"),
    (lambda: REF.quantize(torch.ones(64), 8, 0), "block must be a positive int"),
    (lambda: REF.quantize(torch.ones(66), 4, 33), "block must be even"),
    (lambda: REF.quantize(torch.ones(8, 8), 8, 8), "contiguous 1-D"),
    (lambda: REF.quantize(torch.ones(64, dtype=torch.int32), 8, 8), "float32, bfloat16 or float16"),
    (lambda: REF.dequantize(torch.zeros(8, dtype=torch.uint8), torch.ones(1), 8, 8), "torch.int8"),
    (lambda: REF.dequantize(torch.zeros(8, dtype=torch.int8), torch.ones(2), 8, 8), "whole blocks"),
    (lambda: REF.dequantize(torch.zeros(8, dtype=torch.int8), torch.ones(1), 8, 8, numel=9),
     "numel=9"),
    (lambda: REF.reduce_requantize(torch.zeros(24, dtype=torch.int8), torch.ones(3), 2, 8, 8),
     "k=2"),
    (lambda: REF.reduce_requantize(torch.zeros(16, dtype=torch.int8), torch.ones(2), 2, 8, 8,
                                   residual=torch.zeros(16)), "residual must be float32 with 8"),
    (lambda: REF.reduce_requantize(torch.zeros(16, dtype=torch.int8), torch.ones(2), 2, 8, 8,
                                   residual=torch.zeros(8, dtype=torch.float64)), "residual"),
    (lambda: get_quantizer("cuda-magic"), "must be one of"),
])
def test_misuse_gives_a_clear_error(call, message):
    with pytest.raises(QuantizationError, match=message):
        call()


class _RoundHalfAway(ReferenceQuantizer):
    """A plausible wrong implementation: rounds ties away from zero."""

    def _quantize(self, x, bits, block, codes, scales):
        super()._quantize(x, bits, block, codes, scales)
        blocks = x.float().view(-1, block) / scales.reshape(-1)[:, None]
        away = (blocks.sign() * (blocks.abs() + 0.5).floor()).clamp(-qmax(bits), qmax(bits))
        away = away.to(torch.int8).view(-1)
        codes.copy_((away if bits == 8 else pack_int4(away)).view(codes.shape))


def test_selfcheck_catches_a_wrong_implementation():
    ties = next(c for c in CASES if c.name == "ties")
    problems = check_case(_RoundHalfAway(), ties, 8, torch.device("cpu"))
    assert any(p.startswith("quantize codes: differs") for p in problems)
    assert check_case(ReferenceQuantizer(), ties, 8, torch.device("cpu")) == []


class _SanitisingReduce(ReferenceQuantizer):
    """A plausible wrong implementation: the fused reduction zeroes a NaN/inf sum before encoding,
    so an overflow would vanish in a hop instead of reaching the global norm."""

    def _reduce_requantize(self, codes_k, scales_k, bits, block, residual, codes, scales):
        super()._reduce_requantize(codes_k, scales_k, bits, block, residual, codes, scales)
        if torch.isfinite(scales).all():
            return
        total = torch.nan_to_num(self._sum(codes_k, scales_k, bits, block), nan=0.0, posinf=0.0, neginf=0.0)
        self._quantize(total, bits, block, codes, scales)


def test_selfcheck_catches_a_reduction_that_hides_an_overflow():
    """The engine calls the kernels unchecked (no host sync) and relies on a NaN/inf block's scale to
    carry it on; the self-check runs that path through quantize and through the fused reduction."""
    case = next(c for c in CASES if c.name == "random_fp32")
    problems = check_case(_SanitisingReduce(), case, 4, torch.device("cpu"))
    assert problems == ["reduce_requantize(check_finite=False) with nan: its block decodes to finite values"]
    assert check_case(ReferenceQuantizer(), case, 4, torch.device("cpu")) == []
