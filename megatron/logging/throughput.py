"""Throughput of a training step: tokens/s, model FLOP/s per GPU and MFU, from one FLOP formula.

FLOPs per token are ``megatron.model.sizes.model_flops_per_token`` (the step-time model reads the
same function's per-unit split), so the log, ``bench/gpu_throughput.py`` and the time model agree.
MFU is achieved model FLOP/s over the device's *peak dense* FLOP/s in the run's precision; the
peaks below are the vendors' data-sheet figures (dense, no sparsity). A device the table lacks (and
the CPU) gets no MFU unless ``logging.peak_tflops_per_gpu`` gives its peak.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

# Peak dense FLOP/s by precision (fp32 is the non-tensor-core rate).
H100_SXM = {"bfloat16": 989e12, "fp16": 989e12, "fp32": 66.9e12}   # also H200 and GH200 (same SMs)
H100_PCIE = {"bfloat16": 756.5e12, "fp16": 756.5e12, "fp32": 51.2e12}
A100 = {"bfloat16": 312e12, "fp16": 312e12, "fp32": 19.5e12}
MI300X = {"bfloat16": 1307.4e12, "fp16": 1307.4e12, "fp32": 163.4e12}
MI250X_GCD = {"bfloat16": 191.5e12, "fp16": 191.5e12, "fp32": 47.9e12}  # ROCm shows each GCD as a device

# (lower-case substring of torch.cuda.get_device_name, peaks): the first match wins, so a longer
# name comes before one it contains.
PEAK_FLOPS = (("h200", H100_SXM), ("gh200", H100_SXM), ("h100 pcie", H100_PCIE), ("h100", H100_SXM),
              ("a100", A100), ("mi300x", MI300X), ("mi250", MI250X_GCD))


def peak_flops_of(device_name: str, precision: str) -> Optional[float]:
    """Peak dense FLOP/s of a device by its name in ``precision`` (fp32, bfloat16, fp16); None if unknown."""
    name = device_name.lower()
    for pattern, peaks in PEAK_FLOPS:
        if pattern in name:
            return peaks.get(precision)
    return None


def device_peak_flops(device: torch.device, precision: str, override_tflops: Optional[float] = None) -> Optional[float]:
    """The MFU denominator of a run: the configured peak, else the table's for this GPU, else None."""
    if override_tflops:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    return peak_flops_of(torch.cuda.get_device_name(device), precision)


@dataclass(frozen=True)
class Throughput:
    """What one optimizer step achieved; ``flops_per_token`` from ``model_flops_per_token``."""
    tokens: int                 # tokens of the global batch (all ranks)
    seconds: float
    flops_per_token: float
    ranks: int
    peak_flops: Optional[float] = None  # per device

    @property
    def tokens_per_sec(self) -> float:
        return self.tokens / self.seconds

    @property
    def flops_per_sec_per_gpu(self) -> float:
        return self.flops_per_token * self.tokens / self.ranks / self.seconds

    @property
    def mfu(self) -> Optional[float]:
        return self.flops_per_sec_per_gpu / self.peak_flops if self.peak_flops else None

    def metrics(self) -> dict:
        """GPT-NeoX's names where it has them (runtime/tokens_per_sec, runtime/flops_per_sec_per_gpu)."""
        out = {"runtime/tokens_per_sec": self.tokens_per_sec, "runtime/iteration_time": self.seconds,
               "runtime/flops_per_sec_per_gpu": self.flops_per_sec_per_gpu}
        if self.mfu is not None:
            out["runtime/mfu"] = self.mfu
        return out
