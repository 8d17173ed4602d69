"""DeepSpeed ZeRO-3 and ZeRO++ (hpZ, qwZ, qgZ) as DeepSpeed 0.19 issues their collectives, for the
step-time model's baselines (docs/frontier-model.md, "The baselines as they run").

Our engine moves one flat buffer per unit; DeepSpeed moves parameters. Read from its source
(deepspeed/runtime/zero/partitioned_param_coordinator.py, partition_parameters.py, stage3.py,
runtime/comm/coalesced_collectives.py; config defaults in runtime/zero/config.py):

- Persistence: a parameter of at most ``stage3_param_persistence_threshold`` (1e5) elements is never
  released; all of them are gathered once after each optimizer step, in one coalesced all-gather.
- Gathers: one ``all_gather_coalesced`` per fetch of a submodule's parameters, prefetch filling a
  call while it holds fewer than ``stage3_prefetch_bucket_size`` (5e7) elements; one call per dtype,
  a flat buffer of every parameter's partition (ceil(numel / k) each). With qwZ the int8 codes and
  the fp32 scales (one per group of ~8,000 elements) are two all-gathers.
- Reuse: a unit whose parameters are used again (forward -> backward) within
  ``stage3_max_reuse_distance`` (1e9) elements of fetches is not released, so not gathered again.
- hpZ: the first gather of a parameter after a step runs in the world group; releasing it keeps a
  node partition (a copy of numel / R elements, in the compute dtype), which later gathers use in
  the node group.
- Reductions: gradients fill a bucket in backward order; adding one that would take the bucket past
  ``reduce_bucket_size`` (5e8) flushes it first, and the backward's end flushes the rest. Unquantized,
  a flush is one world reduce-scatter of the bucket. With qgZ (``all_to_all_quant_reduce``) it loops
  over the bucket's tensors: a 1-D tensor is its own world reduce-scatter; a 2-D one is quantized to
  INT4 with ``max(rows, cols, N)`` groups and makes four all-to-alls: codes, then scales, in the node
  group, then codes and scales of the node's share in the rail group (the same local rank on every
  node), with the swizzled quantize, the fused dequantize-reduce-requantize and a last dequantize;
  the rail group's N/R chunks are then summed in torch (one pass over the share).

What is not modelled: DeepSpeed's Python work per call (flattening, allocations, hooks), its
``max_live_parameters`` throttle and its two-fetches-in-flight limit; every collective here runs as
the figures say the library runs it. The same dtype rule as our engine (``gradient_hop_bytes``) gives
the reductions' element size.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Sequence

from megatron.analytic.comm_model import (FP32_BYTES, Collective, CommModelError, CommSpec, control_collectives,
                                           gradient_hop_bytes)
from megatron.topology.names import ALL_GATHER, ALL_TO_ALL, REDUCE_SCATTER


@dataclass(frozen=True)
class DeepSpeedSettings:
    """The ``zero_optimization`` keys that decide DeepSpeed's collectives (its defaults)."""
    reduce_bucket_size: int = 500_000_000
    prefetch_bucket_size: int = 50_000_000
    param_persistence_threshold: int = 100_000
    max_reuse_distance: int = 1_000_000_000
    qwz_group_size: int = 8000
    """Elements per fp32 scale of a quantized weight gather (CUDAQuantizer's target group size)."""


def deepspeed_collectives(spec: CommSpec, unit_shapes: Sequence[Sequence[tuple]],
                          settings: DeepSpeedSettings = DeepSpeedSettings()) -> list:
    """Every collective of one optimizer step, as ``comm_model.Collective``s on the spec's groups.

    ``spec``: preset stage3 (ZeRO-3) or zeropp (hpZ); ``spec.quant.weight_gather_bits`` 8 = qwZ,
    ``grad_reduce_bits`` 4 = qgZ. ``unit_shapes``: each unit's parameters as (name, shape) in
    registration order (``megatron.model.sizes.unit_parameter_shapes``)."""
    if spec.layout.preset not in ("stage3", "zeropp"):
        raise CommModelError(f"the DeepSpeed model describes ZeRO-3 (stage3) and ZeRO++ (zeropp); got {spec.layout.preset!r}")
    if len(unit_shapes) != len(spec.unit_numels):
        raise CommModelError(f"{len(unit_shapes)} units of parameter shapes for {len(spec.unit_numels)} units")
    sizes = [[(name, shape, math.prod(shape)) for name, shape in unit] for unit in unit_shapes]
    out = []
    for u, params in enumerate(sizes):
        out += _unit_gathers(spec, settings, u, params, sum(p for s in sizes[u + 1:] for _, _, p in s))
    out += _reductions(spec, settings, sizes)
    persistent = sum(p for unit in sizes for _, _, p in unit if p <= settings.param_persistence_threshold)
    if persistent:  # _post_step: every persistent parameter, one coalesced world all-gather
        k = spec.world_size
        out.append(Collective("refresh", ALL_GATHER, "world", _partitioned(persistent, k), spec.compute_bytes))
    return out + control_collectives(spec)


