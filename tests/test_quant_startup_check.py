"""The start-up self-check: None on kernels that agree with the reference, else one line that names
what failed and the config key that selects other kernels; never prints, never raises."""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import megatron.ops.quant.selfcheck as selfcheck
from megatron.ops.quant import get_quantizer
from megatron.ops.quant.reference import ReferenceQuantizer
from megatron.ops.quant.selfcheck import startup_check

REPO = Path(__file__).resolve().parents[1]


def test_the_reference_passes():
    assert startup_check("reference", torch.device("cpu"), block=256) is None


def test_the_cpp_kernels_pass():
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler on this machine; the cpp kernels cannot be built")
    assert get_quantizer("cpp", "cpu").name == "cpp"  # built (~15 s cold, cached afterwards), not the fallback
    assert startup_check("cpp", "cpu", block=256) is None


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed (an optional extra)")
def test_the_triton_kernels_pass_in_the_interpreter():
    """In a TRITON_INTERPRET=1 subprocess (tests/test_quant_triton.py says why); ~10 s, most of it the
    48-chunk INT4 reductions."""
    code = ("from megatron.ops.quant.selfcheck import startup_check\n"
            "print(repr(startup_check('triton', 'cpu', block=2)))\n")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", code], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "None"


class _LateChunkBug(ReferenceQuantizer):
    """Broken past the first 8 chunks (as a runtime loop's second iteration could be): one code off."""

    name = "cpp"

    def _reduce_requantize(self, codes_k, scales_k, bits, block, residual, codes, scales):
        super()._reduce_requantize(codes_k, scales_k, bits, block, residual, codes, scales)
        if codes_k.shape[0] > 8:  # k chunks
            codes[0, 1] ^= 1


class _CompileError(ReferenceQuantizer):
    """As a Triton kernel that does not compile for this GPU: quantize raises, with a long message."""

    name = "triton"

    def _quantize(self, x, bits, block, codes, scales):
        raise RuntimeError("PassManager::run failed\n  at 12:4: while lowering tt.load\n  more context")


def test_a_wrong_reduction_is_one_line_naming_the_config_key(monkeypatch, capsys):
    monkeypatch.setattr(selfcheck, "get_quantizer", lambda impl, device: _LateChunkBug())
    line = startup_check("cpp", torch.device("cpu"), block=64)
    assert line is not None and "\n" not in line
    assert line.startswith("quantization kernels 'cpp' on cpu failed their start-up check against the torch "
                           "reference: fp32_48_chunks/int8: reduce_requantize codes: differs at element 1: got ")
    assert line.endswith("; set zero_optimization.quantization_impl to reference to use other kernels")
    assert capsys.readouterr() == ("", "")


def test_an_exception_is_one_line_with_its_type_and_first_line(monkeypatch, capsys):
    monkeypatch.setattr(selfcheck, "get_quantizer", lambda impl, device: _CompileError())
    line = startup_check("auto", torch.device("cpu"), block=64)
    assert line == ("quantization kernels 'auto' (triton) on cpu failed their start-up check against the torch "
                    "reference: bf16_3_chunks/int8 raised RuntimeError: PassManager::run failed; "
                    "set zero_optimization.quantization_impl to reference or cpp to use other kernels")
    assert capsys.readouterr() == ("", "")


def test_a_missing_gpu_is_one_line():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    line = startup_check("reference", torch.device("cuda"), block=64)
    assert line is not None and "\n" not in line
    assert line.startswith("quantization kernels 'reference' on cuda failed their start-up check against the "
                           "torch reference: bf16_3_chunks/int8 raised ")
    assert line.endswith("; set zero_optimization.quantization_impl to triton to use other kernels")


def test_kernels_that_cannot_run_on_the_device_are_one_line():
    line = startup_check("cpp", torch.device("cuda"))
    assert line == ("quantization kernels 'cpp' on cuda failed their start-up check against the torch reference: "
                    "choosing the kernels raised QuantizationError: quantizer impl 'cpp' runs on CPU tensors, not on cuda; "
                    "set zero_optimization.quantization_impl to reference or triton to use other kernels")


def test_an_odd_block_checks_int8_only():
    """An odd quantization_block_size is valid for INT8-only runs; INT4 would refuse it."""
    assert startup_check("reference", torch.device("cpu"), block=33) is None


def _engine_start(rank: int, world_size: int) -> str:
    """engine setup's check on 2 ranks of one node: the node's first rank checks kernels that fail to
    compile (patched in, on this rank only); both ranks stop with one line."""
    def fails_to_compile(*args, **kwargs):
        raise RuntimeError("compilation failed for gfx90a\nstack trace ...")
    selfcheck.check_kernels = fails_to_compile
    from megatron.config.quant_spec import QuantSpec
    from megatron.engine.comm import Communicator
    from megatron.engine.flat_unit import EngineError
    from megatron.engine.settings import EngineSettings
    from megatron.engine.setup import check_kernels_per_node
    from megatron.topology import ProcessGroups, ShardFactors, Topology
    from megatron.topology.layout import ShardLayout
    topology = Topology.simulated([1, 2])
    groups = ProcessGroups.build(topology, ShardLayout.from_topology(topology, ShardFactors(2, 2, 2)))
    comm = Communicator(groups)
    settings = EngineSettings(quant=QuantSpec(weight_gather_bits=8, impl="reference"))
    try:
        check_kernels_per_node(settings, groups, comm, torch.device("cpu"))
    except EngineError as err:
        return str(err)
    return "passed"


def test_the_engine_checks_once_per_node_and_every_rank_stops(tmp_path):
    from dist_harness import run_ranks
    first, other = run_ranks("test_quant_startup_check:_engine_start", 2, tmp_path)
    assert first.startswith("quantization kernels 'reference' on cpu failed their start-up check") and \
        "raised RuntimeError: compilation failed for gfx90a;" in first and \
        "zero_optimization.quantization_impl" in first, first
    assert other.startswith("the quantization kernels failed their start-up check on 1 node(s)") and \
        "zero_optimization.quantization_impl" in other, other
