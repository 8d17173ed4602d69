"""The quantization of a run: effective bits per phase, the block, error feedback and the kernels.

One spec, resolved once from ``zero_optimization`` (``QuantSpec.from_config``) and read by the
engine's quantized collectives and by the analytic models alike, so both validate and default the
same way. DeepSpeed's booleans give the defaults and our per-phase ``*_bits`` keys override them:

    weight_gather_bits    8 with zero_quantized_weights, else 0
    grad_reduce_bits      4 with zero_quantized_gradients, else 0
    cross_node_grad_bits  grad_reduce_bits (the gradient hops across nodes: the ladder's step-boundary
                          cross hop, ZeRO++ qgZ's rail hop; 8 in-node / 4 across nodes is
                          grad_reduce_bits 8, cross_node_grad_bits 4)
    refresh_bits          8 with zero_quantized_weights or zero_quantized_refresh, else 0
    weight_delta_bits     4 with zero_quantized_weights_delta, else 0

Part of the config package (it is the config's quantization, resolved): the analytic models read it
without importing any kernel.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron.config.errors import ConfigError

WEIGHT_BITS = (0, 8)      # weight gathers and the refresh: INT8 or not quantized
GRAD_BITS = (0, 4, 8)     # gradient hops may also use packed INT4
IMPLS = ("auto", "reference", "cpp", "triton")
ROTATIONS = ("none", "hadamard")    # zero_optimization.zero_quantized_gradients_rotation
DEFAULT_BLOCK_SIZE = 2048  # the kernels' default block (docs/quantization.md); configs default to 256


class QuantSpecError(ConfigError, ValueError):
    """Bits, block or kernels that cannot run; one line names the ``zero_optimization`` key."""


@dataclass(frozen=True)
class QuantSpec:
    """Effective bits per phase (0 = the phase moves the compute dtype), the block and the kernels."""
    weight_gather_bits: int = 0
    """Weight gathers (fwd/bwd/recompute/eval; zeropp's world and node gathers and its secondary copy)."""
    grad_reduce_bits: int = 0
    """Micro-step gradient hops (weight then stride group; zeropp's two qgZ hops): all-to-all."""
    cross_node_grad_bits: int = 0
    """The step-boundary cross-group gradient hop: all-to-all. The replica allreduce is never quantized."""
    refresh_bits: int = 0
    """The refresh's cross-group allgather of the master slices (the stride hop stays in the compute dtype)."""
    block_size: int = DEFAULT_BLOCK_SIZE
    """b: elements per block, one fp32 scale each."""
    error_feedback: bool = False
    """Keep an fp32 residual of the quantized gradient hop across nodes (memory category error_feedback)."""
    impl: str = "auto"
    """Kernels: auto (triton on GPUs, C++ on CPU), reference, cpp or triton."""
    weight_delta_bits: int = 0
    """The refresh's cross hop sends the INT4/INT8 change of the weights since the last refresh
    against the copy every member already holds (0: off). Ladder layouts only."""
    weight_delta_full_refresh_interval: int = 0
    """With weight deltas: every this many optimizer steps the refresh sends the weights themselves
    (refresh_bits) instead of their change; 0 = never (after a load, always)."""
    gradient_rotation: str = "none"
    """hadamard: every quantized gradient block is rotated by the orthonormal Walsh-Hadamard matrix
    before its first quantization and rotated back after the last hop's sum (sums commute with it)."""

    def __post_init__(self) -> None:
        for key, value, allowed in (("weight_gather_bits", self.weight_gather_bits, WEIGHT_BITS),
                                    ("grad_reduce_bits", self.grad_reduce_bits, GRAD_BITS),
                                    ("cross_node_grad_bits", self.cross_node_grad_bits, GRAD_BITS),
                                    ("refresh_bits", self.refresh_bits, WEIGHT_BITS),
                                    ("weight_delta_bits", self.weight_delta_bits, GRAD_BITS)):
            if isinstance(value, bool) or value not in allowed:
                raise QuantSpecError(f"zero_optimization.{key} = {value!r} is not supported; use one of "
                                     f"{', '.join(map(str, allowed))}")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise QuantSpecError("zero_optimization.quantization_block_size must be a positive integer, "
                                 f"got {self.block_size!r}")
        if 4 in (self.grad_reduce_bits, self.cross_node_grad_bits) and self.block_size % 2:
            raise QuantSpecError("INT4 packs two codes per byte: zero_optimization.quantization_block_size must "
                                 f"be even, got {self.block_size}")
        interval = self.weight_delta_full_refresh_interval
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
            raise QuantSpecError("zero_optimization.weight_delta_full_refresh_interval must be an integer >= 0, "
                                 f"got {interval!r}")
        if self.weight_delta_bits == 4 and self.block_size % 2:
            raise QuantSpecError("INT4 packs two codes per byte: zero_optimization.quantization_block_size must "
                                 f"be even, got {self.block_size}")
        if self.gradient_rotation not in ROTATIONS:
            raise QuantSpecError(f"zero_optimization.zero_quantized_gradients_rotation must be one of "
                                 f"{', '.join(ROTATIONS)}, got {self.gradient_rotation!r}")
        if self.gradient_rotation == "hadamard" and self.block_size & (self.block_size - 1):
            raise QuantSpecError("a Hadamard rotation needs a power-of-two zero_optimization.quantization_block_size, "
                                 f"got {self.block_size}")
        if self.impl not in IMPLS:
            raise QuantSpecError(f"zero_optimization.quantization_impl must be one of {', '.join(IMPLS)}, "
                                 f"got {self.impl!r}")

    @classmethod
    def from_settings(cls, quantized_weights: bool = False, quantized_gradients: bool = False,
                      quantized_refresh: bool = False, block_size: int = DEFAULT_BLOCK_SIZE,
                      error_feedback: bool = False, weight_gather_bits: Optional[int] = None,
                      grad_reduce_bits: Optional[int] = None, cross_node_grad_bits: Optional[int] = None,
                      refresh_bits: Optional[int] = None, impl: str = "auto",
                      gradient_rotation: str = "none", quantized_weights_delta: bool = False,
                      weight_delta_bits: Optional[int] = None, weight_delta_full_refresh_interval: int = 0
                      ) -> "QuantSpec":
        """DeepSpeed-style switches and per-phase overrides (None = the default above) into bits."""
        weight = (8 if quantized_weights else 0) if weight_gather_bits is None else int(weight_gather_bits)
        grad = (4 if quantized_gradients else 0) if grad_reduce_bits is None else int(grad_reduce_bits)
        cross = grad if cross_node_grad_bits is None else int(cross_node_grad_bits)
        refresh = (8 if quantized_weights or quantized_refresh else 0) if refresh_bits is None else int(refresh_bits)
        delta = (4 if quantized_weights_delta else 0) if weight_delta_bits is None else int(weight_delta_bits)
        return cls(weight, grad, cross, refresh, int(block_size), bool(error_feedback), impl, delta,
                   int(weight_delta_full_refresh_interval), gradient_rotation)

    @classmethod
    def from_config(cls, zero) -> "QuantSpec":
        """The spec of a ``ZeroConfig`` (the config's ``zero_optimization``)."""
        return cls.from_settings(bool(zero.zero_quantized_weights), bool(zero.zero_quantized_gradients),
                                 bool(zero.zero_quantized_refresh), zero.quantization_block_size,
                                 bool(zero.quantization_error_feedback), zero.weight_gather_bits,
                                 zero.grad_reduce_bits, zero.cross_node_grad_bits, zero.refresh_bits,
                                 zero.quantization_impl, zero.zero_quantized_gradients_rotation,
                                 bool(zero.zero_quantized_weights_delta), zero.weight_delta_bits,
                                 int(zero.weight_delta_full_refresh_interval))

    @property
    def phase_bits(self) -> dict:
        return {"weight_gather_bits": self.weight_gather_bits, "grad_reduce_bits": self.grad_reduce_bits,
                "cross_node_grad_bits": self.cross_node_grad_bits, "refresh_bits": self.refresh_bits,
                "weight_delta_bits": self.weight_delta_bits}

    @property
    def enabled(self) -> bool:
        """Any phase quantized: unit buffers are then padded to a multiple of N x block."""
        return any(self.phase_bits.values())

    def summary(self) -> str:
        """One line for the start-up log."""
        return (f"weights {self.weight_gather_bits or '-'} / grads {self.grad_reduce_bits or '-'} / "
                f"cross {self.cross_node_grad_bits or '-'} / refresh {self.refresh_bits or '-'} / "
                f"weight delta {self.weight_delta_bits or '-'} bits, "
                f"block {self.block_size}, error feedback {'on' if self.error_feedback else 'off'}"
                + (f", {self.gradient_rotation} rotation" if self.gradient_rotation != "none" else ""))
