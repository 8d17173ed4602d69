"""Peak memory per rank, measured, against the memory model (docs/memory.md).

The default test builds a ~40M-parameter model on 4 simulated ranks, where the model states are
several times the largest unit, and checks every rank's measured build peak above its baseline
against predict_peak_bytes within 1.5x. bench/memory.py prints every phase and configuration.
"""
from __future__ import annotations

import json

import pytest

from conftest import run_deepy, tiny_run_config
from megatron.topology.layout import ShardLayout
from megatron.config import load_config
from megatron.logging.memory import PhasePeaks, peak_rss_bytes, reset_peak
from megatron.analytic.memory_model import predict_peak_bytes
from megatron.analytic.model_inputs import comm_spec_from_config, padded_vocab_of


def test_phase_peaks_see_an_allocation_and_reset():
    import torch
    if peak_rss_bytes() is None:
        pytest.skip("no /proc/self/status here: the peak resident set cannot be read")
    if not reset_peak():
        pytest.skip("the kernel refuses to reset the peak resident set (/proc/self/clear_refs), so a phase's "
                    "peak would include the earlier phases' and the two cannot be told apart")
    peaks = PhasePeaks()
    with peaks.phase("big"):
        block = torch.ones(64 * 2 ** 20 // 4)  # 64 MiB, touched
        del block
    with peaks.phase("small"):
        pass
    assert peaks.host["big"] - peaks.host["small"] > 48 * 2 ** 20, peaks.host


@pytest.mark.parametrize("zero", [pytest.param({"stage": 3}, marks=pytest.mark.slow), {"preset": "zero_topo"}],
                         ids=["zero3", "zero_topo"])
def test_measured_build_peak_matches_the_memory_model(tmp_path, tiny_corpus, zero):
    cfg_path = tiny_run_config(tmp_path, tiny_corpus, num_layers=8, hidden_size=640, num_attention_heads=8,
                               train_iters=1, eval_iters=0, memory_report=True, train_batch_size=8,
                               train_micro_batch_size_per_gpu=2, topology={"simulate": [2, 2]},
                               zero_optimization=zero)
    done = run_deepy("train.py", str(cfg_path))
    assert done.returncode == 0, done.stderr[-2000:]
    cfg = load_config([str(cfg_path)], notices=[])
    vocab = padded_vocab_of(cfg)
    predicted = predict_peak_bytes(comm_spec_from_config(cfg, vocab))["build"]["total"]
    ranks = [json.loads(p.read_text()) for p in sorted((tmp_path / "logs" / "memory").glob("rank_*.json"))]
    assert len(ranks) == 4
    for rank in ranks:
        measured = rank["peak_rss"]["build"] - rank["baseline_rss"]
        assert predicted / 1.5 < measured < 1.5 * predicted, (measured, predicted)


def test_fp32_first_hops_are_counted_in_fp32_by_hand():
    """bf16 compute with fp32_allreduce: stage 3 on 2x2x2 has w = 8, a weight group over both nodes, so
    its first gradient hop runs in fp32; zero_topo's w = 2 is a GCD pair and stays in bf16. Units
    (100, 240, 240, 96) padded to N = 8: the largest is 240."""
    from megatron.analytic.comm_model import CommSpec
    zero3 = predict_peak_bytes(CommSpec((100, 240, 240, 96), ShardLayout.resolve((2, 2, 2), preset="stage3"), compute_bytes=2,
                                        fp32_allreduce=True))["step"]
    # synchronous: the bf16 unit gradient 240 x 2, its fp32 cast 240 x 4, the hop's fp32 output 240/8 x 4
    assert (zero3["unit gradient"], zero3["reduction input cast"], zero3["reduction output"]) == (480, 960, 120)
    overlapped = predict_peak_bytes(CommSpec((100, 240, 240, 96), ShardLayout.resolve((2, 2, 2), preset="stage3"), compute_bytes=2,
                                             fp32_allreduce=True, reductions_in_flight=2,
                                             reduce_bucket_elements=64))["step"]
    # 2 pieces of 64: each cast to fp32 (64 x 4) with its fp32 output (8 x 4); the bf16 copy is gone
    assert overlapped["reductions in flight"] == 2 * (64 * 4 + 8 * 4)
    topo = predict_peak_bytes(CommSpec((100, 240, 240, 96), ShardLayout.resolve((2, 2, 2), preset="zero_topo"), compute_bytes=2,
                                       fp32_allreduce=True))["step"]
    # bf16 first hop: the concatenation moment (the parameters' gradients and the flat one, 2 x 240 x 2)
    # outweighs the hook's (the gradient 480, its output 240): no cast either way
    assert (topo["unit gradient"], topo["reduction input cast"], topo["reduction output"]) == (960, 0, 0)


def test_hpz_secondary_copy_is_held_in_the_step_only_by_hand():
    """zeropp on 2x2x2, bf16, units (100, 240, 240, 96) padded to N = 8: S = 680. States: weights
    680/8 x 2 = 170, accumulator 680/8 x 4 = 340, master 340, moments 680, and hpZ's secondary copy
    S/R x 2 = 170 x 2 = 340 (R = 4): 1870 in the step, 1530 at build, save and load (the engine
    drops the copy at each step's end and rebuilds it at the next step's first gather)."""
    from megatron.analytic.comm_model import CommSpec
    peaks = predict_peak_bytes(CommSpec((100, 240, 240, 96), ShardLayout.resolve((2, 2, 2), preset="zeropp"),
                                        compute_bytes=2))
    assert peaks["step"]["states"] == 1870
    assert peaks["build"]["states"] == peaks["save"]["states"] == peaks["load"]["states"] == 1530


def test_the_step_is_the_larger_of_two_moments_by_hand():
    """zero_topo on 2x2x2, bf16, units (100, 240, 240, 96): states 2380 and two gathered units 960
    at both moments; in a block's backward also the unit's gradient twice over, its parameters'
    gradients and their concatenation (2 x 240 x 2 = 960; more than the synchronous hook's gradient
    and output, 480 + 240). So the start of backward makes the peak when its activations lead by
    more than those 960 bytes, and then it holds no reduction term."""
    from megatron.analytic.comm_model import CommSpec
    spec = CommSpec((100, 240, 240, 96), ShardLayout.resolve((2, 2, 2), preset="zero_topo"), compute_bytes=2)
    assert predict_peak_bytes(spec, (1500, 200))["step"] == {
        "states": 2380, "gathered units": 960, "unit gradient": 0, "reduction input cast": 0, "reduction output": 0,
        "activations": 1500, "total": 4840}
    assert predict_peak_bytes(spec, (1000, 500))["step"] == {
        "states": 2380, "gathered units": 960, "unit gradient": 960, "reduction input cast": 0, "reduction output": 0,
        "activations": 500, "total": 4800}
    # one figure is taken for both moments: the reductions are added to it (the conservative reading)
    assert predict_peak_bytes(spec, 1000)["step"]["total"] == 2380 + 960 + 960 + 1000


def test_peak_model_by_hand():
    """predict_peak_bytes term by term on units (100, 240, 240, 96), zero_topo on 2x2x2, bf16:
    S = (104, 240, 240, 96) padded to N = 8, (w, g, os) = (2, 4, 8), c = 2."""
    from megatron.analytic.comm_model import CommSpec
    from megatron.config.quant_spec import QuantSpec
    peaks = predict_peak_bytes(CommSpec((100, 240, 240, 96), ShardLayout.resolve((2, 2, 2), preset="zero_topo"), compute_bytes=2))
    # states: weights 680/2 x 2 = 680, accumulator 680/4 x 4 = 680, master 85 x 4 = 340, moments 680
    # build: the 240-unit's fp32 parameters on the host (P x 4), its bf16 flat buffer on the device
    # (S x 2), released at once (w = 2); the shards are copied from the parameters (no staging)
    assert peaks["build"] == {"states": 2380, "unit being built (host)": 240 * 4,
                              "unit being built (device)": 240 * 2, "total": 3820}
    # a block's backward: its parameters' gradients and their concatenation (2 x 240 x 2), more than
    # the synchronous hook's gradient and output (480 + 240)
    assert peaks["step"] == {"states": 2380, "gathered units": 2 * 240 * 2, "unit gradient": 2 * 240 * 2,
                             "reduction input cast": 0, "reduction output": 0, "activations": 0, "total": 4300}
    # overlap_comm, 2 pieces in flight of at most 64 elements: each its bf16 input and first-hop output
    overlapped = predict_peak_bytes(CommSpec((100, 240, 240, 96), ShardLayout.resolve((2, 2, 2), preset="zero_topo"), compute_bytes=2,
                                             reductions_in_flight=2, reduce_bucket_elements=64))
    assert overlapped["step"] == {"states": 2380, "gathered units": 2 * 240 * 2, "unit gradient": 2 * 240 * 2,
                                  "reductions in flight": 2 * (64 * 2 + 32 * 2), "activations": 0,
                                  "total": 2380 + 960 + 960 + 384}
    assert peaks["save"] == {"states": 2380, "checkpoint pieces": 3 * 85 * 4, "total": 3400}
    # error feedback (INT4 cross hop, block 8) on units (128, 256, 256, 128), already padded: S = 768,
    # residuals S/g fp32 = 192 x 4 in the states, and again in the save's pieces (each rank's file
    # carries its residuals). States: weights 384 x 2, accumulator 192 x 4, master 96 x 4, moments 768.
    ef = predict_peak_bytes(CommSpec((128, 256, 256, 128), ShardLayout.resolve((2, 2, 2), preset="zero_topo"), compute_bytes=2,
                                     quant=QuantSpec.from_settings(quantized_gradients=True, error_feedback=True,
                                                                   block_size=8)))
    assert ef["save"] == {"states": 768 + 768 + 384 + 768 + 768, "checkpoint pieces": 3 * 96 * 4 + 768,
                          "total": 3456 + 1152 + 768}
    # load: every unit's three fp32 slices mapped (3 x 85 x 4), and the 240-unit's staging: its three
    # slices 3 x 30 x 4, the bf16 cast of its master 30 x 2, the cross hop's S/4 x 2 = 120
    assert peaks["load"] == {"states": 2380, "mapped pages": 1020, "unit being loaded": 360 + 60 + 120,
                             "total": 3940}
