"""A model unit's parameters as one padded flat buffer, and the sharded states the engine keeps for it.

The unit's parameters (``named_parameters()`` order) are concatenated into ``flat``, a leaf tensor of
``S`` elements (compute dtype) padded with zeros to a multiple of ``q``; each module attribute that
held a parameter is replaced by a view into ``flat``. When the unit is sharded (w > 1) the storage of
``flat`` is released between uses (``untyped_storage().resize_(0)``) and gathered back into the very
same storage, so views and tensors autograd saved keep pointing at live data with unchanged version
counters (the FSDP1 mechanism).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable, Optional

import torch
from torch import nn

from megatron.topology.layout import ShardLayout, chunk_range


class EngineError(ValueError):
    """A model or call the ZeRO-topo engine cannot handle; one line says what to change."""


class UnitState(Enum):
    """Where a unit's full weights are (megatron/engine/gathering.py moves it between these)."""
    RELEASED = "released"    # ``flat`` has no storage: the rank holds its weight chunk only
    GATHERING = "gathering"  # a gather into ``flat`` was issued and not yet waited for (``inflight``)
    GATHERED = "gathered"    # ``flat`` holds the whole unit (always, for an unsharded unit)


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives in its unit's flat buffer."""
    name: str            # the model's name for it (``named_parameters()`` of the whole model)
    module: nn.Module    # the module that owns the attribute
    attr: str            # attribute name on ``module``
    offset: int          # first element in the flat buffer
    numel: int
    shape: torch.Size
    decay: bool          # weight decay applies (matrices); norms and biases (ndim < 2) get none


def build_slots(unit: nn.Module, names_by_id: dict[int, str]) -> list[ParamSlot]:
    """The unit's parameters in order, each named as the whole model names it."""
    slots, offset = [], 0
    seen: dict[int, str] = {}
    for local_name, param in unit.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            raise EngineError(f"parameter {local_name} is the same tensor as {seen[id(param)]} inside one unit; "
                              "shared parameters are not supported")
        seen[id(param)] = local_name
        owner_path, _, attr = local_name.rpartition(".")
        owner = unit.get_submodule(owner_path) if owner_path else unit
        slots.append(ParamSlot(names_by_id[id(param)], owner, attr, offset, param.numel(), param.shape, param.ndim >= 2))
        offset += param.numel()
    return slots


# materialize(unit_index, unit, keep): give the unit's parameters storage and their initial values (on
# any device; the FlatUnit copies what this rank keeps to the engine's device, then drops them).
# ``keep``: the [lo, hi) ranges of the unit's flat buffer this rank keeps (weight chunk, optimizer
# slice); a materializer that reads weights from files may fill only those and return the checksum
# (``bits_checksum``) the ranks compare instead of the whole unit's (whose other elements then differ
# from rank to rank); else None.
Materialize = Callable[[int, nn.Module, list[tuple[int, int]]], Optional[tuple[int]]]


def shard_units(model: nn.Module, units: list[nn.Module], layout: ShardLayout, rank: int,
                quant_block: Optional[int], dtype: torch.dtype, device: torch.device,
                materialize: Optional[Materialize] = None) -> list["FlatUnit"]:
    """The model's units as FlatUnits, built one at a time: ``materialize(i, unit, keep)`` (when
    given) makes unit i's parameters real right before its FlatUnit copies the rank's slices
    (``keep``), and the full parameters are dropped right after, so the build holds one full unit
    plus the shards. Every parameter must be in exactly one unit."""
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
    if materialize is None and any(p.is_meta for p in model.parameters()):
        raise EngineError("the model has meta parameters but no materialize callback makes them real")
    built = []
    for i, (unit, slots) in enumerate(zip(units, slot_lists)):
        agreed = None
        if materialize is not None:
            size = layout.padded_size(sum(s.numel for s in slots), quant_block)
            factors, chunks = layout.factors, layout.chunks(rank)
            keep = [chunk_range(size, factors.w, chunks.weight), chunk_range(size, factors.os, chunks.opt)]
            agreed = materialize(i, unit, keep)  # the ranges FlatUnit cuts (its weight_range and opt_range)
        built.append(FlatUnit(i, unit, slots, layout, rank, quant_block, dtype, device))
        if agreed is not None:  # only `keep` holds real values: compare what the materializer vouches for
            built[-1].init_checksum = agreed
    return built


