"""From a validated config to a running engine, in the documented order:
the plan (``zero_optimization.plan: auto``, megatron/analytic/planner.py) -> shard layout + topology -> process groups -> communicator (+ ledger) -> quantization settings -> engine.

The trainer calls ``engine_from_config`` once after ``init_process_group``; nothing here is global.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from megatron.logging.metrics import log_print
from megatron.loss_scale import LossScaleSettings
from megatron.topology import ProcessGroups, ShardLayout, Topology, TopologyError
from megatron.topology.layout import tiers_of
from megatron.engine.comm import Communicator
from megatron.engine.zero_topo import Materialize, ZeroTopoEngine
from megatron.analytic.model_inputs import figures_note
from megatron.analytic.planner import planned_config
from megatron.engine.quantized import QuantSettings


def engine_from_config(cfg, model: nn.Module, loss_fn: Callable, world_size: int,
                       topology: Optional[Topology] = None, units: Optional[list[nn.Module]] = None,
                       device: Optional[torch.device] = None,
                       materialize: Optional[Materialize] = None) -> ZeroTopoEngine:
    """Build the ZeRO-topo engine for ``model`` from ``cfg`` (a validated ``NeoXConfig``).

    ``topology`` defaults to ``Topology.from_config(cfg, world_size)``; ``units`` to ``model.units()``;
    ``device`` to the parameters' device. A model built on the meta device needs ``device`` and
    ``materialize`` (see ZeroTopoEngine): its units are then made real one at a time.
    """
    cfg, plan = planned_config(cfg, world_size)  # plan: auto chooses the layout here, the same on every rank
    zero = cfg.zero
    quant = QuantSettings.from_config(zero)  # the effective bits, derived here only
    layout, topology = layout_and_topology(cfg, world_size, topology)
    groups = ProcessGroups.build(topology, layout.factors)
    if plan is not None:
        log_print(f"zero_optimization.plan auto chose {plan.reason()}", groups.rank)
        note = figures_note(cfg)
        if note:
            log_print(note, groups.rank)
    device = device or next(model.parameters()).device
    comm = Communicator(groups, device=device)
    if quant.enabled:
        log_print(f"quantized collectives: {quant.summary()}", groups.rank)
    accumulation = cfg.training.gradient_accumulation_steps or 1
    engine = ZeroTopoEngine(model, units if units is not None else model.units(), loss_fn, cfg.optimizer,
                          cfg.precision.precision, groups, comm, accumulation, preset=layout.preset,
                          fp32_allreduce=bool(cfg.precision.fp32_allreduce), quant=quant,
                          cross_node_reduction=zero.cross_node_reduction,
                          prefetch=bool(zero.prefetch_gathers), device=device, materialize=materialize,
                          loss_scaling=LossScaleSettings.from_config(cfg.precision),
                          overlap_reduce=bool(zero.overlap_comm), reduce_bucket_elements=int(zero.reduce_bucket_size),
                          reduce_buckets_in_flight=int(zero.reduce_buckets_in_flight),
                          gradient_predivide_factor=cfg.precision.gradient_predivide_factor)
    if quant.error_feedback and not any(unit.residuals for unit in engine.units):
        log_print("quantization_error_feedback: no residual is kept in this layout (error feedback "
                  "corrects only a quantized gradient hop across nodes that follows the node's "
                  "reduction: zero_topo's cross hop, zeropp's second qgZ hop)", groups.rank)
    return engine


def layout_and_topology(cfg, world_size: int, topology: Optional[Topology] = None) -> tuple[ShardLayout, Topology]:
    """The run's shard layout (``ShardLayout.from_config``) and its topology (link figures, rank
    coordinates; default ``Topology.from_config``), checked to describe the same tiers."""
    layout = ShardLayout.from_config(cfg)
    topology = topology or Topology.from_config(cfg, world_size)
    if tiers_of(topology) != layout.tiers:
        raise TopologyError(f"topology {topology.name} has tiers {list(tiers_of(topology))} (slowest first) but "
                            f"the config's layout is {list(layout.tiers)}")
    return layout, topology
