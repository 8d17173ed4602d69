"""The Triton kernels, run on CPU by the Triton interpreter, bit for bit against the reference.

TRITON_INTERPRET must be set before triton is imported, so the kernels run in subprocesses
(`python -m megatron.ops.quant check --impl triton --json`) and this process only reads their
verdicts per case; nothing here changes the environment of other tests. Every case is at most a
few dozen blocks (one interpreted program each). The interpreter keeps one core busy: two
subprocesses, each with every other case, run at once.
"""
from __future__ import annotations

import importlib.util
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_together
from megatron.ops.quant import get_quantizer
from megatron.ops.quant.selfcheck import CASES

REPO = Path(__file__).resolve().parents[1]
CASE_IDS = [f"{case.name}/int{bits}" for case in CASES for bits in (8, 4)]

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (an optional extra)")


def _interpreted_cost(case) -> float:
    """The interpreter's time grows with the programs it runs: one per block, per chunk reduced."""
    import torch
    blocks = case.make(8, torch.Generator().manual_seed(0)).numel() // case.block
    return blocks * (1 + case.chunks / 8)


def _balanced_halves(cases) -> list[list]:
    """The cases in two lists of about equal interpreted cost, longest first to the lighter one (every
    other case put most of the cost in one: ~40 s against ~21 on 2 cores)."""
    halves, loads = [[], []], [0.0, 0.0]
    for case in sorted(cases, key=_interpreted_cost, reverse=True):
        lighter = loads.index(min(loads))
        halves[lighter].append(case)
        loads[lighter] += _interpreted_cost(case)
    return halves


@pytest.fixture(scope="module")
def interpreted_results() -> dict[str, list[str]]:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    halves = _balanced_halves(CASES)

    def check(cases) -> subprocess.CompletedProcess:
        names = [arg for case in cases for arg in ("--case", case.name)]
        return subprocess.run(
            [sys.executable, "-W", "ignore", "-m", "megatron.ops.quant", "check", "--impl", "triton",
             "--json", *names], env=env, cwd=REPO, capture_output=True, text=True, timeout=600)

    results = {}
    for done in run_together(*(lambda cases=cases: check(cases) for cases in halves)):
        lines = done.stdout.strip().splitlines()
        if not lines:
            pytest.fail(f"the interpreted check printed nothing (rc {done.returncode}):\n{done.stderr}")
        results.update(json.loads(lines[-1]))
    return results


def test_every_case_ran(interpreted_results):
    assert sorted(interpreted_results) == sorted(CASE_IDS)


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_bit_exact_against_reference(interpreted_results, case_id):
    assert interpreted_results[case_id] == []


def test_triton_on_a_cpu_tensor_without_interpreter_falls_back(caplog):
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("this process itself runs under the Triton interpreter")
    with caplog.at_level("WARNING", logger="megatron.ops.quant"):
        quantizer = get_quantizer("triton", "cpu")
    assert quantizer.name == "reference"
    assert any("Triton quantization kernels unavailable" in r.getMessage() for r in caplog.records)


