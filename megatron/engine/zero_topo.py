"""The ZeRO-topo engine: sharded training of a model given as a list of units (docs/engine.md).

Per micro-batch each unit is gathered before its forward (weight group; zeropp: world, then node
from the secondary copy), released after it, gathered again before its backward, and its summed
gradient reduce-scattered down the ladder (weight group, stride group) into an fp32 1/g accumulator.
At the step boundary the accumulator is reduce-scattered across the cross group (or, with
``cross_node_reduction="all_reduce"``, the paper's, all-reduced there and sliced), all-reduced across
replicas, clipped with the global norm, AdamW updates the fp32 1/os master slice, and the new
weights climb back (cross, stride) into the 1/w weight chunk.

Hooks and the per-unit state machine (why each rule exists):
- forward pre-hook: gather if released, then point the module's attributes at ``flat``. Inside our
  own ``backward()`` a forward is autograd recomputing a checkpointed unit: a re-entrant checkpoint
  reaches it released (gather, phase ``recompute_gather``), a non-re-entrant one after the pre-backward
  hook gathered it as ``bwd_gather`` (that charge is moved to ``recompute_gather`` once; the unit is
  remembered as recomputing and later gathers are charged right away).
- forward post-hook: outside backward, release and hook the outputs (pre-backward gather); during a
  recompute, keep the unit gathered for the backward that follows.
- post-accumulate-grad hook on ``flat``: fires once per backward with the unit's summed gradient:
  issue its reduction, drop the gradient, release. With ``overlap_reduce`` the reduction (in
  pieces of ``reduce_bucket_elements``) runs behind the backward of the units before it, at most
  ``reduce_buckets_in_flight`` pieces at once, and the backward ends by waiting for all of them
  (grad_reduce.py); without it each piece is waited for at once. Both give the same bits.
- prefetch (``prefetch=True``): each hook that gathers a unit also issues, asynchronously, the gather
  of the unit that runs next (forward: the next unit; backward and recompute: the previous one; see
  prefetch.py). It is charged when issued, under the phase it would have had, and waited for in that
  unit's own hook, so the ledger is unchanged; at most two sharded units are gathered or in flight.
  Every pass ends with ``_drain``: nothing stays in flight or gathered.

Quantized collectives (``quant``, built by megatron/engine/quantized.py): gathers move INT8
messages, gradient hops become all-to-alls of INT4/INT8 messages with a fused dequantize-sum(-
requantize), zeropp's reduction becomes qgZ (node hop, then rail hop), and the refresh's cross hop
may move INT8; error-feedback residuals live on the units (``FlatUnit.residuals``).
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable, Optional

import torch
from torch import nn

from megatron.topology.groups import ProcessGroups, RankGroup
from megatron.topology.layout import ShardLayout
from megatron.topology.topology import TopologyError
from megatron.engine.comm import Communicator
from megatron.engine.ledger import ByteLedger
from megatron.engine.flat_unit import EngineError, FlatUnit, build_slots
from megatron.engine.grad_reduce import (DEFAULT_BUCKET_ELEMENTS, ReductionWindow, column_ranges, ladder_chain,
                                            piece_of, quantized_piece_chain)
from megatron.loss_scale import DynamicLossScale, LossScaleSettings
from megatron.engine.optimizer import AdamWHyper, adamw_update, clip_coefficient, fused_adamw_update
from megatron.engine.prefetch import PassOrder
from megatron.engine.gathers import start_unit_gather
from megatron.engine.quantized import QuantizedCollectives, QuantSettings, qgz_swizzle
from megatron.engine import state_io


LossFn = Callable[[nn.Module, dict], torch.Tensor]
# materialize(unit_index, unit): give the unit's parameters storage and their initial values (on any
# device; the FlatUnit copies what this rank keeps to the engine's device, then drops them).
Materialize = Callable[[int, nn.Module], None]
CROSS_NODE_REDUCTIONS = ("reduce_scatter", "all_reduce")  # zero_optimization.cross_node_reduction
COMPUTE_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16,
                  "bf16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


class ZeroTopoEngine:
    """Sharded model + AdamW over ``groups``; the training loop's interface (see megatron/engine/single_process.py)."""

    def __init__(self, model: nn.Module, units: list[nn.Module], loss_fn: LossFn, opt_cfg, precision: str,
                 groups: ProcessGroups, comm: Communicator, accumulation_steps: int,
                 preset: Optional[str] = None, *, fp32_allreduce: bool = False,
                 cross_node_reduction: str = "reduce_scatter",
                 quant: Optional[QuantSettings] = None, prefetch: bool = True,
                 device: Optional[torch.device] = None, materialize: Optional[Materialize] = None,
                 loss_scaling: Optional[LossScaleSettings] = None, overlap_reduce: bool = True,
                 reduce_bucket_elements: int = DEFAULT_BUCKET_ELEMENTS, reduce_buckets_in_flight: int = 2,
                 gradient_predivide_factor: Optional[float] = None):
        if precision not in COMPUTE_DTYPES:
            raise EngineError(f"precision {precision!r} is not supported; use fp32, bfloat16 or fp16")
        if accumulation_steps < 1:
            raise EngineError(f"gradient_accumulation_steps must be >= 1, got {accumulation_steps}")
        if getattr(model, "has_tied_embeddings", False):
            raise EngineError("the model ties its input and output embeddings across two units; "
                              "set no_weight_tying: true to train with the ZeRO-topo engine")
        try:  # a preset name must mean the groups' factors (zeropp: (N, N, N)); None = custom factors
            self.layout = ShardLayout.from_topology(groups.topology, groups.factors, preset)
        except TopologyError as err:
            raise EngineError(str(err)) from None
        self.hpz = self.layout.hpz
        self.model, self.loss_fn, self.groups, self.comm = model, loss_fn, groups, comm
        self.ledger = comm.ledger
        self.preset = self.layout.preset
        self.accumulation_steps = accumulation_steps
        self.hyper = AdamWHyper.from_config(opt_cfg)
        self.fused_adamw = bool(opt_cfg.fused)
        self.gradient_clipping = float(opt_cfg.gradient_clipping or 0.0)
        self.dtype = COMPUTE_DTYPES[precision]
        # Dtype of every gradient hop across nodes (cross, replica, spanning micro-step hops).
        self.boundary_dtype = torch.float32 if fp32_allreduce else self.dtype
        self.loss_scale = DynamicLossScale(loss_scaling or LossScaleSettings.from_precision(precision))
        # None = N: a rank's gradients have a single process's size (docs/numerics.md); DeepSpeed's is 1.
        self.predivide = float(groups.world_size if gradient_predivide_factor is None else gradient_predivide_factor)
        if not (math.isfinite(self.predivide) and self.predivide > 0):
            raise EngineError(f"gradient_predivide_factor must be a finite number > 0, got {gradient_predivide_factor}")
        self.quant = quant or QuantSettings()
        if cross_node_reduction not in CROSS_NODE_REDUCTIONS or (
                cross_node_reduction == "all_reduce" and (self.quant.cross_bits or self.hpz)):
            raise EngineError(f"zero_optimization.cross_node_reduction {cross_node_reduction!r}: use reduce_scatter, "
                              "or all_reduce (unquantized: cross_node_grad_bits 0; not with zeropp, no cross group)")
        self.cross_node_reduction = cross_node_reduction
        self.step_count = 0            # optimizer steps taken (AdamW's t)
        self.micro_count = 0           # micro-batches since the last optimizer step
        self._in_backward = False      # inside our own backward(): a unit forward is a recompute
        self._forward_phase = "eval_gather"
        self.units = self._build_units(model, units, device, materialize)
        self.prefetch = prefetch       # issue the next unit's gather early (prefetch.py)
        self.order = PassOrder(len(self.units))
        self.qcomm = QuantizedCollectives(comm, self.quant, self.device) if self.quant.enabled else None
        if reduce_bucket_elements < 1:
            raise EngineError(f"zero_optimization.reduce_bucket_size must be >= 1 element, got {reduce_bucket_elements}")
        if reduce_buckets_in_flight < 1:
            raise EngineError(f"zero_optimization.reduce_buckets_in_flight must be >= 1, got {reduce_buckets_in_flight}")
        self.reduce_bucket_elements = reduce_bucket_elements
        self.reductions = ReductionWindow(overlap_reduce, reduce_buckets_in_flight)  # grad_reduce.py
        self._allocate_residuals()
        self._hooks = [h for u in self.units for h in self._install_hooks(u)]
        self._check_same_init()
        self.ledger.reset()

    # -- construction -------------------------------------------------------------------------------
    def _build_units(self, model: nn.Module, units: list[nn.Module], device: Optional[torch.device],
                     materialize: Optional[Materialize]) -> list[FlatUnit]:
        """One FlatUnit per unit, built one at a time: ``materialize(i, unit)`` (when given) makes
        unit i's parameters real right before its FlatUnit copies the rank's slices, and the full
        parameters are dropped right after, so the build holds one full unit plus the shards."""
        names_by_id = {id(p): name for name, p in model.named_parameters()}
        owner: dict[int, int] = {}
        slot_lists = []
        for i, unit in enumerate(units):
            slots = build_slots(unit, names_by_id)
            if not slots:
                raise EngineError(f"unit {i} ({type(unit).__name__}) has no parameters; pass only units that do")
            for slot in slots:
                pid = id(getattr(slot.module, slot.attr))
                if pid in owner:
                    raise EngineError(f"parameter {slot.name} belongs to units {owner[pid]} and {i}; "
                                      "parameters shared across units (tied weights) are not supported")
                owner[pid] = i
            slot_lists.append(slots)
        missing = [name for name, p in model.named_parameters() if id(p) not in owner]
        if missing:
            raise EngineError(f"parameters outside every unit: {', '.join(missing[:5])}; every parameter must be in a unit")
        device = device or next(model.parameters()).device
        if device.type == "meta":
            raise EngineError("the model is on the meta device: pass the engine's device and a materialize callback")
        if materialize is None and any(p.is_meta for p in model.parameters()):
            raise EngineError("the model has meta parameters but no materialize callback makes them real")
        self.device = device
        quant_block = self.quant.block if self.quant.enabled else None  # sets the padding quantum
        built = []
        for i, (unit, slots) in enumerate(zip(units, slot_lists)):
            if materialize is not None:
                materialize(i, unit)
            built.append(FlatUnit(i, unit, slots, self.layout, self.groups.rank, quant_block, self.dtype, device))
        return built

    def _micro_hops(self) -> list[tuple[str, RankGroup]]:
        """The multi-rank groups of the micro-step gradient reduction, in order, by hop name."""
        g = self.groups
        hops = [("node", g.node), ("rail", g.rail)] if self.hpz and self.quant.grad_bits else \
            [("weight", g.weight), ("stride", g.stride)]
        return [(name, group) for name, group in hops if group.size > 1]

    def _allocate_residuals(self) -> None:
        """Error feedback on the reduction hop that crosses nodes, sized like this rank's input to it:
        the ladder's cross hop (S/g, the rank's gradient accumulator) or qgZ's rail hop (S/R, the
        node-reduced share). Hops inside a node keep no residual: the first one's input is the whole
        unit, so its residual would be an fp32 copy of the model on every rank (82 GB per GCD at
        20B). Model state from the start, so memory does not change after the first step."""
        if not self.quant.error_feedback:
            return
        g = self.groups
        hops = []
        if self.quant.grad_bits and self.hpz and g.rail.size > 1:
            hops.append(("rail", g.node.size))
        if self.quant.cross_bits and g.cross.size > 1:
            hops.append(("cross", g.factors.g))
        for unit in self.units:
            unit.residuals = {name: torch.zeros(unit.size // divisor, dtype=torch.float32, device=self.device)
                              for name, divisor in hops}

    def _reset_residuals(self) -> None:
        """A skipped step's residuals measured an overflowed gradient: start them again from zero."""
        for unit in self.units:
            for residual in unit.residuals.values():
                residual.zero_()

    def _install_hooks(self, unit: FlatUnit) -> list:
        return [unit.module.register_forward_pre_hook(lambda _m, _a, u=unit: self._pre_forward(u)),
                unit.module.register_forward_hook(lambda _m, _a, out, u=unit: self._post_forward(u, out)),
                unit.flat.register_post_accumulate_grad_hook(lambda _p, u=unit: self._post_accumulate(u))]

    def _check_same_init(self) -> None:
        """Every rank must start from the same weights (same seed): compare checksums once."""
        world = self.groups.world
        if world.size == 1:
            return
        local = torch.tensor([v for u in self.units for v in u.init_checksum], dtype=torch.float64, device=self.device)
        everyone = torch.empty(local.numel() * world.size, dtype=torch.float64, device=self.device)
        self.comm.all_gather(everyone, local, world, "control")
        table = everyone.view(world.size, -1)
        for r in range(1, world.size):
            if not torch.equal(table[r], table[0]):
                raise EngineError(f"rank {r} starts from different weights than rank 0: "
                                  "seed the model identically on every rank")

    # -- gathers and releases -----------------------------------------------------------------------
    def _start_gather(self, unit: FlatUnit, phase: str) -> dict[str, int]:
        """Issue the unit's gather (charged now); ``_finish_gather`` waits for it. Returns the charges."""
        unit.inflight = start_unit_gather(unit, phase, self.comm, self.qcomm, self.groups, self.quant, self.hpz)
        return unit.inflight.charges

    def _finish_gather(self, unit: FlatUnit) -> dict[str, int]:
        inflight, unit.inflight = unit.inflight, None
        inflight.pending.wait()
        if inflight.finish is not None:
            inflight.finish()
        unit.gathered = True
        return inflight.charges

    def _gather(self, unit: FlatUnit, phase: str) -> dict[str, int]:
        """Gather now: finish an in-flight (prefetched) gather, else issue one and wait for it."""
        if unit.inflight is None:
            self._start_gather(unit, phase)
        return self._finish_gather(unit)

    def _start_backward_gather(self, unit: FlatUnit) -> None:
        """A backward gather is charged ``bwd_gather`` until the unit is seen recomputing."""
        phase = "recompute_gather" if unit.recomputes else "bwd_gather"
        charges = self._start_gather(unit, phase)
        unit.pending_bwd_charges = charges if phase == "bwd_gather" else None

    def _prefetch(self, index: Optional[int], backward: bool) -> None:
        """Issue unit ``index``'s gather now (megatron/engine/prefetch.py says which unit); it is
        waited for when the unit needs it."""
        if index is None or not self.prefetch:
            return
        unit = self.units[index]
        if unit.gathered or unit.inflight is not None:
            return
        if backward:
            self._start_backward_gather(unit)
        else:
            self._start_gather(unit, self._forward_phase)

    def _drain(self) -> None:
        """End of a pass: no gather stays in flight and no sharded unit stays gathered."""
        for unit in self.units:
            unit.pending_bwd_charges = None
            if unit.inflight is not None:
                self._finish_gather(unit)
            if unit.shardable and unit.gathered:
                unit.release()

    def _pre_forward(self, unit: FlatUnit) -> None:
        if self._in_backward:  # autograd recomputing a checkpointed unit
            if not unit.gathered:
                self._gather(unit, "recompute_gather")
            if unit.pending_bwd_charges is not None:
                self.ledger.move(unit.pending_bwd_charges, "bwd_gather", "recompute_gather")
                unit.pending_bwd_charges = None
            unit.recomputes = True
            self._prefetch(self.order.before(unit.index), backward=True)
        else:
            self.order.visit(unit.index)
            if not unit.gathered:
                self._gather(unit, self._forward_phase)
            self._prefetch(self.order.after(unit.index), backward=False)
        unit.set_views()

    def _post_forward(self, unit: FlatUnit, output) -> None:
        if self._in_backward:
            return
        if torch.is_grad_enabled():
            for tensor in state_io.tensors_within(output):
                if tensor.requires_grad:
                    tensor.register_hook(lambda grad, u=unit: self._pre_backward(u))
        if unit.shardable and not (torch.is_grad_enabled() and self._forward_phase == "fwd_gather"
                                   and self.order.is_last(unit.index)):
            unit.release()  # the last unit's backward follows at once: it stays gathered for it

    def _pre_backward(self, unit: FlatUnit) -> None:
        if unit.index in self.order.reduced:
            return
        if not unit.gathered:
            if unit.inflight is None:
                self._start_backward_gather(unit)
            self._finish_gather(unit)
        self._prefetch(self.order.before(unit.index), backward=True)

    def _post_accumulate(self, unit: FlatUnit) -> None:
        grad = unit.flat.grad
        unit.flat.grad = None
        unit.pending_bwd_charges = None
        self.order.reduced.add(unit.index)
        self._reduce_gradient(unit, grad)
        if unit.shardable:
            unit.release()

    # -- gradients ----------------------------------------------------------------------------------
    def _reduce_gradient(self, unit: FlatUnit, grad: torch.Tensor) -> None:
        """S-element gradient -> weight group -> stride group (zeropp quantized: node, rail) -> added
        into the fp32 1/g accumulator; in pieces of at most reduce_bucket_size elements, each issued
        now and, with overlap on, finished behind the rest of the backward (grad_reduce.py)."""
        grad = grad.detach().to(self.dtype).reshape(-1)
        bits = self.quant.grad_bits
        if bits:
            if self.hpz:  # qgZ: node hop, then rail hop; the swizzle lands chunk r on rank r
                grad = qgz_swizzle(grad, self.groups.rail.size, self.groups.node.size)
            hops = [(group, unit.residuals.get(name)) for name, group in self._micro_hops()]
        else:  # a hop whose group spans nodes sends boundary_dtype (fp32 with fp32_allreduce)
            hops = [(group, self.boundary_dtype if len(set(map(self.groups.topology.node_of, group.ranks))) > 1
                     else self.dtype) for group in (self.groups.weight, self.groups.stride) if group.size > 1]
        rows = math.prod(group.size for group, _ in hops)
        quantum = self.quant.block if bits else 1
        for a, b in column_ranges(grad.numel() // rows, rows, self.reduce_bucket_elements, quantum):
            if bits:
                chain = quantized_piece_chain(self.qcomm, grad, hops, rows, a, b, "grad_reduce", bits,
                                              residual_scale=self.backward_scale)
            else:
                chain = ladder_chain(self.comm, piece_of(grad, rows, a, b), [g for g, _ in hops], "grad_reduce",
                                     [dtype for _, dtype in hops])
            self.reductions.submit(chain, len(hops), lambda out, a=a, b=b: unit.grad_accum[a:b].add_(out))

    def _gather_up(self, chunk: torch.Tensor, groups: list[RankGroup], phase: str,
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

    def _step_gradient(self, unit: FlatUnit) -> torch.Tensor:
        """The fp32 gradient of the mean loss on this rank's 1/os slice (cross, replica hops)."""
        cross, replica = self.groups.cross, self.groups.replica
        grad = unit.grad_accum
        if cross.size > 1 and self.quant.cross_bits:  # quantized from the fp32 accumulator
            grad = self.qcomm.reduce(grad, [(cross, unit.residuals.get("cross"))], "cross_grad_reduce",
                                     self.quant.cross_bits, residual_scale=self.backward_scale)
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
        scale = self.groups.world_size * self.accumulation_steps * self.backward_scale  # N x A summands
        return grad.float() / scale  # a new tensor: the accumulator itself is zeroed after the step

    @property
    def backward_scale(self) -> float:
        """loss scale / (A x predivide), the factor on a micro-batch's loss before backward: with predivide
        N a sample's gradient is a single process's (same fp16 overflows). EF residuals are stored / it."""
        return self.loss_scale.scale / (self.accumulation_steps * self.predivide)

    # -- the loop's interface -----------------------------------------------------------------------
    def _autocast(self):
        if self.dtype is torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def forward_backward(self, batch: dict) -> torch.Tensor:
        """Forward and backward of one micro-batch; gradients land in the 1/g accumulators."""
        if self.micro_count >= self.accumulation_steps:
            raise EngineError(f"forward_backward called {self.micro_count + 1} times before optimizer_step "
                              f"(gradient_accumulation_steps = {self.accumulation_steps})")
        self.model.train()
        self._forward_phase = "fwd_gather"
        self.order.begin()
        try:
            with self._autocast():
                loss = self.loss_fn(self.model, batch)
            self.order.end_forward()
            self._in_backward = True
            (loss * self.backward_scale).backward()
            self.reductions.drain()  # the accumulators are complete before the next micro-batch
        finally:
            self.reductions.abandon()  # after a failed backward: its partial sums are never read
            self._in_backward = False
            self._forward_phase = "eval_gather"
            self._drain()  # also a unit that took no part in backward must not stay gathered
        self.micro_count += 1
        return loss.detach()

    @torch.no_grad()
    def eval_loss(self, batch: dict) -> torch.Tensor:
        self.model.eval()
        self.order.begin()
        try:
            with self._autocast():
                return self.loss_fn(self.model, batch).detach()
        finally:
            self.order.end_forward()
            self._drain()

    @torch.no_grad()
    def optimizer_step(self, lr: float) -> dict:
        """Reduce, clip, AdamW, refresh. A step whose global norm is not finite (an inf/NaN gradient
        on any rank, every rank sees the same norm) is skipped on all ranks. Returns the global
        pre-clip ``grad_norm``, the ``loss_scale`` this step used and ``skipped_step`` (0 or 1)."""
        if self.micro_count != self.accumulation_steps:
            raise EngineError(f"optimizer_step after {self.micro_count} micro-batches; expected "
                              f"gradient_accumulation_steps = {self.accumulation_steps}")
        scale_used = self.loss_scale.scale
        grads = [self._step_gradient(u) for u in self.units]
        norm = self._global_norm(grads)
        finite = math.isfinite(norm)
        if finite:
            if self.gradient_clipping > 0:
                coef = clip_coefficient(norm, self.gradient_clipping)
                for g in grads:
                    g.mul_(coef)
            self.step_count += 1
            if self.fused_adamw:  # one kernel over every unit's slice
                fused_adamw_update([(u.master, g, u.exp_avg, u.exp_avg_sq, u.decay_ranges)
                                    for u, g in zip(self.units, grads)], lr=lr, step=self.step_count, hyper=self.hyper)
            for unit, grad in zip(self.units, grads):
                if not self.fused_adamw:
                    adamw_update(unit.master, grad, unit.exp_avg, unit.exp_avg_sq, unit.decay_ranges,
                                 lr=lr, step=self.step_count, hyper=self.hyper)
                self._refresh(unit, "refresh")
        else:
            self._reset_residuals()
        self.loss_scale.update(finite)
        if self.qcomm is not None:
            self.qcomm.overflow = False
        for unit in self.units:
            unit.grad_accum.zero_()
            unit.secondary = None  # zeropp: the next step's first gather rebuilds it
        self.micro_count = 0
        return {"grad_norm": norm, "loss_scale": scale_used, "skipped_step": float(not finite)}

    def _global_norm(self, grads: list[torch.Tensor]) -> float:
        """sqrt of the sum of squares over all slices; replica 0 counts, one world all-reduce."""
        world = self.groups.world
        local = sum(float(g.double().square().sum()) for g in grads) if self.groups.replica.index(self.groups.rank) == 0 else 0.0
        if (self.qcomm is not None and self.qcomm.overflow) or local > torch.finfo(torch.float32).max:
            local = math.inf  # a quantized hop met NaN/inf, or beyond fp32 (torch's norm: inf): all skip
        vec = torch.zeros(world.size, dtype=torch.float32, device=self.device)
        vec[world.index(self.groups.rank)] = local
        self.comm.all_reduce(vec, world, "control")
        return math.sqrt(float(vec.double().sum()))

    def _refresh(self, unit: FlatUnit, phase: str) -> None:
        """New weight chunk from the master slice: cast, then all-gather across cross and stride groups
        (the cross hop as INT8 messages quantized from fp32 when refresh_bits = 8)."""
        cross, stride = self.groups.cross, self.groups.stride
        if self.quant.refresh_bits and cross.size > 1:
            partial = torch.empty(unit.master.numel() * cross.size, dtype=self.dtype, device=self.device)
            self.qcomm.gather(partial, unit.master, cross, phase, self.quant.refresh_bits)
            self._gather_up(partial, [stride], phase, out=unit.shard)
            return
        self._gather_up(unit.master.to(self.dtype), [cross, stride], phase, out=unit.shard)

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """Sum over every rank as one float64 world all-reduce padded to a multiple of N (control)."""
        world = self.groups.world
        padded = max(-(-len(values) // world.size) * world.size, world.size)
        buf = torch.zeros(padded, dtype=torch.float64, device=self.device)
        buf[: len(values)] = torch.tensor(values, dtype=torch.float64, device=self.device)
        self.comm.all_reduce(buf, world, "control")
        return buf[: len(values)].tolist()

    def gather_objects(self, obj) -> list:
        """Every rank's picklable ``obj`` in rank order (the checkpoint's piece lists for index.json)."""
        return self.comm.all_gather_object(obj, self.groups.world, "checkpoint")

    def broadcast_object(self, obj):
        """Rank 0's picklable ``obj`` on every rank."""
        return self.comm.broadcast_object(obj, self.groups.world, "checkpoint")

    def comm_metrics(self) -> dict:
        totals = self.comm.sync_ledger()
        self.ledger.reset()
        return ByteLedger.metrics(totals)

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
        that overlap its 1/os optimizer slice are read; the weight chunk is rebuilt by one refresh
        (state_io.load_from_reader, ``weight_chunk="refresh"``)."""
        state_io.load_from_reader(self, reader, weights_only=weights_only)

    def model_state_bytes(self) -> dict[str, int]:
        return state_io.model_state_bytes(self)

    def num_parameters(self) -> int:
        return sum(u.numel for u in self.units)
