"""How the ZeRO-topo engine trains: what it reads from the config besides the shard layout.

One frozen object, checked once (``EngineSettings.from_config``, or built by hand in tests and
tools), so the engine's constructor takes a handful of arguments instead of a score of keywords.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from megatron.config.schema import OptimizerConfig
from megatron.engine.flat_unit import EngineError
from megatron.engine.grad_reduce import DEFAULT_BUCKET_ELEMENTS
from megatron.engine.protocol import COMPUTE_DTYPES
from megatron.loss_scale import LossScaleSettings
from megatron.config.quant_spec import QuantSpec

CROSS_NODE_REDUCTIONS = ("reduce_scatter", "all_reduce")  # zero_optimization.cross_node_reduction
# precision.communication_data_type (DeepSpeed's spelling) -> the dtype the gradient hops sum in
REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class EngineSettings:
    """The engine's settings (docs/config.md names each key)."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """AdamW's hyper-parameters, clipping, fused or not (the ``optimizer`` block)."""
    precision: str = "fp32"
    """Compute dtype of the weights' gathers and the forward: fp32, bfloat16 or fp16."""
    accumulation_steps: int = 1
    """Micro-batches per optimizer step."""
    quant: Optional[QuantSpec] = None
    """Quantized collectives (megatron/config/quant_spec.py); None: none."""
    fp32_allreduce: bool = False
    """Every gradient hop across nodes in fp32 (precision.fp32_allreduce)."""
    reduce_dtype: Optional[str] = None
    """Every unquantized gradient hop in this dtype, fp32/bf16/fp16 (precision.communication_data_type);
    None: the compute dtype inside a node, ``boundary_dtype`` across nodes."""
    cross_node_reduction: str = "reduce_scatter"
    """The step boundary's cross-group hop: reduce_scatter (ours) or all_reduce (the paper's)."""
    prefetch: bool = True
    """Issue each unit's gather one unit early (zero_optimization.prefetch_gathers)."""
    overlap_reduce: bool = True
    """Reduce gradients behind the backward (zero_optimization.overlap_comm)."""
    reduce_bucket_elements: int = DEFAULT_BUCKET_ELEMENTS
    """Most elements of one gradient-reduction collective (reduce_bucket_size)."""
    reduce_buckets_in_flight: int = 2
    """With overlap: most reduction pieces issued and not yet added."""
    loss_scaling: Optional[LossScaleSettings] = None
    """fp16 loss scaling; None = the precision's default (scale 1 but for fp16)."""
    gradient_predivide_factor: Optional[float] = None
    """Each rank's gradient is divided by this before the sum; None = N (docs/numerics.md)."""

    def __post_init__(self) -> None:
        if self.quant is None:
            object.__setattr__(self, "quant", QuantSpec())
        if self.precision not in COMPUTE_DTYPES:
            raise EngineError(f"precision {self.precision!r} is not supported; use {', '.join(COMPUTE_DTYPES)}")
        if self.accumulation_steps < 1:
            raise EngineError(f"gradient_accumulation_steps must be >= 1, got {self.accumulation_steps}")
        if self.cross_node_reduction not in CROSS_NODE_REDUCTIONS or (
                self.cross_node_reduction == "all_reduce" and self.quant.cross_node_grad_bits):
            raise EngineError(f"zero_optimization.cross_node_reduction {self.cross_node_reduction!r}: use "
                              "reduce_scatter, or all_reduce (unquantized: cross_node_grad_bits 0; not with zeropp, "
                              "no cross group)")
        if self.reduce_bucket_elements < 1:
            raise EngineError(f"zero_optimization.reduce_bucket_size must be >= 1 element, got {self.reduce_bucket_elements}")
        if self.reduce_buckets_in_flight < 1:
            raise EngineError(f"zero_optimization.reduce_buckets_in_flight must be >= 1, got {self.reduce_buckets_in_flight}")
        if self.reduce_dtype is not None and self.reduce_dtype not in REDUCE_DTYPES:
            raise EngineError(f"communication_data_type {self.reduce_dtype!r}: use {', '.join(REDUCE_DTYPES)}")
        factor = self.gradient_predivide_factor
        if factor is not None and not (math.isfinite(factor) and factor > 0):
            raise EngineError(f"gradient_predivide_factor must be a finite number > 0, got {factor}")

    @classmethod
    def from_config(cls, cfg) -> "EngineSettings":
        """The settings of a validated ``NeoXConfig``."""
        zero = cfg.zero
        return cls(optimizer=cfg.optimizer, precision=cfg.precision.precision,
                   accumulation_steps=cfg.training.gradient_accumulation_steps or 1,
                   quant=QuantSpec.from_config(zero), fp32_allreduce=bool(cfg.precision.fp32_allreduce),
                   reduce_dtype=cfg.precision.communication_data_type,
                   cross_node_reduction=zero.cross_node_reduction, prefetch=bool(zero.prefetch_gathers),
                   overlap_reduce=bool(zero.overlap_comm), reduce_bucket_elements=int(zero.reduce_bucket_size),
                   reduce_buckets_in_flight=int(zero.reduce_buckets_in_flight),
                   loss_scaling=LossScaleSettings.from_config(cfg.precision),
                   gradient_predivide_factor=cfg.precision.gradient_predivide_factor)

    @property
    def compute_dtype(self) -> torch.dtype:
        return COMPUTE_DTYPES[self.precision]

    @property
    def boundary_dtype(self) -> torch.dtype:
        """Dtype of every gradient hop across nodes (cross, replica, micro-step hops spanning nodes)."""
        if self.reduce_dtype is not None:
            return REDUCE_DTYPES[self.reduce_dtype]
        return torch.float32 if self.fp32_allreduce else self.compute_dtype

    def hop_dtype(self, spans_nodes: bool) -> torch.dtype:
        """Dtype an unquantized gradient hop sums and sends in: communication_data_type when set,
        else the boundary dtype across nodes and the compute dtype inside one."""
        if self.reduce_dtype is not None:
            return REDUCE_DTYPES[self.reduce_dtype]
        return self.boundary_dtype if spans_nodes else self.compute_dtype

    def predivide(self, world_size: int) -> float:
        return float(world_size if self.gradient_predivide_factor is None else self.gradient_predivide_factor)