def _partitioned(numel: int, k: int) -> int:
    """A parameter's elements as DeepSpeed partitions them: ceil(numel / k) on each of k ranks."""
    return -(-numel // k) * k


def _fetch_calls(params: list, settings: DeepSpeedSettings) -> list:
    """Element counts of the unit's all_gather_coalesced calls: the released parameters in order, a
    call taking the next while it holds fewer than prefetch_bucket_size elements."""
    calls, current = [], []
    for _name, _shape, numel in params:
        if numel <= settings.param_persistence_threshold:
            continue
        current.append(numel)
        if sum(current) >= settings.prefetch_bucket_size:
            calls.append(current)
            current = []
    return calls + ([current] if current else [])


def _unit_gathers(spec: CommSpec, settings: DeepSpeedSettings, u: int, params: list, after: int) -> list:
    a, c, n, r = spec.micro_batches, spec.compute_bytes, spec.world_size, spec.ranks_per_node
    reused = after < settings.max_reuse_distance  # kept from its forward to its backward
    backward = "recompute_gather" if u in spec.checkpointed_units else "bwd_gather"
    out = []
    for call in _fetch_calls(params, settings):
        if spec.layout.hpz:  # the step's first gather is global, then the node's secondary copy
            world = sum(_partitioned(p, n) for p in call)
            out += _gathers(spec, settings, "fwd_gather", "world", world, n, 1, u, copy=sum(p // r for p in call) * c)
            passes = [("fwd_gather", a - 1)] + ([] if reused else [(backward, a)])
            node = sum(_partitioned(p, r) for p in call)
            for phase, count in passes:
                out += _gathers(spec, settings, phase, "node", node, r, count, u) if count else []
        else:
            world = sum(_partitioned(p, n) for p in call)
            for phase, count in [("fwd_gather", a)] + ([] if reused else [(backward, a)]):
                out += _gathers(spec, settings, phase, "world", world, n, count, u)
    return out


def _gathers(spec: CommSpec, settings: DeepSpeedSettings, phase: str, group: str, numel: int, k: int,
             count: int, u: int, copy: int = 0) -> list:
    """One all_gather_coalesced: in the compute dtype, or (qwZ) int8 codes then fp32 scales."""
    if not spec.quant.weight_gather_bits:
        return [Collective(phase, ALL_GATHER, group, numel, spec.compute_bytes, count, u, copy_bytes=copy)]
    scales = k * -(-(numel // k) // settings.qwz_group_size)
    return [Collective(phase, ALL_GATHER, group, numel, 1, count, u, 8, kernel_elements=(numel / k + numel) / 2,
                       copy_bytes=copy),
            Collective(phase, ALL_GATHER, group, scales, FP32_BYTES, count, u, kernel_elements=0.0)]


def _buckets(sizes: list, settings: DeepSpeedSettings) -> list:
    """(unit being reduced when the bucket flushes, [(shape, numel), ...]) in backward order."""
    out, bucket, total = [], [], 0
    for u in reversed(range(len(sizes))):
        for _name, shape, numel in reversed(sizes[u]):
            if total + numel > settings.reduce_bucket_size and total > 0:
                out.append((u, bucket))
                bucket, total = [], 0
            bucket.append((shape, numel))
            total += numel
    return out + ([(0, bucket)] if bucket else [])


def _reductions(spec: CommSpec, settings: DeepSpeedSettings, sizes: list) -> list:
    a, n, r = spec.micro_batches, spec.world_size, spec.ranks_per_node
    world_bytes = gradient_hop_bytes("world", spec)
    qgz = spec.quant.grad_reduce_bits and spec.layout.hpz and n // r > 1  # needs more than one node
    out = []
    for u, bucket in _buckets(sizes, settings):
        if not qgz:
            numel = sum(_partitioned(p, n) for _, p in bucket)
            out.append(Collective("grad_reduce", REDUCE_SCATTER, "world", numel, world_bytes, a, u))
            continue
        for shape, numel in bucket:
            if len(shape) == 1:  # all_to_all_quant_reduce leaves 1-D tensors to reduce_scatter_coalesced
                out.append(Collective("grad_reduce", REDUCE_SCATTER, "world", _partitioned(numel, n), world_bytes, a, u))
                continue
            groups = max(shape[0], shape[1], n)
            share = numel // r
            out += [Collective("grad_reduce", ALL_TO_ALL, "node", numel // 2, 1, a, u, 4, kernel_elements=numel),
                    Collective("grad_reduce", ALL_TO_ALL, "node", groups * FP32_BYTES, 1, a, u, kernel_elements=0.0),
                    Collective("grad_reduce", ALL_TO_ALL, "rail", share // 2, 1, a, u, 4, kernel_elements=share,
                               copy_bytes=share * FP32_BYTES),
                    Collective("grad_reduce", ALL_TO_ALL, "rail", groups // r * FP32_BYTES, 1, a, u,
                               kernel_elements=0.0)]
    return out


def on_deepspeed_schedule(collectives: list, micro_batches: int) -> list:
    """Our ladder's collectives with the step boundary's cross-node gradient hop moved into every
    micro-step's backward, behind the compute, as a DeepSpeed stage-3 engine reduces (the paper's
    ZeRO-topo is built on it): the same bytes per hop, ``micro_batches`` times a step."""
    return [dataclasses.replace(c, phase="grad_reduce", count=micro_batches) if c.phase == "cross_grad_reduce" else c
            for c in collectives]
