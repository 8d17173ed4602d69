"""Peak memory per rank, measured, against the memory model (docs/memory.md).

The default test builds a ~40M-parameter model on 4 simulated ranks, where the model states are
several times the largest unit, and checks every rank's measured build peak above its baseline
against predict_peak_bytes within 1.5x. bench/memory.py prints every phase and preset.
"""
from __future__ import annotations

import json

import pytest

from conftest import run_deepy, tiny_run_config
from megatron.config import load_config
from megatron.logging.memory import PhasePeaks, peak_rss_bytes, reset_peak
from megatron.zero_topo.memory_model import predict_peak_bytes
from megatron.zero_topo.model_inputs import comm_spec_from_config, padded_vocab_of


def test_phase_peaks_see_an_allocation_and_reset():
    import torch
    if peak_rss_bytes() is None:
        pytest.skip("no /proc/self/status here")
    peaks = PhasePeaks()
    with peaks.phase("big"):
        block = torch.ones(64 * 2 ** 20 // 4)  # 64 MiB, touched
        del block
    with peaks.phase("small"):
        pass
    assert peaks.host["big"] - peaks.host["small"] > 48 * 2 ** 20 or not reset_peak()


@pytest.mark.parametrize("zero", [{"stage": 3}, {"preset": "zero_topo"}], ids=["zero3", "zero_topo"])
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
