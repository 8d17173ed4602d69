"""The collectives the engine runs on whole units' states, as one public object.

``UnitCollectives`` wraps the Communicator (every byte charged to the ledger), the quantized
collectives and the schedule, and offers what the engine and its state I/O (state_io.py) need:

- ``reduce_micro``: a unit's micro-step gradient down the schedule's hops into its fp32 1/g
  accumulator, in buckets, behind the backward when overlap is on (grad_reduce.py);
- ``step_gradient``: at the step boundary, the accumulator over the cross group (reduce-scatter,
  the paper's all-reduce, or quantized) and the replicas, to this rank's fp32 1/os slice;
- ``refresh``: new weights from the master slice up the cross and stride groups into the weight
  chunk (the cross hop INT8 with ``refresh_bits``), after every step and after a load;
- ``gather_up`` / ``gather_full``: a chunk all-gathered up a list of groups (full states for export);
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from megatron.engine.comm import Communicator
from megatron.engine.flat_unit import FlatUnit
from megatron.engine.grad_reduce import ReductionWindow, column_ranges, ladder_chain, piece_of, quantized_piece_chain
from megatron.engine.quantized import QuantizedCollectives
from megatron.engine.schedules import LadderSchedule
from megatron.engine.settings import EngineSettings
from megatron.topology.groups import ProcessGroups, RankGroup


class UnitCollectives:
    """Collectives over the units' flat states (module docstring)."""

    def __init__(self, groups: ProcessGroups, comm: Communicator, qcomm: Optional[QuantizedCollectives],
                 schedule: LadderSchedule, settings: EngineSettings, device: torch.device):
        self.groups, self.comm, self.qcomm, self.schedule = groups, comm, qcomm, schedule
        self.settings, self.quant = settings, settings.quant
        self.dtype, self.boundary_dtype = settings.compute_dtype, settings.boundary_dtype
        self.cross_node_reduction = settings.cross_node_reduction
        self.bucket_elements = settings.reduce_bucket_elements
        self.device = device

    # -- gradients --------------------------------------------------------------------------------
    def reduce_micro(self, unit: FlatUnit, grad: torch.Tensor, window: ReductionWindow, residual_scale: float) -> None:
        """S-element gradient -> the schedule's hops -> added into the unit's fp32 1/g accumulator, in
        pieces of at most reduce_bucket_size elements, each issued now and finished by ``window``
        (at once, or behind the rest of the backward)."""
        grad = self.schedule.prepare_gradient(grad.detach().to(self.dtype).reshape(-1))
        bits = self.quant.grad_reduce_bits
        if bits:
            named = self.schedule.gradient_hops()
            hops = [(group, unit.residuals.get(name)) for name, group in named]
            widths = [self.schedule.hop_bits(name) for name, _ in named]
        else:  # communication_data_type, else a hop whose group spans nodes the boundary dtype
            hops = [(group, self.settings.hop_dtype(self.comm.spans_nodes(group)))
                    for _name, group in self.schedule.gradient_hops()]
        rows = math.prod(group.size for group, _ in hops)
        quantum = self.quant.block_size if bits else 1
        for a, b in column_ranges(grad.numel() // rows, rows, self.bucket_elements, quantum):
            if bits:
                chain = quantized_piece_chain(self.qcomm, grad, hops, rows, a, b, "grad_reduce", widths,
                                              residual_scale=residual_scale)
            else:
                chain = ladder_chain(self.comm, piece_of(grad, rows, a, b), [g for g, _ in hops], "grad_reduce",
                                     [dtype for _, dtype in hops])
            window.submit(chain, len(hops), lambda out, a=a, b=b: unit.grad_accum[a:b].add_(out))

    def step_gradient(self, unit: FlatUnit, summands: float, residual_scale: float) -> torch.Tensor:
        """The fp32 gradient of the mean loss on this rank's 1/os slice: the accumulator summed over
        the cross group and the replicas, divided by ``summands``; a new tensor (the accumulator is
        zeroed after the step)."""
        cross, replica = self.groups.cross, self.groups.replica
        grad = unit.grad_accum
        if cross.size > 1 and self.quant.cross_node_grad_bits:  # quantized from the fp32 accumulator
            grad = self.qcomm.reduce(grad, [(cross, unit.residuals.get("cross"))], "cross_grad_reduce",
                                     self.quant.cross_node_grad_bits, residual_scale=residual_scale)
        elif cross.size > 1:
            grad = grad.to(self.boundary_dtype)  # fp32: the accumulator itself, no copy
            if self.cross_node_reduction == "all_reduce":  # the paper's: every member sums all of S/g, in
                self.comm.all_reduce(grad, cross, "cross_grad_reduce")  # place (the accumulator is zeroed after)
                grad = grad.view(cross.size, -1)[cross.index(self.groups.rank)]  # the reduce-scatter's chunk
            else:
                out = torch.empty(grad.numel() // cross.size, dtype=grad.dtype, device=grad.device)
                self.comm.reduce_scatter(out, grad, cross, "cross_grad_reduce")
                grad = out
        if replica.size > 1:
            grad = grad.to(self.boundary_dtype)
            self.comm.all_reduce(grad, replica, "replica_allreduce")
        return grad.float() / summands

    # -- weights ----------------------------------------------------------------------------------
    def gather_up(self, chunk: torch.Tensor, groups: list[RankGroup], phase: str,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """All-gather ``chunk`` up the listed groups (each result feeds the next); the last lands in ``out``."""
        live = [g for g in groups if g.size > 1]
        for i, group in enumerate(live):
            last = i == len(live) - 1
            dest = out if last and out is not None else torch.empty(
                chunk.numel() * group.size, dtype=chunk.dtype, device=chunk.device)
            self.comm.all_gather(dest, chunk, group, phase)
            chunk = dest
        if out is not None and not live:
            out.copy_(chunk)
            return out
        return chunk

    def refresh(self, unit: FlatUnit, phase: str, full: bool = True) -> None:
        """New weight chunk from the master slice: cast, then all-gather across the cross and stride
        groups (the cross hop as INT8 messages quantized from fp32 when refresh_bits = 8). Not
        ``full`` with weight deltas on: the cross hop sends the change instead (``_refresh_change``)."""
        cross, stride = self.groups.cross, self.groups.stride
        if self.quant.weight_delta_bits and cross.size > 1 and not full:
            self._refresh_change(unit, phase)
            return
        bits = self.quant.refresh_bits
        if bits and cross.size > 1:
            partial = torch.empty(unit.master.numel() * cross.size, dtype=self.dtype, device=self.device)
            self.qcomm.gather(partial, unit.master, cross, phase, bits)
            self.gather_up(partial, [stride], phase, out=unit.shard)
            return
        self.gather_up(unit.master.to(self.dtype), [cross, stride], phase, out=unit.shard)

    def held_weights(self, unit: FlatUnit, lo: int, hi: int) -> torch.Tensor:
        """This rank's current weights of the unit's elements [lo, hi) (inside its weight chunk)."""
        w_lo = unit.weight_range[0]
        return unit.shard[lo - w_lo: hi - w_lo]

    def _refresh_change(self, unit: FlatUnit, phase: str) -> None:
        """The weight-delta refresh: every member of the cross group holds the same weights for the
        unit's S/g range (its weight chunk holds that range); each sends the INT4/INT8 change of its
        1/os slice against them (master - held), and every member adds all the dequantized changes
        to what it holds, in fp32, then casts: the same bits everywhere, no copy kept besides the
        weights themselves. The stride hop then spreads the new S/g range as usual."""
        held = self.held_weights(unit, *unit.grad_range).float()
        o_lo, o_hi = unit.opt_range
        g_lo = unit.grad_range[0]
        change = unit.master - held[o_lo - g_lo: o_hi - g_lo]
        changes = torch.empty_like(held)
        self.qcomm.gather(changes, change, self.groups.cross, phase, self.quant.weight_delta_bits)
        self.gather_up((held + changes).to(self.dtype), [self.groups.stride], phase, out=unit.shard)

    def rebuild_weights(self, unit: FlatUnit, weights: torch.Tensor, phase: str) -> None:
        """The weight chunk from this rank's 1/os slice of saved weights (a weight-delta run's,
        ``weights`` fp32): all-gathered up the cross and stride groups in the compute dtype."""
        self.gather_up(weights.to(self.dtype), [self.groups.cross, self.groups.stride], phase, out=unit.shard)

    def refreshed_weights(self, weights: torch.Tensor) -> torch.Tensor:
        """``weights`` (fp32, whole blocks) as a refresh delivers them: INT8-roundtripped when the
        refresh's cross hop is quantized (every member then holds the dequantized values), else cast."""
        if self.quant.refresh_bits and self.groups.cross.size > 1:
            return self.qcomm.roundtrip(weights, self.quant.refresh_bits, self.dtype)
        return weights.to(self.dtype)

    def gather_full(self, tensor: torch.Tensor, phase: str = "checkpoint") -> torch.Tensor:
        """An fp32 1/os slice (master or moment) assembled into all S elements on every rank."""
        g = self.groups
        return self.gather_up(tensor.float(), [g.cross, g.stride, g.weight], phase)
