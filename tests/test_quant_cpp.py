"""The C++ CPU kernels: bit for bit equal to the reference, built once and cached, with a fallback."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron.ops.quant import get_quantizer
from megatron.ops.quant.cpp import CppBuildError, CppQuantizer, build_dir
from megatron.ops.quant.reference import ReferenceQuantizer
from megatron.ops.quant.selfcheck import CASES, check_case

REPO = Path(__file__).resolve().parents[1]
REF = ReferenceQuantizer()


@pytest.fixture(scope="module")
def cpp() -> CppQuantizer:
    """The C++ quantizer (built on first use, ~15 s cold, cached afterwards)."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler on this machine; the cpp kernels cannot be built")
    try:
        return CppQuantizer()
    except CppBuildError as exc:  # a compiler is present, so failing to build is a real failure
        pytest.fail(f"C++ kernels failed to build: {exc}")


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bit_exact_against_reference(cpp, case, bits):
    assert check_case(cpp, case, bits, torch.device("cpu")) == []


@pytest.mark.parametrize("bits", [8, 4])
def test_bit_exact_on_a_multithreaded_size(cpp, bits):
    """Enough blocks that at::parallel_for splits the work over threads."""
    gen = torch.Generator().manual_seed(bits)
    n, block, k = 1 << 20, 512, 4
    x = torch.randn(n, generator=gen) * torch.rand(n, generator=gen).mul(30).exp2()
    got, want = cpp.quantize(x, bits, block), REF.quantize(x, bits, block)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(cpp.dequantize(*want, bits, block), REF.dequantize(*want, bits, block))
    got = cpp.reduce_requantize(want[0], want[1], k, bits, block)
    expected = REF.reduce_requantize(want[0], want[1], k, bits, block)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    residual = torch.randn(n // k, generator=gen)
    got_residual, want_residual = residual.clone(), residual.clone()
    got = cpp.reduce_requantize(want[0], want[1], k, bits, block, residual=got_residual)
    expected = REF.reduce_requantize(want[0], want[1], k, bits, block, residual=want_residual)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert torch.equal(got_residual, want_residual)


def test_auto_picks_cpp_on_cpu(cpp):
    assert get_quantizer("auto", "cpu").name == "cpp"
    assert get_quantizer("cpp").name == "cpp"
    assert get_quantizer("reference").name == "reference"


def test_build_is_cached_per_python_torch_and_cpu(cpp):
    folder = build_dir()
    assert (folder / "neox_quant.so").is_file()
    assert torch.__version__.replace("+", "_") in folder.name
    assert folder.parent == Path(os.environ.get("TORCH_EXTENSIONS_DIR")
                                 or Path.home() / ".cache" / "neox_topo" / "torch_extensions")


def test_without_a_compiler_auto_falls_back_with_a_one_line_notice(tmp_path):
    code = ("from megatron.ops.quant import get_quantizer\n"
            "print('impl=' + get_quantizer('auto', 'cpu').name)\n")
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"),
               TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"), PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "impl=reference" in done.stdout
    notices = [line for line in done.stderr.splitlines() if "C++ quantization kernels" in line]
    assert len(notices) == 1 and "no C++ compiler found" in notices[0]
    assert "using the torch reference" in notices[0]
