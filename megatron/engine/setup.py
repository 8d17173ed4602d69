"""From a validated config to a running engine, in the documented order: the plan
(``zero_optimization.plan: auto``, megatron/analytic/planner.py) -> the run's one shard layout ->
topology -> process groups -> communicator (+ ledger) -> settings -> engine.

The trainer calls ``engine_from_config`` once after ``init_process_group``; nothing here is global.
The layout is built here once and reaches everything else through ``groups.layout``.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from megatron.analytic.model_inputs import figures_note
from megatron.analytic.planner import planned_config
from megatron.engine.comm import Communicator
from megatron.engine.flat_unit import Materialize
from megatron.engine.settings import EngineSettings
from megatron.engine.zero_topo import ZeroTopoEngine
from megatron.logging.metrics import log_print
from megatron.topology import ProcessGroups, ShardLayout, Topology


def engine_from_config(cfg, model: nn.Module, loss_fn: Callable, world_size: int,
                       topology: Optional[Topology] = None, units: Optional[list[nn.Module]] = None,
                       device: Optional[torch.device] = None,
                       materialize: Optional[Materialize] = None) -> ZeroTopoEngine:
    """Build the ZeRO-topo engine for ``model`` from ``cfg`` (a validated ``NeoXConfig``).

    ``topology`` defaults to ``Topology.from_config(cfg, world_size)``; ``units`` to ``model.units()``;
    ``device`` to the parameters' device. A model built on the meta device needs ``device`` and
    ``materialize`` (see megatron/engine/flat_unit.py): its units are then made real one at a time.
    """
    cfg, plan = planned_config(cfg, world_size)  # plan: auto chooses the layout here, the same on every rank
    layout = plan.best.candidate.layout if plan is not None else ShardLayout.from_config(cfg)
    groups = ProcessGroups.build(topology or Topology.from_config(cfg, world_size), layout)
    if plan is not None:
        log_print(f"zero_optimization.plan auto chose {plan.reason()}", groups.rank)
        note = figures_note(cfg)
        if note:
            log_print(note, groups.rank)
    device = device or next(model.parameters()).device
    comm = Communicator(groups, device=device)
    settings = EngineSettings.from_config(cfg)
    if settings.quant.enabled:
        log_print(f"quantized collectives: {settings.quant.summary()}", groups.rank)
    engine = ZeroTopoEngine(model, loss_fn, groups, comm, settings, units=units, device=device, materialize=materialize)
    if settings.quant.error_feedback and not any(unit.residuals for unit in engine.units):
        log_print("quantization_error_feedback: no residual is kept in this layout (error feedback "
                  "corrects only a quantized gradient hop across nodes that follows the node's "
                  "reduction: zero_topo's cross hop, zeropp's second qgZ hop)", groups.rank)
    return engine
