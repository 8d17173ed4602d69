"""The ZeRO-topo engine's states in and out (``engine``: a megatron.engine.zero_topo.ZeroTopoEngine): full parameters by name, this rank's parameter pieces for
checkpoints (megatron.checkpointing.param_slices), and the bytes of model states held per rank.

Gathers made here are charged to the ledger phase ``checkpoint`` (outside the per-step model).
Loading: ``load_from_reader`` (the training path) reads, through a
megatron.checkpointing.reader.CheckpointReader, only this rank's optimizer slice out of the rank
files whose pieces overlap it and rebuilds the weight chunk by one refresh, so a checkpoint written
with any (w, g, os) or world size loads without any rank building full tensors;
``load_full_state`` / ``load_full_state_dict`` cut the same slices from full tensors (tools, tests).

Error-feedback residuals (quantized reductions) are per-rank state that no layout change can map:
each rank saves its own under the extra entry ``error_feedback`` with the layout they belong to, and
they are restored only into the same layout (world size, factors, preset, block, bits, unit sizes);
otherwise they restart from zero with a one-line notice.
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron.checkpointing.param_slices import HELD_WEIGHTS, PER_RANK, check_shapes, make_engine_state
from megatron.logging.metrics import log_print
from megatron.topology.names import MEMORY_CATEGORIES
from megatron.engine.flat_unit import EngineError, FlatUnit, tensors_within


@torch.no_grad()
def full_state_dict(engine) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for unit in engine.units:
        full = engine.collectives.gather_full(unit.master)
        out.update({name: view.clone() for name, view in unit.param_views(full).items()})
    for name, buf in engine.model.state_dict().items():  # persistent buffers (parameters are ours)
        out.setdefault(name, buf.detach().float().clone())
    return out


def checkpoint_state(engine) -> dict:
    """This rank's fp32 master and moments as parameter pieces (megatron.checkpointing.param_slices);
    no collective. Replicas hold identical slices, so only the first replica writes pieces (hsdp and
    DDP checkpoints are then no larger than the model states)."""
    pieces, shapes = [], {}
    first_replica = engine.groups.replica.index(engine.groups.rank) == 0
    delta = bool(engine.quant.weight_delta_bits)  # the weights the deltas are taken against travel too
    for unit in engine.units:
        shapes.update({name: shape for name, _offset, _numel, shape in unit.layout()})
        if not first_replica:
            continue
        pos = 0  # the pieces sit back to back from the slice's first element
        held = engine.collectives.held_weights(unit, *unit.opt_range) if delta else None  # compute dtype: exact
        for name, start, length in unit.slice_map():
            pieces.append({"name": name, "offset": start, "length": length,
                           **{key: getattr(unit, key)[pos:pos + length].detach().cpu().clone()
                              for key in ("master", "exp_avg", "exp_avg_sq")}})
            if held is not None:
                pieces[-1][HELD_WEIGHTS] = held[pos:pos + length].cpu().clone()
            pos += length
    # What the layout was, for readers; loading never needs it (any layout loads any checkpoint).
    # preset: ShardLayout's name (checkpoints before it wrote None for explicit factors, now "custom").
    extra = {"loss_scaler": engine.loss_scale.state_dict(), "factors": list(engine.layout.factors.as_tuple()),
             "preset": engine.layout.preset, "weight_delta": delta}
    if any(unit.residuals for unit in engine.units):
        extra["error_feedback"] = {"layout": residual_layout(engine), "rank": engine.groups.rank,
                                   "residuals": [{hop: r.detach().cpu().clone() for hop, r in unit.residuals.items()}
                                                 for unit in engine.units]}
    return make_engine_state(pieces, shapes, engine.step_count, extra)


def load_full_state(engine, full: dict) -> None:
    """Load what `param_slices.assemble` rebuilt from a checkpoint of any layout."""
    check_shapes(full["shapes"], {name: shape for u in engine.units for name, _o, _n, shape in u.layout()},
                 "being loaded")
    load_full_state_dict(engine, full["params"], {"step": full["step"], "exp_avg": full["exp_avg"],
                                                  "exp_avg_sq": full["exp_avg_sq"]})
    if full.get("loss_scaler"):
        engine.loss_scale.load_state_dict(full["loss_scaler"])
    if int(full["step"]) > 0:  # step 0: a fresh optimizer (finetune), residuals stay zero
        restore_residuals(engine, full.get("error_feedback"))


@torch.no_grad()
def load_from_reader(engine, reader, weights_only: bool = False) -> None:
    """This rank's slices from a checkpoint reader, reading only the pieces that overlap them.

    Per unit and slot: master and both moments of the part inside ``opt_range`` fill
    ``master``/``exp_avg``/``exp_avg_sq``; padding stays zero. The weight chunk (``shard``) is
    rebuilt from the loaded master slices by the engine's own refresh (cross, stride all-gathers,
    charged to ``checkpoint``), so only the 1/os slices are read from the files: reading the weight
    chunk instead would be half the model per rank with w = 2, 41 GB of fp32 reads at 20B against
    0.2 GB (docs/checkpoints.md).
    ``weights_only`` (finetune): moments zero and step 0. Loss scale, step and error-feedback
    residuals follow ``load_full_state``'s rules; the residuals come from this rank's own file only.
    """
    check_shapes(reader.shapes, {name: shape for u in engine.units for name, _o, _n, shape in u.layout()},
                 str(reader.step_dir))
    keys = ("master",) if weights_only else ("master", "exp_avg", "exp_avg_sq")
    resume_held = bool(engine.quant.weight_delta_bits and reader.shared.get("weight_delta") and not weights_only)
    for unit in engine.units:
        o_lo, o_hi = unit.opt_range
        opt = {key: torch.zeros(o_hi - o_lo, dtype=torch.float32) for key in ("master", "exp_avg", "exp_avg_sq")}
        for slot in unit.slots:
            _read_overlap(reader, slot, o_lo, o_hi, opt, keys)
        for key, values in opt.items():
            getattr(unit, key).copy_(values.to(unit.master.device))
        if resume_held:  # a weight-delta run continues from the weights it held, not the master's cast
            held = torch.zeros(o_hi - o_lo, dtype=torch.float32)
            for slot in unit.slots:
                _read_overlap(reader, slot, o_lo, o_hi, {HELD_WEIGHTS: held}, (HELD_WEIGHTS,))
            engine.collectives.rebuild_weights(unit, held.to(unit.master.device), "checkpoint")
        else:
            engine.collectives.refresh(unit, "checkpoint")  # what every optimizer step ends with
        _reset_transient(unit)
        for residual in unit.residuals.values():
            residual.zero_()
    step = 0 if weights_only else int(reader.step)
    engine.step_count = step
    scaler = reader.shared.get("loss_scaler")
    if scaler:
        engine.loss_scale.load_state_dict(scaler)
    if step > 0:  # step 0: a fresh optimizer (finetune), residuals stay zero
        restore_residuals(engine, _residual_entry(engine, reader))


def _read_overlap(reader, slot, lo: int, hi: int, out: dict[str, torch.Tensor], keys) -> None:
    """Fill ``out[key][a - lo: b - lo]`` with the slot's elements in [lo, hi) of the unit's buffer."""
    a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
    if a < b:
        reader.read(slot.name, a - slot.offset, b - slot.offset, keys,
                    out={key: out[key][a - lo: b - lo] for key in keys})


def _residual_entry(engine, reader):
    """What ``restore_residuals`` decides from, read from the index, and this rank's own file only
    when the residuals can be restored (every rank file carries them, same world size, this run
    keeps residuals). Every rank gets an entry of the same kind, so all decide alike."""
    carriers = reader.ranks_with(PER_RANK)
    if not carriers:
        return None                       # "the checkpoint has none"
    if not any(unit.residuals for unit in engine.units):
        return [None] * len(carriers)     # "ignored: error feedback is off" (nothing opened)
    world, rank = engine.groups.world_size, engine.groups.rank
    if reader.world_size != world:        # "the layout changed", known from the index alone
        return [{"layout": {"world_size": reader.world_size}}] * world
    if len(carriers) != world:
        return []                         # "does not carry every rank's residuals"
    entry = [None] * world
    entry[rank] = reader.rank_entry(rank, PER_RANK)
    return entry


def residual_layout(engine) -> dict:
    """What the residuals' shapes and meaning depend on: equal layouts -> restore exactly."""
    q = engine.quant
    return {"world_size": engine.groups.world_size, "factors": list(engine.groups.factors.as_tuple()),
            "preset": engine.preset, "block": q.block_size, "grad_bits": q.grad_reduce_bits,
            "cross_bits": q.cross_node_grad_bits, "rotation": q.gradient_rotation,
            "unit_sizes": [u.size for u in engine.units]}


