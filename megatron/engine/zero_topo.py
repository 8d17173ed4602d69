"""The ZeRO-topo engine: sharded training of a model given as a list of units (docs/engine.md).

A coordinator of small parts, each with one job:

    flat_unit.py     a unit's parameters as one padded flat buffer, the rank's shards, ``UnitState``;
                     ``shard_units`` builds them one unit at a time
    schedules.py     what differs between the ladder (every (w, g, os)) and ZeRO++ hpZ
    gathering.py     when a unit is gathered and released: the hooks' state machine, prefetch
    collectives.py   collectives on the units' states: micro-step reduction, step boundary, refresh
    grad_reduce.py   gradient reductions in buckets, behind the backward (overlap_comm)
    optimizer.py     AdamW on the fp32 1/os slices (fused or for-loop); clipping.py the global norm;
                     megatron/loss_scale.py the fp16 loss scale
    state_io.py      full states, checkpoints, the bytes of model states

Per micro-batch each unit is gathered before its forward, released after it, gathered again before
its backward, and its summed gradient reduced down the schedule's hops into an fp32 1/g accumulator.
At the step boundary the accumulator is reduced across the cross group and the replicas, clipped
with the global norm, AdamW updates the fp32 1/os master slice, and the new weights climb back
(cross, stride) into the 1/w weight chunk.
"""
from __future__ import annotations

import contextlib
import hashlib
import math
import struct
from typing import Any, Optional

import torch
from torch import nn

import megatron.engine.state_io as state_io
from megatron.engine.clipping import clip_, global_grad_norm
from megatron.engine.collectives import UnitCollectives
from megatron.engine.comm import Communicator
from megatron.engine.flat_unit import EngineError, FlatUnit, Materialize, shard_units
from megatron.engine.gathering import UnitGathers
from megatron.engine.grad_reduce import ReductionWindow
from megatron.engine.ledger import PHASES, TIERS, ByteLedger
from megatron.engine.optimizer import ShardedAdamW
from megatron.engine.protocol import LossFn
from megatron.engine.quantized import QuantizedCollectives
from megatron.engine.schedules import schedule_for
from megatron.engine.settings import EngineSettings
from megatron.loss_scale import DynamicLossScale, LossScaleSettings
from megatron.topology.groups import ProcessGroups


def _digest(values: list[int]) -> int:
    """A signed 64-bit digest of the units' checksums (int64 sums of their bits)."""
    raw = struct.pack(f"<{len(values)}q", *values)
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little", signed=True)


