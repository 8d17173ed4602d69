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
from megatron.engine.flat_unit import EngineError, Materialize
from megatron.engine.settings import EngineSettings
from megatron.engine.zero_topo import ZeroTopoEngine
from megatron.logging.metrics import log_print
from megatron.topology import ProcessGroups, ShardLayout, Topology


def layout_from_config(cfg, world_size: int):
    """(cfg, the run's ShardLayout, the plan or None): ``plan: auto`` chooses the layout here, the
    same on every rank."""
    cfg, plan = planned_config(cfg, world_size)
    return cfg, (plan.best.candidate.layout if plan is not None else ShardLayout.from_config(cfg)), plan


def engine_from_config(cfg, model: nn.Module, loss_fn: Callable, world_size: int,
                       topology: Optional[Topology] = None, units: Optional[list[nn.Module]] = None,
                       device: Optional[torch.device] = None,
                       materialize: Optional[Materialize] = None,
                       groups: Optional[ProcessGroups] = None) -> ZeroTopoEngine:
    """Build the ZeRO-topo engine for ``model`` from ``cfg`` (a validated ``NeoXConfig``).

    ``topology`` defaults to ``Topology.from_config(cfg, world_size)``; ``units`` to ``model.units()``;
    ``device`` to the parameters' device. A model built on the meta device needs ``device`` and
    ``materialize`` (see megatron/engine/flat_unit.py): its units are then made real one at a time.
    ``groups``: the process groups, already built on the run's layout (the rehearsal times them apart).
    """
    cfg, layout, plan = layout_from_config(cfg, world_size)
    if groups is None:
        groups = ProcessGroups.build(topology or Topology.from_config(cfg, world_size), layout)
    elif groups.layout != layout:
        raise ValueError(f"the groups were built on {groups.layout}, the config's layout is {layout}")
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
        check_kernels_per_node(settings, groups, comm, device)
    engine = ZeroTopoEngine(model, loss_fn, groups, comm, settings, units=units, device=device, materialize=materialize)
    if settings.quant.error_feedback and not any(unit.residuals for unit in engine.units):
        log_print("quantization_error_feedback: no residual is kept in this layout (error feedback "
                  "corrects only a quantized gradient hop across nodes that follows the node's "
                  "reduction: zero_topo's cross hop, zeropp's second qgZ hop)", groups.rank)
    return engine


def check_kernels_per_node(settings: EngineSettings, groups: ProcessGroups, comm: Communicator,
                           device: torch.device) -> None:
    """Before step 1, each node's first local rank runs the quantization kernels the run will use on a
    few bit-exact cases on its device (``megatron.ops.quant.selfcheck.startup_check``: on a GPU this
    compiles the Triton kernels too); one world sum shares the verdict, so either every rank stops
    with one line naming ``zero_optimization.quantization_impl``, or none does. The meta device (a
    rehearsal) has no values to check."""
    from megatron.ops.quant.selfcheck import startup_check
    if device.type == "meta":
        return
    failure = None
    if groups.rank % groups.topology.ranks_per_node == 0:
        failure = startup_check(settings.quant.impl, device, settings.quant.block_size)
    failed_nodes = comm.world_sum([1.0 if failure else 0.0])[0][0]
    if failed_nodes:
        raise EngineError(failure or f"the quantization kernels failed their start-up check on {int(failed_nodes)} "
                                     "node(s); each node's first rank names the failure and "
                                     "zero_optimization.quantization_impl values that select other kernels")
