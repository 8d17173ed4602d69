"""Choose a quantizer implementation: triton on GPUs, C++ on CPU, the torch reference otherwise."""
from __future__ import annotations

import logging
from typing import Optional, Union

import torch

from .base import QuantizationError, Quantizer
from .cpp import CppBuildError, CppQuantizer
from .reference import ReferenceQuantizer

log = logging.getLogger("megatron.ops.quant")

IMPLS = ("auto", "reference", "cpp", "triton")


def _triton_unavailable(device: torch.device) -> Optional[str]:
    """Why the Triton kernels cannot run on `device` here, or None when they can."""
    try:
        from .triton_kernels import interpreter_active
    except ImportError as exc:
        return f"triton is not installed ({exc})"
    if device.type != "cuda" and not interpreter_active():
        return f"triton needs a CUDA/ROCm device, not {device} (or TRITON_INTERPRET=1)"
    return None


def get_quantizer(impl: str = "auto",
                  device: Optional[Union[str, torch.device]] = None) -> Quantizer:
    """The quantizer for `impl` in {"auto", "reference", "cpp", "triton"}.

    `device` is where the tensors will live (default: the current CUDA/ROCm device if any, else
    CPU). "auto" means triton on a GPU and cpp on CPU. An implementation that cannot run here (no
    compiler, no triton, wrong device) falls back to the reference with a one-line notice; the
    returned quantizer's `name` says which one is in use.
    """
    if impl not in IMPLS:
        raise QuantizationError(f"quantizer impl must be one of {', '.join(IMPLS)}; got {impl!r}")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if impl == "auto":
        impl = "cpp" if device.type == "cpu" else "triton"
    if impl == "reference":
        return ReferenceQuantizer()
    if impl == "cpp":
        if device.type != "cpu":
            raise QuantizationError(f"quantizer impl 'cpp' runs on CPU tensors, not on {device}")
        try:
            return CppQuantizer()
        except CppBuildError as exc:
            log.warning("C++ quantization kernels unavailable (%s); using the torch reference", exc)
            return ReferenceQuantizer()
    reason = _triton_unavailable(device)
    if reason is None:
        from .triton_kernels import TritonQuantizer
        return TritonQuantizer()
    log.warning("Triton quantization kernels unavailable (%s); using the torch reference", reason)
    return ReferenceQuantizer()


# Kernels kept only to be compared with an implementation (never trained with), by name:
# `python -m megatron.ops.quant check --impl NAME` and bench/quant_kernels.py accept them.
BASELINES = ("triton_strided4",)  # triton_kernels.StridedInt4Quantizer


def quantizer_or_baseline(impl: str, device: Optional[Union[str, torch.device]] = None) -> Quantizer:
    """``get_quantizer(impl, device)``, or the baseline kernels named ``impl`` (BASELINES) when the
    Triton kernels can run on ``device``; else the reference, with the same one-line notice."""
    if impl not in BASELINES:
        return get_quantizer(impl, device)
    triton = get_quantizer("triton", device)  # the reference, with its notice, where Triton cannot run
    if triton.name != "triton":
        return triton
    from .triton_kernels import StridedInt4Quantizer
    return StridedInt4Quantizer()
