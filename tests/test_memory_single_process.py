"""One process's memory, measured by torch's CPU allocator, against the memory model's single-process
branch (docs/memory.md, "One process").

A run of one rank trains with the single-process engine whatever its preset, so the memory model
predicts that engine there (fp32 parameters, gradients and AdamW's moments; autocast's copies of the
weights). The allocator's count (``logging.memory_report_allocator``, torch.profiler's memory events)
is the quantity a GPU reports as ``torch.cuda.max_memory_allocated``: no allocator slack and no
interpreter in it, so the model can be held to a few percent.
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from conftest import run_deepy, tiny_run_config
from megatron.analytic.comm_model import CommSpec
from megatron.analytic.memory_model import PEAK_PHASES, device_phase_bytes, predict_peak_bytes
from megatron.analytic.model_inputs import activations_from_config, autocast_copies_from_config, comm_spec_from_config
from megatron.build import derive_vocab
from megatron.config import load_config
from megatron.logging.memory import AllocatorTrace, allocator_peaks
from megatron.model.gpt_neox import GPTNeoX
from megatron.model.sizes import autocast_copy_bytes
from megatron.topology.layout import ShardLayout

MIB = 2 ** 20


def test_allocator_trace_counts_what_each_phase_holds():
    """Known tensors: phase a holds 4 MiB and briefly 8 MiB more (peak 12); phase b starts at 4,
    adds 1 and frees the 4 (peak 5). The counts start at zero when the trace starts."""
    before = torch.empty(MIB)  # allocated before the trace: its free is not reported
    trace = AllocatorTrace()
    trace.start()
    with trace.mark("a"):
        kept = torch.empty(MIB)
        brief = torch.empty(2 * MIB)
        del brief
    with trace.mark("b"):
        other = torch.empty(MIB // 4)
        del kept, before
    peaks = trace.peaks()
    assert abs(peaks["a"] - 12 * MIB) < 4096 and abs(peaks["b"] - 5 * MIB) < 4096, peaks
    del other


def test_allocator_peaks_follow_blocks_by_address():
    """By hand, on a made-up event tree: a free the profiler missed is taken as done when its
    address is handed out again, and the free of a block from before the trace counts nothing."""
    def node(name, start, end=None, children=(), **fields):
        extra = SimpleNamespace(**fields) if fields else SimpleNamespace()
        return SimpleNamespace(name=name, start_time_ns=start, end_time_ns=end if end is not None else start,
                               children=list(children), extra_fields=extra)
    events = [node("[memory]", 1, ptr=10, alloc_size=100),   # before any phase: held 100
              node("memory_phase:a", 2, 9, children=[
                  node("[memory]", 3, ptr=20, alloc_size=40),  # 140
                  node("[memory]", 4, ptr=99, alloc_size=-70),  # a block from before the trace: no change
                  node("[memory]", 5, ptr=20, alloc_size=30)]),  # ptr 20 again: its free was missed, 130
              node("memory_phase:b", 10, 20, children=[node("[memory]", 11, ptr=10, alloc_size=-100)])]
    assert allocator_peaks(events) == {"a": 140, "b": 130}


def test_single_process_model_by_hand():
    """Units (100, 240, 96), one rank: P = 436, parameters 4P = 1744, moments 8P = 3488. Without
    activations the optimizer's moment (gradients 4P) is the step's peak; with 2000 bytes of
    activations and 300 of copies the start of backward is (2300 > 1744), and with 2 micro-batches the
    gradients are held there too."""
    layout = ShardLayout.resolve((1, 1), preset="stage3")
    idle = predict_peak_bytes(CommSpec((100, 240, 96), layout, compute_bytes=2))
    assert idle["build"] == {"parameters": 1744, "total": 1744}
    assert idle["step"] == {"parameters": 1744, "moments": 3488, "gradients": 1744, "activations": 0,
                            "autocast copies": 0, "total": 6976}
    assert idle["save"] == {"parameters": 1744, "moments": 3488, "checkpoint pieces": 5232, "total": 10464}
    assert idle["load"] == {"parameters": 1744, "moments": 3488, "mapped pages": 5232, "total": 10464}
    # on a GPU the pieces and the pages are host memory
    assert device_phase_bytes(idle["save"]) == device_phase_bytes(idle["load"]) == 5232
    busy = predict_peak_bytes(CommSpec((100, 240, 96), layout, compute_bytes=2), 2000, 300)["step"]
    assert busy == {"parameters": 1744, "moments": 3488, "gradients": 0, "activations": 2000,
                    "autocast copies": 300, "total": 7532}
    accumulating = predict_peak_bytes(CommSpec((100, 240, 96), layout, compute_bytes=2, micro_batches=2), 2000, 300)
    assert accumulating["step"]["gradients"] == 1744 and accumulating["step"]["total"] == 9276


@pytest.mark.parametrize("fused", [False, True], ids=["head", "fused_head"])
def test_autocast_copies_are_the_linear_layers_of_a_built_model(tiny_corpus, tmp_path, fused):
    """The formula against the built model: every nn.Linear's weight and bias in the compute dtype
    (the fused head casts its own weight and keeps no copy)."""
    cfg = load_config([str(tiny_run_config(tmp_path, tiny_corpus, num_layers=3, hidden_size=96,
                                           fused_cross_entropy=fused))], notices=[])
    cfg = derive_vocab(cfg, 320)
    model = GPTNeoX(cfg.model, cfg.model.padded_vocab_size)
    linear = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    counted = sum(p.numel() for name, m in linear for p in m.parameters() if not (fused and name.endswith("embed_out")))
    assert autocast_copy_bytes(cfg.model, cfg.model.padded_vocab_size, 2, fused) == 2 * counted
    assert autocast_copy_bytes(cfg.model, cfg.model.padded_vocab_size, 4, fused) == 0


def _phase_peaks(log_dir) -> dict:
    return json.loads((log_dir / "memory" / "rank_0.json").read_text())["allocator_peak"]


@pytest.mark.parametrize("precision", [pytest.param(p, marks=pytest.mark.slow) if p != "bf16" else p  # ~9 s each
                                       for p in ["fp32", "bf16", "fp32-checkpointed", "fp32-selective"]])
def test_one_process_phases_match_the_allocator(tmp_path, tiny_corpus, precision):
    """Train 2 steps and save, then resume and train one more, on one process with the allocator
    traced: build, step, save and load within 10% of the model. fp32: the activations make the
    step's peak; bf16: autocast's copies of the weights are 9% of it, and the measured peak is
    within half of them of the model (so a model without them would be refused); checkpointed: the
    head's share or one recomputed block, not both (their sum measured 0.79 here); selective: each
    block's matmul and attention outputs kept (measured 0.96 here; against full recompute's model, 1.18)."""
    shape = dict(num_layers=2, hidden_size=256, num_attention_heads=4, seq_length=128 if precision == "bf16" else 256,
                 train_micro_batch_size_per_gpu=4, train_batch_size=4, eval_iters=0, log_interval=1,
                 memory_report=True, memory_report_allocator=True, bf16={"enabled": precision == "bf16"},
                 checkpoint_activations=precision.endswith(("checkpointed", "selective")),
                 recompute_granularity="selective" if precision.endswith("selective") else "full")
    train_dir, load_dir = tmp_path / "train", tmp_path / "load"
    train_dir.mkdir(), load_dir.mkdir()
    train = tiny_run_config(train_dir, tiny_corpus, train_iters=2, save=str(tmp_path / "ck"), **shape)
    load = tiny_run_config(load_dir, tiny_corpus, train_iters=3, load=str(tmp_path / "ck"), **shape)
    for path in (train, load):
        done = run_deepy("train.py", str(path))
        assert done.returncode == 0, done.stderr[-2000:]
    measured = {**_phase_peaks(train_dir / "logs"), "load": _phase_peaks(load_dir / "logs")["load"]}
    cfg = derive_vocab(load_config([str(train)], notices=[]), 320)
    vocab = cfg.model.padded_vocab_size
    copies = autocast_copies_from_config(cfg, vocab)
    predicted = predict_peak_bytes(comm_spec_from_config(cfg, vocab), activations_from_config(cfg, vocab), copies)
    assert (copies > 0) == (precision == "bf16")
    for phase in PEAK_PHASES:
        ratio = measured[phase] / predicted[phase]["total"]
        assert 0.9 < ratio < 1.1, (phase, measured[phase], predicted[phase])
    if copies:  # the copies are seen: the step's peak is nearer the model with them than without
        step = predicted["step"]
        assert step["autocast copies"] == copies and abs(measured["step"] - step["total"]) < copies / 2, (measured, step)