class FlatUnit:
    """One unit's flat buffer, its shard of the weights, gradients and optimizer states.

    Tensors held (categories of ``engine.model_state_bytes``): ``flat`` (the full unit, compute
    dtype; no storage while released), ``shard`` (weight chunk S/w; the same storage as ``flat``
    when w == 1), ``secondary`` (zeropp's node-level chunk S/R: compute dtype, or its packed INT8
    message with quantized weights), ``grad_accum`` (fp32 S/g), ``master``, ``exp_avg``,
    ``exp_avg_sq`` (fp32 S/os), ``residuals`` (error feedback: fp32, one per quantized reduction hop,
    the size of that hop's input; set by the engine).
    """

    def __init__(self, index: int, module: nn.Module, slots: list[ParamSlot], layout: ShardLayout, rank: int,
                 quant_block: Optional[int], dtype: torch.dtype, device: torch.device):
        """``quant_block``: the quantization block when any collective is quantized, else None (it
        changes the padding quantum: ``ShardLayout.padding_quantum``)."""
        self.index, self.module, self.slots = index, module, slots
        self.numel = sum(s.numel for s in slots)
        self.size = layout.padded_size(self.numel, quant_block)
        factors, chunks = layout.factors, layout.chunks(rank)
        self.dtype = dtype
        self.weight_range = chunk_range(self.size, factors.w, chunks.weight)
        self.grad_range = chunk_range(self.size, factors.g, chunks.grad)
        self.opt_range = chunk_range(self.size, factors.os, chunks.opt)
        self.shardable = factors.w > 1
        self.decay_ranges = _decay_ranges(slots, self.opt_range)

        # Only this rank's pieces go to the engine's device, copied straight from the parameters (on
        # the host, for a unit made real by the build's materializer): the weight chunk and the
        # optimizer slice, not the whole unit (at 20B ~80 GB less per rank), and no staging copy.
        params = [getattr(slot.module, slot.attr).detach() for slot in slots]
        self.init_checksum = bits_checksum(params)  # ranks must agree
        self.master = _pieces(slots, params, self.opt_range, torch.float32, device)
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self.grad_accum = torch.zeros(self.grad_range[1] - self.grad_range[0], dtype=torch.float32, device=device)
        self.secondary: Optional[torch.Tensor] = None
        self.residuals: dict[str, torch.Tensor] = {}
        if self.shardable:
            self.flat = torch.empty(self.size, dtype=dtype, device=device).requires_grad_(True)
            self.shard = _pieces(slots, params, self.weight_range, dtype, device)
            self.release()
        else:  # the whole unit is this rank's weight chunk
            self.flat = _pieces(slots, params, (0, self.size), dtype, device).requires_grad_(True)
            self.shard = self.flat.data
        del params
        for slot in slots:  # the module attributes become plain tensors (views set by set_views)
            del slot.module._parameters[slot.attr]
        self.state = UnitState.GATHERED if not self.shardable else UnitState.RELEASED
        self.views_track_grad = False  # the module attributes were made with grad on (set_views)
        self._view_targets: Optional[list] = None  # (module __dict__, attribute, shape or None) per slot
        self._split_sizes: list[int] = []
        self.inflight = None          # the issued gather while GATHERING (schedules.InflightGather)
        self.recomputes = False       # learned in backward: autograd re-runs this unit (activation checkpointing)
        self.pending_bwd_charges: Optional[dict] = None  # a backward gather not yet known to be a recompute

    # -- the full buffer ------------------------------------------------------------------------
    def allocate(self) -> torch.Tensor:
        """Give ``flat`` its storage back (contents undefined) and return a tensor aliasing it."""
        storage = self.flat.untyped_storage()
        nbytes = self.size * self.flat.element_size()
        if storage.size() != nbytes:
            storage.resize_(nbytes)
        return self.flat.data

    def release(self) -> None:
        self.flat.untyped_storage().resize_(0)
        self.state = UnitState.RELEASED

    @property
    def gathered(self) -> bool:
        return self.state is UnitState.GATHERED

    def set_views(self) -> None:
        """Point every module attribute at its slice of ``flat`` (autograd-tracked when grad is on).
        Made again for every forward: the views' autograd nodes must be younger than the ops before
        them, or autograd, which runs the youngest ready node first, would accumulate ``flat``'s
        gradient (and so reduce it and release the unit) only at the very end of the backward.
        Runs per unit and pass: one split, a view per matrix, the targets worked out once."""
        if self._view_targets is None:
            self._split_sizes = [s.numel for s in self.slots] + ([self.size - self.numel] if self.size > self.numel else [])
            self._view_targets = [(s.module.__dict__, s.attr, None if len(s.shape) == 1 else s.shape) for s in self.slots]
        for (attrs, attr, shape), piece in zip(self._view_targets, torch.split_with_sizes(self.flat, self._split_sizes)):
            attrs[attr] = piece if shape is None else piece.view(shape)
        self.views_track_grad = torch.is_grad_enabled()

    def param_views(self, full: torch.Tensor) -> dict[str, torch.Tensor]:
        """Parameters by name as views of a full (S-element) buffer."""
        return {s.name: full[s.offset: s.offset + s.numel].view(s.shape) for s in self.slots}

    def layout(self) -> list[tuple[str, int, int, tuple[int, ...]]]:
        """(name, offset in the flat buffer, numel, shape) of every parameter."""
        return [(s.name, s.offset, s.numel, tuple(s.shape)) for s in self.slots]

    def slice_map(self) -> list[tuple[str, int, int]]:
        """(name, first element inside the parameter, length) of the parameter pieces in this rank's
        optimizer slice, in slice order. The pieces are contiguous from the slice's first element
        (padding exists only at the unit's tail, after them)."""
        start, end = self.opt_range
        out = []
        for s in self.slots:
            lo, hi = max(start, s.offset), min(end, s.offset + s.numel)
            if lo < hi:
                out.append((s.name, lo - s.offset, hi - lo))
        return out


