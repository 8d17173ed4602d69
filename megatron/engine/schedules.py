"""What differs between the two families of layouts, behind one interface (docs/engine.md).

- ``LadderSchedule``: every (w, g, os) — DDP, ZeRO-1/2/3, HSDP, ZeRO-topo. A unit is gathered in
  its weight group; its gradient climbs the ladder weight group -> stride group into the 1/g
  accumulator; a quantized cross-node hop (the step boundary's cross group) keeps the residual.
- ``HpzSchedule``: ZeRO++ hpZ (preset zeropp, (N, N, N) plus a node-sharded secondary copy). The
  first gather after a step is global and keeps this node's chunk (in INT8 messages when weights
  are quantized); later gathers come from it inside the node, and the step drops it. Quantized
  gradients take qgZ's two all-to-all hops (node, then rail) after a swizzle that lands every
  node's chunk on its local rank; the rail hop keeps the residual.

The engine asks its schedule, never the preset: which hops reduce a gradient, which hops keep an
error-feedback residual, how to start a gather, what a step ends with.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megatron.engine.comm import Communicator, Pending
from megatron.engine.flat_unit import FlatUnit
from megatron.engine.quantized import QuantizedCollectives, merge_messages, qgz_swizzle
from megatron.config.quant_spec import QuantSpec
from megatron.topology.groups import ProcessGroups, RankGroup
from megatron.topology.layout import ShardLayout


@dataclass
class InflightGather:
    """A unit's issued gather: wait on ``pending``, then ``finish`` (dequantize, keep hpZ's copy)."""
    pending: Pending
    charges: dict
    finish: Optional[Callable[[], None]]


class LadderSchedule:
    """The ladder's rules (every (w, g, os)); ``HpzSchedule`` overrides where ZeRO++ differs."""

    def __init__(self, groups: ProcessGroups, comm: Communicator, qcomm: Optional[QuantizedCollectives],
                 quant: QuantSpec):
        self.groups, self.comm, self.qcomm, self.quant = groups, comm, qcomm, quant

    # -- gradients -------------------------------------------------------------------------------
    def gradient_hops(self) -> list[tuple[str, RankGroup]]:
        """The multi-rank groups of the micro-step gradient reduction, in order, by hop name."""
        return self._live([("weight", self.groups.weight), ("stride", self.groups.stride)])

    def prepare_gradient(self, grad: torch.Tensor) -> torch.Tensor:
        """The unit's gradient as the first hop sends it."""
        return grad

    def hop_bits(self, name: str) -> int:
        """The width a quantized gradient hop sends (0: the compute dtype)."""
        return self.quant.grad_reduce_bits

    def residual_hops(self) -> list[tuple[str, int]]:
        """Error feedback: (hop name, divisor of S giving the residual's size) of each quantized hop
        across nodes that follows the node's reduction (hops inside a node keep none: the first
        one's input is the whole unit, an fp32 copy of the model on every rank)."""
        g = self.groups
        return [("cross", g.factors.g)] if self.quant.cross_node_grad_bits and g.cross.size > 1 else []

    # -- weights ---------------------------------------------------------------------------------
    def start_gather(self, unit: FlatUnit, phase: str) -> InflightGather:
        """Allocate the unit's full buffer and issue its gather into it (charged now)."""
        return self._gather_from(unit.shard, self.groups.weight, unit, phase)[0]

    def _gather_from(self, chunk: torch.Tensor, group: RankGroup, unit: FlatUnit, phase: str,
                     packed: bool = False) -> tuple[InflightGather, Optional[torch.Tensor]]:
        """All-gather ``chunk`` over ``group`` into the unit's full buffer: its values, or with
        quantized weights INT8 messages (``packed``: the chunk already is one), which every member
        dequantizes once they arrived. Returns the gather and the received messages (None unquantized)."""
        full = unit.allocate()
        bits = self.quant.weight_gather_bits
        if not bits:
            charges, pending = self.comm.start_all_gather(full, chunk, group, phase)
            return InflightGather(pending, charges, None), None
        message = chunk if packed else self.qcomm.message(chunk, bits)
        received, charges, pending = self.qcomm.start_all_gather_messages(message, group, phase)
        return InflightGather(pending, charges,
                              lambda: self.qcomm.dequantize_into(full, received, group.size, bits)), received

    def end_step(self, unit: FlatUnit) -> None:
        """What an optimizer step leaves behind on a unit beyond its states (nothing on the ladder)."""

    @staticmethod
    def _live(hops: list[tuple[str, RankGroup]]) -> list[tuple[str, RankGroup]]:
        return [(name, group) for name, group in hops if group.size > 1]



