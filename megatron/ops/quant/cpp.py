"""The C++ CPU kernels (csrc/quantization/quant_cpu.cpp): built on first use, cached on disk.

The source registers its ops with TORCH_LIBRARY (`torch.ops.neox_quant.*`) instead of a pybind
module, which builds several times faster. It is compiled for the host CPU (-march=native: 4-5x
faster than baseline x86-64 here), so the build goes to `$TORCH_EXTENSIONS_DIR` or
`~/.cache/neox_topo/torch_extensions`, in a folder named after the Python and torch versions and
the CPU (a shared home directory seen from different machines gets one build per CPU kind);
torch's loader rebuilds when the source or flags change and otherwise reuses the library.
Build it ahead of time with `python -m megatron.ops.quant build`.
"""
from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from .base import Quantizer, QuantizationError, rotation_scale

LIBRARY = "neox_quant"
SOURCE = Path(__file__).resolve().parents[3] / "csrc" / "quantization" / "quant_cpu.cpp"
# No -ffast-math: IEEE division and no reassociation. No FMA contraction: the k-chunk sum must
# round like the reference's separate multiply and add. -fopenmp: at::parallel_for uses OpenMP.
BASE_CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-fast-math"]
LDFLAGS = ["-fopenmp"]
NATIVE_ARCHES = ("x86_64", "amd64", "aarch64", "arm64")  # where gcc and clang take -march=native


class CppBuildError(RuntimeError):
    """The C++ kernels could not be built or loaded here (no compiler, no ninja, compile error)."""


def extensions_dir() -> Path:
    """Where the compiled library is cached: $TORCH_EXTENSIONS_DIR or ~/.cache/neox_topo/...."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(root) if root else Path.home() / ".cache" / "neox_topo" / "torch_extensions"


def cflags() -> list[str]:
    """Compiler flags: the fixed ones plus -march=native where the compilers accept it."""
    native = platform.machine().lower() in NATIVE_ARCHES
    return BASE_CFLAGS + (["-march=native"] if native else [])


def cpu_tag() -> str:
    """A short id of this CPU kind (model and feature flags), for a -march=native build folder."""
    identity = platform.machine() + platform.processor()
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                key = line.split(":", 1)[0].strip()
                if key in ("model name", "flags", "Features", "CPU part"):
                    identity += line
                if key in ("flags", "Features"):
                    break  # the first processor describes them all
    except OSError:
        pass
    return hashlib.sha1(identity.encode()).hexdigest()[:8]


def build_dir() -> Path:
    """The build folder for this Python, torch and CPU kind (a build is valid only for those)."""
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    version = torch.__version__.replace("+", "_")
    return extensions_dir() / f"{LIBRARY}_{py}_torch{version}_{platform.machine()}-{cpu_tag()}"


def ops_loaded() -> bool:
    """Whether `torch.ops.neox_quant` is already registered in this process."""
    try:
        torch.ops.neox_quant.quantize
    except (AttributeError, RuntimeError):
        return False
    return True


def load_ops(verbose: bool = False) -> None:
    """Build (or reuse the cached build of) the C++ kernels and register their ops.

    Raises CppBuildError with a one-line reason when that is not possible here.
    """
    if ops_loaded():
        return
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise CppBuildError(f"no C++ compiler found (looked for {compiler!r}; set CXX)")
    if not SOURCE.is_file():
        raise CppBuildError(f"kernel source missing: {SOURCE}")
    from torch.utils import cpp_extension

    folder = build_dir()
    folder.mkdir(parents=True, exist_ok=True)
    try:
        cpp_extension.load(name=LIBRARY, sources=[str(SOURCE)], extra_cflags=cflags(),
                           extra_ldflags=LDFLAGS, build_directory=str(folder),
                           is_python_module=False, verbose=verbose)
    except Exception as exc:  # compile/link errors, missing ninja: all mean "no C++ kernels here"
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CppBuildError(f"building {SOURCE.name} in {folder} failed: {first_line}") from exc
    if not ops_loaded():
        raise CppBuildError(f"{SOURCE.name} built but registered no torch.ops.{LIBRARY} ops")


def _require_cpu(t: Tensor) -> None:
    if t.device.type != "cpu":
        raise QuantizationError(f"the cpp quantizer runs on CPU tensors; got one on {t.device}")


class CppQuantizer(Quantizer):
    """OpenMP C++ kernels for CPU tensors; raises CppBuildError if they cannot be built here."""

    name = "cpp"

    def __init__(self) -> None:
        load_ops()
        self._ops = torch.ops.neox_quant

    def _quantize(self, x: Tensor, bits: int, block: int, codes: Tensor, scales: Tensor) -> None:
        _require_cpu(x)
        self._ops.quantize(x, codes, scales, bits, block)

    def _dequantize(self, codes: Tensor, scales: Tensor, bits: int, block: int, out: Tensor) -> None:
        _require_cpu(codes)
        self._ops.dequantize(codes, scales, bits, block, out)

    def _dequantize_sum(self, codes_k: Tensor, scales_k: Tensor, bits: int, block: int,
                        out: Tensor) -> None:
        _require_cpu(codes_k)
        self._ops.dequantize_sum(codes_k, scales_k, bits, block, out)

    def _reduce_requantize(self, codes_k: Tensor, scales_k: Tensor, bits: int, block: int,
                           residual: Optional[Tensor], codes: Tensor, scales: Tensor) -> None:
        _require_cpu(codes_k)
        self._ops.reduce_requantize(codes_k, scales_k, bits, block, residual, codes, scales)

    def _rotate(self, x: Tensor, block: int) -> Tensor:
        _require_cpu(x)
        return self._ops.hadamard(x, block, rotation_scale(block))

    # The records forms straight on the buffer (the kernels make the rows from its geometry: no
    # views in Python); a layout whose scales are off 4-byte bounds goes through the copies.
    def _quantize_records(self, x: Tensor, buf: Tensor, k: int, bits: int, block: int, viewable: bool) -> None:
        _require_cpu(x)
        if not viewable:
            return super()._quantize_records(x, buf, k, bits, block, viewable)
        self._ops.quantize_records(x, buf, k, bits, block)

    def _dequantize_records(self, buf: Tensor, k: int, bits: int, block: int, viewable: bool, out: Tensor) -> None:
        _require_cpu(buf)
        if not viewable:
            return super()._dequantize_records(buf, k, bits, block, viewable, out)
        self._ops.dequantize_records(buf, k, bits, block, out)

    def _reduce_requantize_records(self, buf_k: Tensor, k: int, bits: int, block: int, residual: Optional[Tensor],
                                   buf: Tensor, k_out: int, viewable: bool) -> None:
        _require_cpu(buf_k)
        if not viewable:
            return super()._reduce_requantize_records(buf_k, k, bits, block, residual, buf, k_out, viewable)
        self._ops.reduce_requantize_records(buf_k, k, bits, block, residual, buf, k_out)

    def _dequantize_sum_records(self, buf_k: Tensor, k: int, bits: int, block: int, viewable: bool,
                                out: Tensor) -> None:
        _require_cpu(buf_k)
        if not viewable:
            return super()._dequantize_sum_records(buf_k, k, bits, block, viewable, out)
        self._ops.dequantize_sum_records(buf_k, k, bits, block, out)
