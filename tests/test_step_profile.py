"""megatron/logging/step_profile.py: where a step's time goes. Self times against torch.profiler's
own, the GPU path on a trace written by hand (no GPU here), names of real kernels by kind."""
from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from dist_harness import run_ranks
from megatron.logging.step_profile import STEP_MARK, breakdown, kind_of, profile_step, read_trace, self_times


def _tiny_step():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.LayerNorm(128),
                              torch.nn.Linear(128, 50))
    opt = torch.optim.AdamW(net.parameters(), fused=True)
    x, y = torch.randn(32, 64), torch.randint(0, 50, (32,))

    def step() -> float:
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return float(loss.detach())
    step()
    return step


def test_self_times_equal_the_profilers_own(tmp_path):
    """An op's self time (its duration less its callees') summed per name, from the exported trace,
    equals torch.profiler's own self_cpu_time_total for every aten op."""
    step = _tiny_step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    path = str(tmp_path / "trace.json")
    prof.export_chrome_trace(path)
    ops = [e for e in read_trace(path) if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    mine = defaultdict(float)
    for event, us in zip(ops, self_times(ops)):
        mine[event["name"]] += us
    theirs = {a.key: a.self_cpu_time_total for a in prof.key_averages() if a.key.startswith("aten::")}
    assert len(theirs) > 10 and "aten::_fused_adamw_" in theirs
    for name, us in theirs.items():
        assert mine[name] == pytest.approx(us, rel=1e-3, abs=0.05 * len([e for e in ops if e["name"] == name])), name


def test_a_step_on_the_host_adds_up(tmp_path):
    """profile_step on a CPU: the kinds add up to the busy time, which is within the step's wall time;
    the fused AdamW, the matmuls, the LayerNorm and the loss each land in their kind; the one host
    read Python asks for is counted; the trace is kept."""
    trace = tmp_path / "step.json.gz"
    result = profile_step(_tiny_step(), torch.device("cpu"), str(trace))
    assert sum(result.by_kind.values()) == pytest.approx(result.busy_ms, abs=1e-3)  # trace times: 1 ns steps
    assert 0 < result.busy_ms <= result.step_ms
    assert result.host_syncs == 1  # float(loss), not the step counts fused AdamW's CPU kernel reads itself
    for kind in ("matmul", "optimizer", "layernorm", "loss", "elementwise"):
        assert result.by_kind[kind] > 0, kind
    assert result.by_kind["attention"] == result.by_kind["compiled"] == 0.0
    assert breakdown(read_trace(str(trace)), on_device=False).as_dict() == result.as_dict()


def _x(cat, name, ts, dur, tid=7):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}


def test_device_trace_by_hand():
    """A trace with the shape Kineto writes for a GPU, figures worked out by hand: kernels on two
    streams (one overlapping another), a memcpy, runtime calls (two syncs, one launch), and kernels
    outside the step that must not count."""
    events = [
        _x("user_annotation", STEP_MARK, 100.0, 1000.0, tid=1),
        _x("gpu_user_annotation", STEP_MARK, 140.0, 1000.0),  # the device's copy of the span: not the step
        _x("kernel", "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_cublas", 150.0, 300.0),
        _x("kernel", "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>", 450.0, 100.0),
        _x("kernel", "triton_poi_fused__to_copy_add_native_layer_norm_0", 500.0, 50.0, tid=8),  # overlaps
        _x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 700.0, 10.0),
        _x("kernel", "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>",
           800.0, 200.0),
        _x("kernel", "sm90_xmma_gemm_before_the_step", 10.0, 50.0),
        _x("kernel", "sm90_xmma_gemm_after_the_step", 1200.0, 50.0),
        _x("cuda_runtime", "cudaLaunchKernel", 120.0, 5.0, tid=1),
        _x("cuda_runtime", "cudaStreamSynchronize", 690.0, 30.0, tid=1),
        _x("cuda_runtime", "cudaMemcpy", 1050.0, 5.0, tid=1),
        _x("cuda_runtime", "cudaDeviceSynchronize", 1150.0, 10.0, tid=1),  # after the step
    ]
    result = breakdown(events, on_device=True)
    assert result.step_ms == pytest.approx(1.0)
    assert result.by_kind["matmul"] == pytest.approx(0.3)
    assert result.by_kind["attention"] == pytest.approx(0.1)
    assert result.by_kind["compiled"] == pytest.approx(0.05)
    assert result.by_kind["elementwise"] == pytest.approx(0.01)
    assert result.by_kind["optimizer"] == pytest.approx(0.2)
    # busy: [150, 550) joined by the overlapping kernel, [700, 710), [800, 1000) = 400 + 10 + 200 us
    assert result.busy_ms == pytest.approx(0.61) and result.idle_ms == pytest.approx(0.39)
    assert result.events == 5 and result.host_syncs == 2
    assert result.top[0][:2] == ["matmul", events[2]["name"]]


def test_exposed_communication_by_hand():
    """A collective on its own stream, half hidden behind compute: busy [0, 220) us, the compute's
    union [0, 100) + [180, 220) = 140 us, so 80 us of communication are exposed; its kind holds all 150."""
    events = [
        _x("user_annotation", STEP_MARK, 0.0, 300.0, tid=1),
        _x("kernel", "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", 0.0, 100.0),
        _x("kernel", "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 50.0, 150.0,
           tid=9),
        _x("kernel", "void at::native::vectorized_layer_norm_kernel<float, float>", 180.0, 40.0),
    ]
    result = breakdown(events, on_device=True)
    assert result.by_kind["communication"] == pytest.approx(0.15)
    assert result.busy_ms == pytest.approx(0.22) and result.exposed_comm_ms == pytest.approx(0.08)