@pytest.mark.slow  # the bench's reference check before timing is in the default suite (the stride-2 baseline's test)
def test_the_benchmark_times_another_version_of_the_kernels(tmp_path):
    """bench/quant_kernels.py --baseline-kernels (an A/B of a kernel change on a GPU): another copy of
    triton_kernels.py is loaded beside this one and timed as impl 'baseline', after its output is
    compared with the reference's; a copy whose scales are off (amax / (qmax + 1)) is refused."""
    source = (REPO / "megatron" / "ops" / "quant" / "triton_kernels.py").read_text()
    broken = source.replace("scale = tl.math.div_rn(amax, QMAX)", "scale = tl.math.div_rn(amax, QMAX + 1)")
    assert broken != source
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    outputs = {}
    for name, text in (("same", source), ("broken", broken)):
        path = tmp_path / f"{name}.py"
        path.write_text(text)
        done = subprocess.run([sys.executable, "-W", "ignore", str(REPO / "bench" / "quant_kernels.py"), "--sizes",
                               "16K", "--bits", "4", "--impls", "reference", "--repeat", "1",
                               "--baseline-kernels", str(path)], env=env, cwd=REPO, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        outputs[name] = [line.split() for line in done.stdout.splitlines() if line.startswith("baseline")]
    assert [row[3] for row in outputs["same"]] == ["quantize", "dequantize", "reduce_requant"]
    assert " ".join(outputs["broken"][0]) == "baseline 4 2048 quantize differs from the reference: not timed"


def test_the_benchmark_times_the_int4_kernels_against_their_stride_2_baseline():
    """bench/quant_kernels.py --impls ...,triton_strided4 (the device loan's kernel A/B): the baseline
    kernels' output is compared with the reference's before each width is timed, so rows appear for
    all three ops only when they agree bit for bit."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-W", "ignore", str(REPO / "bench" / "quant_kernels.py"), "--sizes", "16K",
                           "--bits", "4", "--impls", "reference,triton_strided4", "--repeat", "1"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith("triton_strided4")]
    assert [row[3] for row in rows] == ["quantize", "dequantize", "reduce_requant"], done.stdout


@pytest.mark.slow  # ~55 s interpreted: a benchmark's baseline, not a kernel anything trains with
def test_the_stride_2_baseline_is_bit_exact_on_every_case():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-W", "ignore", "-m", "megatron.ops.quant", "check", "--impl",
                           "triton_strided4", "--json"], env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(results) == sorted(CASE_IDS) and not any(results.values())


# -- the reduce kernels over many chunks (K = 48: the cross-node hop of 48 Frontier nodes; 384: a
#    quantized hop over their whole world). K = 48 is the self-check case `many_chunks`, above.

def _constexpr_params(kernel) -> list[str]:
    """The kernel's tl.constexpr parameters, from its Python signature (compiled or interpreted)."""
    return [name for name, param in inspect.signature(kernel.fn).parameters.items()
            if "constexpr" in str(param.annotation)]


@pytest.mark.parametrize("name", ["_reduce8_kernel", "_reduce4_kernel"])
def test_reduce_kernels_loop_over_the_chunks_at_run_time(name):
    """K is a runtime argument, so one compiled kernel serves every K and its code does not grow
    with K; unrolled over a compile-time K they took 117 s (INT8) and 339 s (INT4) to compile for an
    MI250X at K = 384. Only the runtime loop's unroll factor is a compile-time constant."""
    from megatron.ops.quant import triton_kernels
    kernel = getattr(triton_kernels, name)
    assert "K" in kernel.arg_names and "K" not in _constexpr_params(kernel)
    assert "UNROLL_LOG2" in _constexpr_params(kernel) and 0 <= triton_kernels.REDUCE_UNROLL_LOG2 <= 4
    # the rows' strides and blocks per row are runtime arguments too: one kernel per message layout
    # would compile again for every bucket size
    layout = ["code_stride", "scale_stride", "out_code_stride", "out_scale_stride", "out_per_row"]
    assert set(layout) <= set(kernel.arg_names) and not set(layout) & set(_constexpr_params(kernel))
    assert "static_range(K)" not in inspect.getsource(kernel.fn)


# Compiles the reduce kernels for an MI250X, K a runtime i32, at the default block; prints the code
# objects' sizes. No GPU needed.
_COMPILE_FOR_GFX90A = """
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from megatron.ops.quant import DEFAULT_BLOCK, qmax
from megatron.ops.quant import triton_kernels as tk

sizes = {}
for bits, kernel, span in ((8, tk._reduce8_kernel, "SPAN"), (4, tk._reduce4_kernel, "HALF_SPAN")):
    codes = "*i8" if bits == 8 else "*u8"
    for requantize in (True, False):
        constants = {"QMAX": float(qmax(bits)), span: tk._span(bits, DEFAULT_BLOCK),
                     "REQUANTIZE": requantize, "HAS_RESIDUAL": requantize,
                     "UNROLL_LOG2": tk.REDUCE_UNROLL_LOG2}
        # pointers (codes, or fp32: scales, sums, residual), then strides, blocks per row, block, K
        types = {name: (codes if "codes" in name else "*fp32") if name.endswith("_ptr") else "i32"
                 for name in kernel.arg_names}
        signature = {name: "constexpr" if name in constants else types[name] for name in kernel.arg_names}
        compiled = triton.compile(ASTSource(kernel, signature, constants),
                                  target=GPUTarget("hip", "gfx90a", 64), options={"enable_fp_fusion": False})
        sizes[f"int{bits}/requantize={requantize}"] = len(compiled.asm["hsaco"])
print(json.dumps(sizes))
"""


def test_reduce_kernels_compile_for_frontier_without_a_gpu(tmp_path):
    """The reduce kernels compile for an MI250X (gfx90a, Frontier's GCD) with K a runtime argument, on
    a machine without a GPU (a few seconds: a compile error would otherwise first show in the first
    backward on Frontier)."""
    if importlib.util.find_spec("triton.backends.amd") is None:
        pytest.skip("this triton has no AMD backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(REPO), TRITON_CACHE_DIR=str(tmp_path / "triton_cache"))
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", _COMPILE_FOR_GFX90A], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    sizes = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(sizes) == ["int4/requantize=False", "int4/requantize=True", "int8/requantize=False",
                             "int8/requantize=True"]
    assert all(size > 0 for size in sizes.values())


@pytest.mark.slow
def test_reduce_kernels_bit_exact_at_384_chunks():
    """K = 384, and 13 (an unrolled iteration of 8, then the groups of 4 and 1 left), against the
    reference bit for bit: the self-check's many_chunks case with more chunks, its kernels only
    (quantize, dequantize, the reductions with and without requantize and residual). ~15 s in the
    interpreter."""
    code = ("import dataclasses, json, torch\n"
            "from megatron.ops.quant import get_quantizer\n"
            "from megatron.ops.quant.selfcheck import CASES, check_kernels\n"
            "case = next(c for c in CASES if c.name == 'many_chunks')\n"
            "quantizer = get_quantizer('triton', 'cpu')\n"
            "print(json.dumps({f'{k}/int{bits}': check_kernels(quantizer, dataclasses.replace(case, chunks=k), bits,"
            " torch.device('cpu')) for k in (13, 384) for bits in (8, 4)}))\n")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", code], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {
        "13/int8": [], "13/int4": [], "384/int8": [], "384/int4": []}