def _saved_layout(saved: Optional[dict]) -> Optional[dict]:
    """A saved residual layout in today's names: explicit factors were saved as preset None before
    the layout had a name for them ("custom"), and layouts before the gradient rotation existed
    held unrotated residuals ("none")."""
    if not saved:
        return saved
    return {**saved, "preset": saved.get("preset") or "custom", "rotation": saved.get("rotation", "none")}


@torch.no_grad()
def restore_residuals(engine, entry) -> bool:
    """Copy this rank's saved residuals back when the layout is unchanged; else leave them zero.

    ``entry`` is a list indexed by rank (every rank's ``error_feedback``) or one rank's dict (usable
    by a one-rank run only). Every rank sees the same entry, so all ranks decide alike. Returns
    whether the residuals were restored.
    """
    rank = engine.groups.rank
    if not any(unit.residuals for unit in engine.units):
        if entry:
            log_print("checkpoint error-feedback residuals ignored: error feedback is off in this run", rank)
        return False
    layout, world = residual_layout(engine), engine.groups.world_size
    mine = None
    if isinstance(entry, (list, tuple)) and len(entry) == world:
        mine = entry[rank]
    elif isinstance(entry, dict) and world == 1:
        mine = entry
    reason = None
    if entry is None:
        reason = "the checkpoint has none"
    elif mine is None:
        reason = "the checkpoint does not carry every rank's residuals"
    elif _saved_layout(mine.get("layout")) != layout or mine.get("rank") != rank:
        reason = "the layout changed (world size, shard factors, block or bits), so they do not line up"
    else:
        saved = mine["residuals"]
        if len(saved) == len(engine.units) and all(
                set(s) == set(u.residuals) and all(s[h].shape == u.residuals[h].shape for h in s)
                for s, u in zip(saved, engine.units)):
            for s, unit in zip(saved, engine.units):
                for hop, residual in unit.residuals.items():
                    residual.copy_(s[hop])
            return True
        reason = "their shapes differ from this run's hops"
    log_print(f"error-feedback residuals reset to zero: {reason}", rank)
    return False


