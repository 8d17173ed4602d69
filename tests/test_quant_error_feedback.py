"""Error feedback: the accumulated quantization error stays bounded with it and grows without it."""
from __future__ import annotations

import pytest
import torch

from megatron.ops.quant import QuantizationError
from megatron.ops.quant.reference import ReferenceQuantizer
from quant_oracles import ErrorFeedback

REF = ReferenceQuantizer()
BITS, BLOCK, STEPS = 4, 64, 200


def gradients(steps: int, n: int) -> list[torch.Tensor]:
    """A persistent gradient plus small noise: the regime where rounding bias accumulates."""
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(n, generator=gen)
    return [base + 0.01 * torch.randn(n, generator=gen) for _ in range(steps)]


def accumulated_error(use_feedback: bool) -> tuple[torch.Tensor, float]:
    """max_t |sum_{s<=t} (q_s - g_s)| per element, and the largest half-step seen."""
    feedback = ErrorFeedback()
    total = torch.zeros(BLOCK * 8, dtype=torch.float64)
    worst = torch.zeros_like(total)
    half_step = 0.0
    for g in gradients(STEPS, BLOCK * 8):
        x_in = feedback.compensate(g) if use_feedback else g
        codes, scales = REF.quantize(x_in, BITS, BLOCK)
        q = REF.dequantize(codes, scales, BITS, BLOCK)
        if use_feedback:
            feedback.update(x_in, q)
        half_step = max(half_step, float(scales.max()) / 2)
        total += q.double() - g.double()
        worst = torch.maximum(worst, total.abs())
    return worst, half_step


def test_with_feedback_the_accumulated_error_stays_within_half_a_step():
    worst, half_step = accumulated_error(use_feedback=True)
    # sum_t (q_t - g_t) = -(last residual), and a residual is at most half a step
    assert float(worst.max()) <= half_step * (1 + 1e-4)


def test_without_feedback_the_accumulated_error_grows():
    worst, half_step = accumulated_error(use_feedback=False)
    assert float(worst.max()) > 20 * half_step
    with_feedback, _ = accumulated_error(use_feedback=True)
    assert float(worst.mean()) > 20 * float(with_feedback.mean())


@pytest.mark.parametrize("use_feedback, bounded", [(True, True), (False, False)])
def test_reduction_hop_with_feedback_stays_bounded(use_feedback, bounded):
    """A second hop: k peers' INT4 chunks summed and requantized by the fused kernel."""
    k, n = 4, BLOCK * 4
    feedback = ErrorFeedback()
    total = torch.zeros(n, dtype=torch.float64)
    worst, half_step = 0.0, 0.0
    for g in gradients(100, k * n):
        codes_k, scales_k = REF.quantize(g, BITS, BLOCK)          # what the k peers sent
        exact = REF.dequantize_sum(codes_k, scales_k, k, BITS, BLOCK)
        if use_feedback:
            codes, scales = feedback.reduce_requantize(REF, codes_k, scales_k, k, BITS, BLOCK)
        else:
            codes, scales = REF.reduce_requantize(codes_k, scales_k, k, BITS, BLOCK)
        half_step = max(half_step, float(scales.max()) / 2)
        total += REF.dequantize(codes, scales, BITS, BLOCK).double() - exact.double()
        worst = max(worst, float(total.abs().max()))
    if bounded:
        assert worst <= half_step * (1 + 1e-4)
    else:
        assert worst > 20 * half_step


def test_compensate_before_any_update_is_the_input_in_fp32():
    x = torch.randn(64).to(torch.bfloat16)
    out = ErrorFeedback().compensate(x)
    assert out.dtype == torch.float32 and torch.equal(out, x.float())


def test_update_keeps_the_residual_and_compensate_adds_it():
    feedback = ErrorFeedback()
    x_in = torch.tensor([1.0, 2.0, 3.0, 4.0])
    feedback.update(x_in, torch.tensor([1.5, 2.0, 2.0, 4.25]))
    assert feedback.residual.tolist() == [-0.5, 0.0, 1.0, -0.25]
    assert feedback.compensate(torch.ones(4)).tolist() == [0.5, 1.0, 2.0, 0.75]


def test_quantize_helper_matches_the_manual_steps():
    x1, x2 = gradients(2, 128)
    helper, manual = ErrorFeedback(), ErrorFeedback()
    for x in (x1, x2):
        got = helper.quantize(REF, x, BITS, BLOCK)
        x_in = manual.compensate(x)
        want = REF.quantize(x_in, BITS, BLOCK)
        manual.update(x_in, REF.dequantize(*want, BITS, BLOCK))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(helper.residual, manual.residual)


def test_state_dict_round_trip_and_reset():
    feedback = ErrorFeedback()
    feedback.update(torch.ones(4), torch.zeros(4))
    restored = ErrorFeedback()
    restored.load_state_dict(feedback.state_dict())
    assert torch.equal(restored.residual, feedback.residual)
    restored.reset()
    assert restored.residual is None


def test_a_residual_of_another_hop_is_refused():
    feedback = ErrorFeedback()
    feedback.update(torch.ones(4), torch.zeros(4))
    with pytest.raises(QuantizationError, match="one ErrorFeedback per hop"):
        feedback.compensate(torch.ones(8))
    with pytest.raises(QuantizationError, match="differ in shape"):
        feedback.update(torch.ones(4), torch.ones(8))