def test_a_wait_inside_a_hook_is_not_compute():
    """A host trace by hand: a gradient hook runs inside the autograd engine's AccumulateGrad wrapper
    for 100 us, of which 10 us are an add and the rest waits for an all-reduce that gloo runs on its
    own thread from 5 to 100 us. The wrapper's own time is not an op's: busy 95 us (the all-reduce's
    span), compute 10, exposed 85, idle 25 of the 120 us step."""
    events = [
        _x("user_annotation", STEP_MARK, 0.0, 120.0, tid=1),
        _x("cpu_op", "autograd::engine::evaluate_function: torch::autograd::AccumulateGrad", 0.0, 100.0, tid=1),
        _x("cpu_op", "torch::autograd::AccumulateGrad", 0.0, 100.0, tid=1),
        _x("cpu_op", "aten::add_", 10.0, 10.0, tid=1),
        _x("user_annotation", "gloo:all_reduce", 5.0, 95.0, tid=2),
        _x("cpu_op", "aten::copy_", 30.0, 5.0, tid=2),  # gloo's own copy: communication
        _x("user_annotation", "Optimizer.step#AdamW.step", 100.0, 10.0, tid=1),  # not an op: idle
    ]
    result = breakdown(events, on_device=False)
    assert result.by_kind["elementwise"] == pytest.approx(0.010) and result.by_kind["other"] == 0.0
    assert result.by_kind["communication"] == pytest.approx(0.095)
    assert result.busy_ms == pytest.approx(0.095) and result.exposed_comm_ms == pytest.approx(0.085)
    assert result.idle_ms == pytest.approx(0.025) and result.events == 3


def _gloo_step_worker(rank: int, world_size: int) -> dict:
    """One step: a blocking all-reduce of 16 MB, then a matmul."""
    torch.manual_seed(rank)
    a, grads = torch.randn(384, 384), torch.randn(4 << 20)

    def step() -> None:
        torch.distributed.all_reduce(grads)
        (a @ a).sum()
    step()
    return profile_step(step, torch.device("cpu")).as_dict()


def test_gloo_collectives_are_communication_and_a_blocking_one_is_exposed(tmp_path):
    """Two gloo ranks: the all-reduce's work, on gloo's threads (its copies included), is
    communication; blocking, nothing else runs meanwhile, so nearly all of it is exposed."""
    for result in run_ranks("test_step_profile:_gloo_step_worker", 2, tmp_path):
        comm = result["by_kind"]["communication"]
        assert comm > 0 and result["by_kind"]["matmul"] > 0
        assert result["by_kind"]["elementwise"] < 0.05 * comm  # gloo's copies (ms of them) count as its own
        assert 0.5 * comm < result["exposed_comm_ms"] <= result["busy_ms"]


def test_breakdown_needs_the_step_mark():
    with pytest.raises(ValueError, match="expected one"):
        breakdown([_x("kernel", "gemm", 0.0, 1.0), _x("gpu_user_annotation", STEP_MARK, 0.0, 2.0)], on_device=True)


@pytest.mark.parametrize("name, kind", [
    # CUDA kernels (names as an H100/H200 trace shows them)
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off", "matmul"),
    ("nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT", "matmul"),
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn", "matmul"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>", "matmul"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128>>", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0", "attention"),
    ("triton_per_fused__scaled_dot_product_flash_attention_transpose_view_3", "compiled"),
    ("triton_red_fused_native_layer_norm_native_layer_norm_backward_7", "compiled"),
    (("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
      "FusedOptimizerTensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4>>"),
     "optimizer"),
    ("void at::native::lpnorm_cleanup<float, (at::native::NormType)1, float, float>", "optimizer"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>", "layernorm"),
    ("void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernel<float, float>", "layernorm"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, LogSoftMaxForwardEpilogue>",
     "loss"),
    ("void at::native::(anonymous namespace)::nll_loss_forward_reduce_cuda_kernel_2d<float, float, long>", "loss"),
    ("void at::native::(anonymous namespace)::indexSelectLargeIndex<float, long, unsigned int, 2, 2, -2, true>",
     "embedding"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl, std::array<char*, 2>>",
     "elementwise"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::OpaqueType<2>>",
     "elementwise"),
    ("Memcpy DtoD (Device -> Device)", "elementwise"),
    ("Memset (Device)", "elementwise"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("ncclKernel_ReduceScatter_RING_LL_Sum_float(ncclWorkElem)", "communication"),
    ("gloo:all_to_all", "communication"),
    ("c10d::_allgather_base_", "communication"),
    ("_quantize8_kernel", "quantization"),
    ("_reduce4_kernel", "quantization"),
    ("neox_quant::reduce_requantize", "quantization"),
    # ROCm (hipBLASLt / Tensile gemms, aotriton attention)
    ("Cijk_Alik_Bljk_BBS_BH_MT128x128x64_MI16x16x16x1_SN_1LDSB1_GRVW8", "matmul"),
    ("attn_fwd", "attention"),
    # aten ops (a CPU's trace)
    ("aten::addmm", "matmul"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", "attention"),
    ("aten::_fused_adamw_", "optimizer"),
    ("aten::_foreach_norm", "optimizer"),
    ("aten::native_layer_norm_backward", "layernorm"),
    ("aten::_log_softmax_backward_data", "loss"),
    ("aten::embedding_dense_backward", "embedding"),
    ("aten::_to_copy", "elementwise"),
    ("## Call CompiledFxGraph fz2mo2nx75pbz2fwhant7uxyeawy25mipkaj6fh3ufwtzzwcl46m ##", "compiled"),
    ("aten::as_strided", "other"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t>>", "other"),
])
def test_kinds_of_real_names(name, kind):
    assert kind_of(name) == kind