@torch.no_grad()
def load_full_state_dict(engine, params: dict[str, torch.Tensor],
                         optimizer: Optional[dict] = None) -> None:
    """Every rank cuts its slices from full tensors by name (local; any previous layout).

    ``optimizer`` (optional) is ``{"step": int, "exp_avg": {name: T}, "exp_avg_sq": {name: T}}``.
    """
    for unit in engine.units:
        full = _assemble(unit, params, "parameter")
        unit.master.copy_(full[slice(*unit.opt_range)])
        # What a refresh would hand this rank (with a quantized refresh, the dequantized INT8 values:
        # the chunks are whole blocks, so quantizing the whole range gives the same codes), rebuilt
        # locally, so a resumed run continues exactly.
        unit.shard.copy_(engine.collectives.refreshed_weights(full[slice(*unit.weight_range)]))
        for key in ("exp_avg", "exp_avg_sq"):
            moment = _assemble(unit, optimizer[key], key) if optimizer else torch.zeros(unit.size)
            getattr(unit, key).copy_(moment[slice(*unit.opt_range)])
        _reset_transient(unit)
        for residual in unit.residuals.values():  # per-rank state a parameter load cannot supply
            residual.zero_()
    engine.step_count = int(optimizer["step"]) if optimizer else 0


def _assemble(unit: FlatUnit, tensors: dict[str, torch.Tensor], what: str) -> torch.Tensor:
    full = torch.zeros(unit.size, dtype=torch.float32)
    for slot in unit.slots:
        if slot.name not in tensors:
            raise EngineError(f"{what} {slot.name} is missing from the state to load")
        value = tensors[slot.name]
        if tuple(value.shape) != tuple(slot.shape):
            raise EngineError(f"{what} {slot.name} has shape {tuple(value.shape)}, the model expects {tuple(slot.shape)}")
        full[slot.offset: slot.offset + slot.numel] = value.detach().reshape(-1).float().cpu()
    return full.to(unit.master.device)


def _reset_transient(unit: FlatUnit) -> None:
    unit.grad_accum.zero_()
    unit.secondary = None
    if unit.shardable and unit.gathered:
        unit.release()


# ---------------------------------------------------------------------------------------------------
# Memory of model states
# ---------------------------------------------------------------------------------------------------

CATEGORY_OF_ATTR = {"flat": "weights", "shard": "weights", "secondary": "secondary", "grad_accum": "grad_accumulator",
                    "master": "master", "exp_avg": "moments", "exp_avg_sq": "moments", "residuals": "error_feedback"}
CATEGORIES = MEMORY_CATEGORIES[:-1]  # + error_feedback when on


def model_state_bytes(engine) -> dict[str, int]:
    """Bytes of every tensor the engine holds, by category, each storage counted once.

    Walks the attributes of the engine's units (tensors, and tensors in lists/dicts); a tensor whose
    attribute has no category lands in ``other`` so a leak shows up. A released ``flat`` counts 0.
    """
    totals = {c: 0 for c in CATEGORIES}
    if any(unit.residuals for unit in engine.units):
        totals["error_feedback"] = 0
    seen: set[tuple[int, int]] = set()

    def add(category: str, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if storage.nbytes() == 0 or key in seen:
            return
        seen.add(key)
        totals[category] = totals.get(category, 0) + storage.nbytes()

    for unit in engine.units:
        for attr, value in vars(unit).items():
            for tensor in tensors_within(value):
                add(CATEGORY_OF_ATTR.get(attr, "other"), tensor)
            if attr == "flat" and value.grad is not None:
                add("other", value.grad)
    return totals
