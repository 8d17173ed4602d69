"""Throughput reporting: the peak table, MFU and the progress line; bench/gpu_throughput.py on a CPU
(our step against Hugging Face's GPTNeoXForCausalLM from the same weights on the same batches)."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from megatron.logging.metrics import ProgressLine
from megatron.logging.throughput import Throughput, device_peak_flops, peak_flops_of

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name, precision, peak", [
    ("NVIDIA H200", "bfloat16", 989e12), ("NVIDIA H100 80GB HBM3", "fp16", 989e12),
    ("NVIDIA H100 PCIe", "bfloat16", 756.5e12), ("NVIDIA A100-SXM4-80GB", "fp32", 19.5e12),
    ("AMD Instinct MI250X", "bfloat16", 191.5e12), ("AMD Instinct MI300X", "bfloat16", 1307.4e12),
    ("NVIDIA GeForce RTX 4090", "bfloat16", None)])
def test_peak_flops_by_device_name(name, precision, peak):
    assert peak_flops_of(name, precision) == peak


def test_peak_of_a_cpu_is_unknown_unless_configured():
    assert device_peak_flops(torch.device("cpu"), "fp32") is None
    assert device_peak_flops(torch.device("cpu"), "fp32", override_tflops=2.5) == 2.5e12


def test_throughput_by_hand_and_the_progress_line():
    # 8 sequences of 2048 tokens in 0.5 s on 4 ranks at 6e9 FLOPs/token: 32768 tok/s, 4.9152e13 per rank
    speed = Throughput(tokens=8 * 2048, seconds=0.5, flops_per_token=6e9, ranks=4, peak_flops=98.304e12)
    assert speed.tokens_per_sec == 32768
    assert speed.flops_per_sec_per_gpu == pytest.approx(4.9152e13)
    assert speed.mfu == pytest.approx(0.5)
    line = ProgressLine(10).line(3, 2.5, 1e-4, 0.75, speed, 3 * 2**30)
    assert "32,768 tok/s | 49.15 TFLOPS | MFU 50.0% | mem 3.00 GiB | ETA" in line
    no_peak = ProgressLine(10).line(3, 2.5, 1e-4, 0.75, Throughput(16384, 0.5, 6e9, 4))
    assert "MFU" not in no_peak and "mem" not in no_peak
    assert set(Throughput(16384, 0.5, 6e9, 4).metrics()) == {
        "runtime/tokens_per_sec", "runtime/iteration_time", "runtime/flops_per_sec_per_gpu"}


def _gpu_throughput():
    spec = importlib.util.spec_from_file_location("gpu_throughput", REPO / "bench" / "gpu_throughput.py")
    gpu_throughput = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = gpu_throughput  # its dataclasses look their module up there
    spec.loader.exec_module(gpu_throughput)
    return gpu_throughput


def _bench(tmp_path, rows: str, *extra: str) -> dict:
    gpu_throughput = _gpu_throughput()
    out = tmp_path / "rows.json"
    assert gpu_throughput.main(["--device", "cpu", "--shape", "tiny", "--precision", "fp32", "--rows", rows,
                                "--steps", "3", "--warmup", "1", "--json", str(out), *extra]) == 0
    return {r["row"]: r for r in json.loads(out.read_text())["rows"]}


def test_bench_our_step_trains_like_hugging_face(tmp_path, capsys):
    """Same weights, same batches, fp32: our SingleProcessEngine step and HF's model + fused AdamW give the
    same losses step by step (so the benchmark times the same work), and the table prints; so do the
    rows with activation checkpointing, full and selective."""
    rows = _bench(tmp_path, "ours,ours_fused_ce,ours_recompute,ours_selective,hf")
    for row in ("ours", "ours_fused_ce", "ours_recompute", "ours_selective"):
        assert rows[row]["losses"] == pytest.approx(rows["hf"]["losses"], rel=1e-5), row
    assert rows["ours"]["vs_hf"] > 0 and rows["hf"]["vs_hf"] == 1.0
    assert rows["ours"]["tflops"] > 0 and rows["ours"]["mfu"] is None  # no peak known for a CPU
    assert "| ours |" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_bench_without_a_gpu_exits_77_in_one_line_naming_the_cpu_run(capsys):
    assert _gpu_throughput().main([]) == 77
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "sees no GPU" in err, err
    assert "--device cpu --shape tiny --precision fp32" in err


def test_bench_on_a_cpu_defaults_to_the_tiny_shape_in_fp32_and_the_eager_rows(tmp_path):
    out = tmp_path / "rows.json"
    assert _gpu_throughput().main(["--device", "cpu", "--steps", "1", "--warmup", "0", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert (tuple(report["shape"]), report["precision"]) == ((2, 64, 4, 64, 2, 512), "fp32")
    assert [r["row"] for r in report["rows"]] == ["ours", "ours_fused_ce", "hf"]


@pytest.mark.slow
def test_bench_compiled_blocks_with_the_fused_loss_train_like_eager(tmp_path):
    """training.compile and training.fused_cross_entropy together: the eager, plain trajectory."""
    rows = _bench(tmp_path, "ours,ours_compile_fused_ce")
    assert rows["ours_compile_fused_ce"]["losses"] == pytest.approx(rows["ours"]["losses"], rel=1e-5)


@pytest.mark.slow  # torch.compile on the CPU, ~22 s
def test_bench_compiled_blocks_train_like_eager(tmp_path, capsys):
    """training.compile (each block through torch.compile) on one process: the eager trajectory.
    With --trace-dir each row's profiled step is broken down (the compiled row's blocks run as
    compiled graphs, the eager row's never) and its chrome trace kept."""
    rows = _bench(tmp_path, "ours,ours_compile", "--trace-dir", str(tmp_path / "traces"))
    assert rows["ours_compile"]["losses"] == pytest.approx(rows["ours"]["losses"], rel=1e-5)
    eager, compiled = rows["ours"]["breakdown"], rows["ours_compile"]["breakdown"]
    assert compiled["by_kind"]["compiled"] > 0 and eager["by_kind"]["compiled"] == 0
    for kind in ("matmul", "attention", "optimizer"):
        assert eager["by_kind"][kind] > 0, kind
    assert compiled["events"] < eager["events"]  # fused graphs run fewer ops
    assert sorted(p.name for p in (tmp_path / "traces").iterdir()) == ["ours.json.gz", "ours_compile.json.gz"]
    assert "Where the time of one step goes" in capsys.readouterr().out