class ZeroTopoEngine:
    """Sharded model + AdamW over ``groups`` (whose ``layout`` says how); the loop's ``Engine``."""

    def __init__(self, model: nn.Module, loss_fn: LossFn, groups: ProcessGroups, comm: Communicator,
                 settings: EngineSettings, *, units: Optional[list[nn.Module]] = None,
                 device: Optional[torch.device] = None, materialize: Optional[Materialize] = None):
        self.layout = groups.layout
        if settings.cross_node_reduction == "all_reduce" and self.layout.hpz:
            raise EngineError("zero_optimization.cross_node_reduction 'all_reduce': use reduce_scatter, or all_reduce "
                              "(unquantized: cross_node_grad_bits 0; not with zeropp, no cross group)")
        if settings.quant.weight_delta_bits and self.layout.hpz:
            raise EngineError("zero_optimization.zero_quantized_weights_delta needs a ladder layout (a refresh across "
                              "the cross group); zeropp has no refresh: turn one of the two off")
        if getattr(model, "has_tied_embeddings", False):
            raise EngineError("the model ties its input and output embeddings across two units; "
                              "set no_weight_tying: true to train with the ZeRO-topo engine")
        self.model, self.loss_fn, self.groups, self.comm, self.settings = model, loss_fn, groups, comm, settings
        self.ledger = comm.ledger
        self.quant, self.dtype = settings.quant, settings.compute_dtype
        self.accumulation_steps = settings.accumulation_steps
        self.loss_scale = DynamicLossScale(settings.loss_scaling or LossScaleSettings.from_precision(settings.precision))
        # N by default: a rank's gradients have a single process's size (docs/numerics.md); DeepSpeed's is 1.
        self.predivide = settings.predivide(groups.world_size)
        self.optimizer = ShardedAdamW(settings.optimizer)
        self.gradient_clipping = float(settings.optimizer.gradient_clipping or 0.0)
        self.micro_count = 0  # micro-batches since the last optimizer step
        self._synced: dict = {}  # the ledger's world totals synced with the step vector (synced_ledger)
        self.device = device or next(model.parameters()).device
        quant_block = self.quant.block_size if self.quant.enabled else None  # sets the padding quantum
        self.units = shard_units(model, units if units is not None else model.units(), self.layout, groups.rank,
                                 quant_block, self.dtype, self.device, materialize)
        self.qcomm = QuantizedCollectives(comm, self.quant, self.device) if self.quant.enabled else None
        self.schedule = schedule_for(self.layout, groups, comm, self.qcomm, self.quant)
        self.collectives = UnitCollectives(groups, comm, self.qcomm, self.schedule, settings, self.device)
        self.gathers = UnitGathers(self.units, self.schedule, self.ledger, settings.prefetch)
        self.reductions = ReductionWindow(settings.overlap_reduce, settings.reduce_buckets_in_flight)
        self._allocate_residuals()
        self._hooks = [h for u in self.units for h in self._install_hooks(u)]
        self._check_same_init()
        self.ledger.reset()

    @property
    def preset(self) -> str:
        return self.layout.preset

    @property
    def step_count(self) -> int:
        """Optimizer steps taken (AdamW's t)."""
        return self.optimizer.step_count

    @step_count.setter
    def step_count(self, value: int) -> None:
        self.optimizer.step_count = value

    # -- construction -------------------------------------------------------------------------------
    def _allocate_residuals(self) -> None:
        """Error feedback on the schedule's residual hops (schedules.py), each the size of this rank's
        input to it: the ladder's cross hop (S/g, the rank's gradient accumulator) or qgZ's rail hop
        (S/R, the node-reduced share). Model state from the start, so memory does not change after the
        first step."""
        if not self.quant.error_feedback:
            return
        hops = self.schedule.residual_hops()
        for unit in self.units:
            unit.residuals = {name: torch.zeros(unit.size // divisor, dtype=torch.float32, device=self.device)
                              for name, divisor in hops}

    def _reset_residuals(self) -> None:
        """A skipped step's residuals measured an overflowed gradient: start them again from zero."""
        for unit in self.units:
            for residual in unit.residuals.values():
                residual.zero_()

    def _install_hooks(self, unit: FlatUnit) -> list:
        gathers = self.gathers
        return [unit.module.register_forward_pre_hook(lambda _m, _a, u=unit: gathers.pre_forward(u)),
                unit.module.register_forward_hook(lambda _m, _a, out, u=unit: gathers.post_forward(u, out)),
                unit.flat.register_post_accumulate_grad_hook(lambda _p, u=unit: self._post_accumulate(u))]

    def _post_accumulate(self, unit: FlatUnit) -> None:
        """Once per backward, with the unit's summed gradient: reduce it, drop it, release the unit."""
        grad, unit.flat.grad = unit.flat.grad, None
        self.reduce_gradient(unit, grad)
        self.gathers.after_reduce(unit)

    def reduce_gradient(self, unit: FlatUnit, grad: torch.Tensor) -> None:
        """Issue the reduction of a unit's gradient into its accumulator (finished by ``reductions``)."""
        self.collectives.reduce_micro(unit, grad, self.reductions, self.backward_scale)

    def _check_same_init(self) -> None:
        """Every rank must start from the same weights (same seed): one digest of every unit's
        checksum per rank, all-gathered once and compared in one read (not a read per rank pair)."""
        world = self.groups.world
        if world.size == 1:
            return
        digest = _digest([v for u in self.units for v in u.init_checksum])
        mine = torch.full((1,), digest, dtype=torch.int64, device=self.device)  # a fill, no host copy
        everyone = torch.empty(world.size, dtype=torch.int64, device=self.device)
        self.comm.all_gather(everyone, mine, world, "control")
        differs = everyone != everyone[0]
        any_differs, first = torch.stack([differs.any().long(), differs.long().argmax()]).tolist()
        if any_differs:
            raise EngineError(f"rank {world.ranks[first]} starts from different weights than rank 0: "
                              "seed the model identically on every rank")

    @property
    def backward_scale(self) -> float:
        """loss scale / (A x predivide), the factor on a micro-batch's loss before backward: with predivide
        N a sample's gradient is a single process's (same fp16 overflows). EF residuals are stored / it."""
        return self.loss_scale.scale / (self.accumulation_steps * self.predivide)

    # -- the loop's interface -----------------------------------------------------------------------
    def _autocast(self):
        # The meta device (a rehearsal standing in for a GPU, megatron/rehearsal/) has no autocast; the
        # flat buffers hold the compute dtype already, so the collectives see the same dtypes.
        if self.dtype is torch.float32 or self.device.type == "meta":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def forward_backward(self, batch: dict) -> torch.Tensor:
        """Forward and backward of one micro-batch; gradients land in the 1/g accumulators."""
        if self.micro_count >= self.accumulation_steps:
            raise EngineError(f"forward_backward called {self.micro_count + 1} times before optimizer_step "
                              f"(gradient_accumulation_steps = {self.accumulation_steps})")
        self.model.train()
        self.gathers.begin_pass(training=True)
        try:
            with self._autocast():
                loss = self.loss_fn(self.model, batch)
            self.gathers.end_forward()
            self.gathers.begin_backward()
            (loss * self.backward_scale).backward()
            self.reductions.drain()  # the accumulators are complete before the next micro-batch
        finally:
            self.reductions.abandon()  # after a failed backward: its partial sums are never read
            self.gathers.end_pass()  # also a unit that took no part in backward must not stay gathered
        self.micro_count += 1
        return loss.detach()

    @torch.no_grad()
    def eval_loss(self, batch: dict) -> torch.Tensor:
        self.model.eval()
        self.gathers.begin_pass(training=False)
        try:
            with self._autocast():
                return self.loss_fn(self.model, batch).detach()
        finally:
            self.gathers.end_forward()
            self.gathers.end_pass()

    @torch.no_grad()
    def optimizer_step(self, lr: float) -> dict:
        """Reduce, clip, AdamW, refresh. A step whose global norm is not finite (an inf/NaN gradient
        on any rank, every rank sees the same norm) is skipped on all ranks. Returns the global
        pre-clip ``grad_norm``, the ``loss_scale`` this step used and ``skipped_step`` (0 or 1)."""
        if self.micro_count != self.accumulation_steps:
            raise EngineError(f"optimizer_step after {self.micro_count} micro-batches; expected "
                              f"gradient_accumulation_steps = {self.accumulation_steps}")
        scale_used = self.loss_scale.scale
        summands = self.groups.world_size * self.accumulation_steps * self.backward_scale  # N x A, scaled
        grads = [self.collectives.step_gradient(u, summands, self.backward_scale) for u in self.units]
        # The step's one host read: the norm (a NaN/inf a quantized hop met arrives in it as NaN/inf).
        norm = global_grad_norm(grads, self.groups, self.comm)
        finite = math.isfinite(norm)
        if finite:
            clip_(grads, norm, self.gradient_clipping)
            self.optimizer.step(self.units, grads, lr)
            interval = self.quant.weight_delta_full_refresh_interval
            full = not self.quant.weight_delta_bits or bool(interval and self.step_count % interval == 0)
            for unit in self.units:
                self.collectives.refresh(unit, "refresh", full=full)
        else:
            self._reset_residuals()
        self.loss_scale.update(finite)
        for unit in self.units:
            unit.grad_accum.zero_()
            self.schedule.end_step(unit)
        self.micro_count = 0
        return {"grad_norm": norm, "loss_scale": scale_used, "skipped_step": float(not finite)}

    def all_reduce_sum(self, values: list, sync_ledger: bool = False) -> list[float]:
        """Sum over every rank as one float64 world all-reduce padded to a multiple of N (control).
        ``sync_ledger`` (the trainer's step vector): the byte ledger's counters ride in it, and their
        world totals wait for ``comm_metrics`` / ``synced_ledger`` (no collective of their own)."""
        sums, totals = self.comm.world_sum(values, with_ledger=sync_ledger)
        if sync_ledger:
            self.ledger.reset()  # what it counted is in the totals now
            for key, nbytes in totals.items():
                self._synced[key] = self._synced.get(key, 0) + nbytes
        return sums

    def gather_objects(self, obj: Any) -> list:
        """Every rank's picklable ``obj`` in rank order (the checkpoint's piece lists for index.json)."""
        return self.comm.all_gather_object(obj, self.groups.world, "checkpoint")

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's picklable ``obj`` on every rank."""
        return self.comm.broadcast_object(obj, self.groups.world, "checkpoint")

    def synced_ledger(self) -> dict[tuple[str, str], int]:
        """The ledger's totals over every rank synced by ``all_reduce_sum(..., sync_ledger=True)``
        since the last call, {(phase, tier): bytes}; starts a new window."""
        totals, self._synced = self._synced, {}
        return {(p, t): totals.get((p, t), 0) for p in PHASES for t in TIERS}

    def comm_metrics(self) -> dict:
        return ByteLedger.metrics(self.synced_ledger())

    # -- states (implemented in state_io) -------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """fp32 master parameters by name (plus the model's persistent buffers) on every rank.
        Collective; its gathers are charged to the ``checkpoint`` phase."""
        return state_io.full_state_dict(self)

    def load_full_state_dict(self, params: dict[str, torch.Tensor], optimizer: Optional[dict] = None) -> None:
        state_io.load_full_state_dict(self, params, optimizer)

    def checkpoint_state(self) -> dict:
        return state_io.checkpoint_state(self)

    def load_full_state(self, full: dict) -> None:
        state_io.load_full_state(self, full)

    def load_checkpoint(self, reader, weights_only: bool = False) -> None:
        """Load this rank's slices from a checkpoint reader (megatron.checkpointing): only the pieces
        that overlap its 1/os optimizer slice are read; the weight chunk is rebuilt by one refresh."""
        state_io.load_from_reader(self, reader, weights_only=weights_only)

    def model_state_bytes(self) -> dict[str, int]:
        return state_io.model_state_bytes(self)

    def num_parameters(self) -> int:
        return sum(u.numel for u in self.units)