class HpzSchedule(LadderSchedule):
    """ZeRO++ hpZ: the secondary copy and qgZ (module docstring)."""

    def hop_bits(self, name: str) -> int:
        """qgZ: the node hop at grad_reduce_bits, the rail hop across nodes at cross_node_grad_bits
        (grad_reduce_bits when that is 0: a qgZ hop cannot run unquantized)."""
        if name == "rail":
            return self.quant.cross_node_grad_bits or self.quant.grad_reduce_bits
        return self.quant.grad_reduce_bits

    def gradient_hops(self) -> list[tuple[str, RankGroup]]:
        if not self.quant.grad_reduce_bits:  # unquantized: the ladder's (weight group = world)
            return super().gradient_hops()
        return self._live([("node", self.groups.node), ("rail", self.groups.rail)])

    def prepare_gradient(self, grad: torch.Tensor) -> torch.Tensor:
        if not self.quant.grad_reduce_bits:
            return grad
        return qgz_swizzle(grad, self.groups.rail.size, self.groups.node.size)  # chunk r lands on rank r

    def residual_hops(self) -> list[tuple[str, int]]:
        g = self.groups
        rail = [("rail", g.node.size)] if self.quant.grad_reduce_bits and g.rail.size > 1 else []
        return rail + super().residual_hops()

    def start_gather(self, unit: FlatUnit, phase: str) -> InflightGather:
        if unit.secondary is not None:  # inside the node, from its copy
            return self._gather_from(unit.secondary, self.groups.node, unit, phase, packed=True)[0]
        inflight, received = self._gather_from(unit.shard, self.groups.weight, unit, phase)  # global
        inflight.finish = self._then_keep_secondary(unit, inflight.finish, received)
        return inflight

    def _then_keep_secondary(self, unit: FlatUnit, dequantize: Optional[Callable[[], None]],
                             received: Optional[torch.Tensor]) -> Callable[[], None]:
        """After the step's first (global) gather: keep node chunk l = r % R of it — its INT8
        messages as they arrived with quantized weights (world chunks l*N/R .. (l+1)*N/R - 1), else
        its values."""
        g, local = self.groups, self.groups.rank % self.groups.node.size

        def finish() -> None:
            if received is None:
                step = unit.size // g.node.size
                unit.secondary = unit.flat.data[local * step: (local + 1) * step].clone()
                return
            dequantize()
            per_chunk = g.weight.size // g.node.size
            unit.secondary = merge_messages(received, g.weight.size, local * per_chunk, per_chunk,
                                            self.quant.weight_gather_bits, self.quant.block_size)
        return finish

    def end_step(self, unit: FlatUnit) -> None:
        unit.secondary = None  # the next step's first gather rebuilds it


def schedule_for(layout: ShardLayout, groups: ProcessGroups, comm: Communicator,
                 qcomm: Optional[QuantizedCollectives], quant: QuantSpec) -> LadderSchedule:
    """The schedule of a layout: hpZ for zeropp, the ladder for every (w, g, os)."""
    return (HpzSchedule if layout.hpz else LadderSchedule)(groups, comm, qcomm, quant)
