"""The GPU path on one CUDA/ROCm device: Triton kernels on device tensors, and training end to end.

Marked `gpu` and skipped when torch sees no GPU, so the default suite stays CPU-only;
`tools/gpu_check.sh` runs them with `pytest -m gpu tests/test_gpu.py`.
"""
from __future__ import annotations

import math

import pytest
import torch

from conftest import run_deepy, tiny_run_config, train_losses

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA/ROCm GPU visible to torch"),
]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8).cpu()


@pytest.mark.parametrize("block", [64, 2048])
@pytest.mark.parametrize("bits", [8, 4])
def test_triton_matches_reference_on_device(bits, block):
    pytest.importorskip("triton")
    from megatron.ops.quant import get_quantizer
    from megatron.ops.quant.reference import ReferenceQuantizer
    triton_q = get_quantizer("triton", "cuda")
    assert triton_q.name == "triton", "triton is installed but its kernels fell back to the reference"
    reference = ReferenceQuantizer()
    gen = torch.Generator().manual_seed(bits * 10_000 + block)
    n = 16 * block * 8  # 128 blocks, a multiple of every chunk count used below
    # scaled per element across 2^0..2^8, so blocks differ in their scale
    x = (torch.randn(n, generator=gen) * torch.rand(n, generator=gen).mul(8).exp2()).cuda()

    codes, scales = triton_q.quantize(x, bits, block)
    ref_codes, ref_scales = reference.quantize(x, bits, block)
    assert codes.is_cuda and scales.is_cuda
    assert torch.equal(_bytes(codes), _bytes(ref_codes))
    assert torch.equal(_bytes(scales), _bytes(ref_scales))
    for dtype in (torch.float32, torch.bfloat16):
        got = triton_q.dequantize(ref_codes, ref_scales, bits, block, dtype=dtype)
        want = reference.dequantize(ref_codes, ref_scales, bits, block, dtype=dtype)
        assert got.dtype == want.dtype and torch.equal(_bytes(got), _bytes(want))
    got = triton_q.reduce_requantize(ref_codes, ref_scales, 4, bits, block)
    want = reference.reduce_requantize(ref_codes, ref_scales, 4, bits, block)
    assert torch.equal(_bytes(got[0]), _bytes(want[0])) and torch.equal(_bytes(got[1]), _bytes(want[1]))


def _train(tmp_path, corpus, **overrides) -> dict[int, float]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = tiny_run_config(tmp_path, corpus, **overrides)
    result = run_deepy("train.py", str(cfg), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return train_losses(tmp_path / "logs")


def test_bf16_training_on_gpu_loss_is_finite_and_falls(tmp_path, tiny_corpus):
    losses = _train(tmp_path, tiny_corpus, device="cuda", bf16={"enabled": True}, train_iters=20,
                    log_interval=5, eval_interval=20, eval_iters=1)
    assert sorted(losses) == [1, 5, 10, 15, 20]
    assert all(math.isfinite(v) for v in losses.values()), losses
    # fp32 on CPU falls 6.2 -> 4.5 over these 20 steps; bf16 must show at least half of that
    assert losses[20] < losses[1] - 0.8, losses


def test_fp32_first_step_loss_on_gpu_matches_cpu(tmp_path, tiny_corpus):
    # The model is initialised on the CPU under the seed and then moved, so step 1 (logged before
    # any update takes effect) sees the same weights and batch on both devices.
    one_step = dict(bf16={"enabled": False}, train_iters=1, log_interval=1, eval_interval=1,
                    eval_iters=1)
    on_gpu = _train(tmp_path / "cuda", tiny_corpus, device="cuda", **one_step)[1]
    on_cpu = _train(tmp_path / "cpu", tiny_corpus, device="cpu", **one_step)[1]
    assert math.isfinite(on_gpu)
    assert on_gpu == pytest.approx(on_cpu, rel=1e-3)
