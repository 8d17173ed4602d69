"""Issuing a unit's weight gather (docs/engine.md, steps 1-2 and "Quantized collectives").

The engine decides when a unit is gathered (its hooks, the prefetch); this module says how: which
group, from which copy (the weight chunk; zeropp's node-local secondary after the step's first
gather), in which format (compute dtype or INT8 messages), and what to do once it has arrived
(dequantize, keep zeropp's secondary). The gather is issued asynchronously and charged now.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from megatron.topology.groups import ProcessGroups
from megatron.engine.comm import Communicator, Pending
from megatron.engine.flat_unit import FlatUnit
from megatron.engine.quantized import QuantizedCollectives, QuantSettings, merge_messages


@dataclass
class InflightGather:
    """A unit's issued gather: wait on ``pending``, then ``finish`` (dequantize, keep zeropp's secondary)."""
    pending: Pending
    charges: dict
    finish: Optional[Callable[[], None]]


def start_unit_gather(unit: FlatUnit, phase: str, comm: Communicator, qcomm: Optional[QuantizedCollectives],
                      groups: ProcessGroups, quant: QuantSettings, hpz: bool) -> InflightGather:
    """Allocate the unit's full buffer and issue the gather into it."""
    full = unit.allocate()
    if quant.weight_bits:
        return _start_quantized(unit, full, phase, qcomm, groups, quant, hpz)
    if hpz and unit.secondary is not None:
        charges, pending = comm.start_all_gather(full, unit.secondary, groups.node, phase)
        return InflightGather(pending, charges, None)
    charges, pending = comm.start_all_gather(full, unit.shard, groups.weight, phase)
    finish = None
    if hpz:  # first gather after a step: keep this node's secondary chunk
        local, per_node = groups.rank % groups.node.size, groups.node.size
        step = unit.size // per_node

        def finish() -> None:
            unit.secondary = full[local * step: (local + 1) * step].clone()
    return InflightGather(pending, charges, finish)


def _start_quantized(unit: FlatUnit, full, phase: str, qcomm: QuantizedCollectives, groups: ProcessGroups,
                     quant: QuantSettings, hpz: bool) -> InflightGather:
    """INT8 gather: allgather of packed messages, then every member dequantizes all chunks (zeropp:
    the secondary copy is this node chunk's messages, kept packed)."""
    bits, node, weight = quant.weight_bits, groups.node, groups.weight
    if hpz and unit.secondary is not None:
        received, charges, pending = qcomm.start_all_gather_messages(unit.secondary, node, phase)
        return InflightGather(pending, charges, lambda: qcomm.dequantize_into(full, received, node.size, bits))
    received, charges, pending = qcomm.start_all_gather_messages(qcomm.message(unit.shard, bits), weight, phase)

    def finish() -> None:
        qcomm.dequantize_into(full, received, weight.size, bits)
        if hpz:  # world chunks l*N/R .. (l+1)*N/R - 1 make up node chunk l = r % R
            per_chunk = weight.size // node.size
            unit.secondary = merge_messages(received, weight.size, (groups.rank % node.size) * per_chunk,
                                            per_chunk, bits, quant.block)
    return InflightGather(pending, charges, finish)
