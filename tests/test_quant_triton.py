"""The Triton kernels, run on CPU by the Triton interpreter, bit for bit against the reference.

TRITON_INTERPRET must be set before triton is imported, so the kernels run in subprocesses
(`python -m megatron.ops.quant check --impl triton --json`) and this process only reads their
verdicts per case; nothing here changes the environment of other tests. Every case is at most a
few dozen blocks (one interpreted program each). The interpreter keeps one core busy: two
subprocesses, each with every other case, run at once.
"""
from __future__ import annotations

import importlib.util
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


@pytest.fixture(scope="module")
def interpreted_results() -> dict[str, list[str]]:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    halves = [CASES[0::2], CASES[1::2]]

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