def _pieces(slots: list[ParamSlot], params: list[torch.Tensor], span: tuple[int, int], dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
    """Elements [lo, hi) of the unit's flat buffer, copied from its parameters into a new tensor of
    ``dtype`` on ``device`` (the padding at the unit's tail stays zero)."""
    lo, hi = span
    out = torch.empty(hi - lo, dtype=dtype, device=device)
    filled = lo
    for slot, param in zip(slots, params):
        a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
        if a < b:
            out[a - lo: b - lo].copy_(param.reshape(-1)[a - slot.offset: b - slot.offset])
            filled = b
    out[filled - lo:].zero_()
    return out


def bits_checksum(tensors) -> tuple[int]:
    """The wrapping int64 sum of the tensors' bits, taken as 64-bit words (one pass at memory speed:
    0.07 s for a 20B block's 453 M fp32 elements, against 1.7 s as 32-bit words and 5 s as float64
    sums): equal on ranks whose tensors hold the same bits, and different for another seed's draws
    but by a coincidence of 1 in 2**64. The build's materializer vouches for its draws with it."""
    total = 0
    for t in tensors:
        flat = t.detach().reshape(-1)
        if flat.element_size() != 4:
            flat = flat.float()
        words = flat.view(torch.int32)
        even = words.numel() - words.numel() % 2
        try:
            total += int(words[:even].view(torch.int64).sum())
        except RuntimeError:  # a view that does not start on an 8-byte boundary
            total += int(words[:even].sum(dtype=torch.int64))
        if even < words.numel():
            total += int(words[-1])
    return ((total + 2 ** 63) % 2 ** 64 - 2 ** 63,)


def _decay_ranges(slots: list[ParamSlot], opt_range: tuple[int, int]) -> list[tuple[int, int]]:
    """Runs [a, b) of the optimizer slice (slice-relative) that get weight decay, merged."""
    start, end = opt_range
    runs: list[tuple[int, int]] = []
    for s in slots:
        lo, hi = max(start, s.offset), min(end, s.offset + s.numel)
        if s.decay and lo < hi:
            if runs and runs[-1][1] == lo - start:
                runs[-1] = (runs[-1][0], hi - start)
            else:
                runs.append((lo - start, hi - start))
    return runs


def tensors_within(value) -> list[torch.Tensor]:
    """Every tensor in a tensor, or nested lists/tuples/dicts of them (unit outputs, unit attributes)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_within(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_within(v)]
    return []
