"""When each unit's weights are gathered and released: the state machine behind the engine's hooks.

A unit is RELEASED (its weight chunk only), GATHERING (a gather issued, not yet waited for) or
GATHERED (``UnitState``). The hooks (installed by the engine) call, in this order per unit:

- ``pre_forward``: gather if not gathered (or finish a prefetched gather), then point the module's
  attributes at ``flat``. Inside the engine's own backward a forward is autograd recomputing a
  checkpointed unit: a re-entrant checkpoint reaches it released (gather, phase
  ``recompute_gather``), a non-re-entrant one after ``pre_backward`` gathered it as ``bwd_gather``
  (that charge is moved to ``recompute_gather`` once; the unit is remembered as recomputing and its
  later gathers are charged right away).
- ``post_forward``: outside backward, release, and hook the outputs so the unit's backward gathers
  it first; the last unit of a training forward stays gathered (its backward follows at once).
  During a recompute it stays gathered for the backward that follows.
- ``pre_backward``: gather (or finish the prefetched gather) unless the gradient was reduced.
- ``after_reduce``: the gradient is reduced: release.

Prefetch (``prefetch=True``): each hook that gathers a unit also issues, asynchronously, the gather
of the unit that runs next (forward: the next unit; backward and recompute: the previous one;
prefetch.py says which). It is charged when issued, under the phase it would have had, and waited
for in that unit's own hook, so the ledger is unchanged; at most two sharded units are gathered or
in flight. Every pass ends with ``drain``: nothing stays in flight or gathered.
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron.engine.flat_unit import FlatUnit, UnitState, tensors_within
from megatron.engine.ledger import ByteLedger
from megatron.engine.prefetch import PassOrder
from megatron.engine.schedules import LadderSchedule


class UnitGathers:
    """The units' gather / release state machine (module docstring)."""

    def __init__(self, units: list[FlatUnit], schedule: LadderSchedule, ledger: ByteLedger, prefetch: bool):
        self.units, self.schedule, self.ledger, self.prefetch = units, schedule, ledger, prefetch
        self.order = PassOrder(len(units))
        self.in_backward = False          # inside the engine's backward: a unit forward is a recompute
        self.forward_phase = "eval_gather"

    # -- passes -----------------------------------------------------------------------------------
    def begin_pass(self, training: bool) -> None:
        self.order.begin()
        self.forward_phase = "fwd_gather" if training else "eval_gather"

    def end_forward(self) -> None:
        """The pass's forward is over: its order guides the next forward's prefetch."""
        self.order.end_forward()

    def begin_backward(self) -> None:
        self.in_backward = True

    def end_pass(self) -> None:
        """No gather stays in flight and no sharded unit stays gathered (also after a failure)."""
        self.in_backward = False
        self.forward_phase = "eval_gather"
        for unit in self.units:
            unit.pending_bwd_charges = None
            if unit.state is UnitState.GATHERING:
                self._finish(unit)
            if unit.shardable and unit.state is UnitState.GATHERED:
                unit.release()

    # -- hooks ------------------------------------------------------------------------------------
    def pre_forward(self, unit: FlatUnit) -> None:
        if self.in_backward:  # autograd recomputing a checkpointed unit
            if not unit.gathered:
                self._gather(unit, "recompute_gather")
            if unit.pending_bwd_charges is not None:
                self.ledger.move(unit.pending_bwd_charges, "bwd_gather", "recompute_gather")
                unit.pending_bwd_charges = None
            unit.recomputes = True
            self._prefetch(self.order.before(unit.index), backward=True)
            # A non-re-entrant checkpoint recomputes values only (its gradients flow through the
            # forward's nodes): the forward's views, over the same storage gathered again, serve.
            # A re-entrant one ran its forward without grad and backpropagates the recompute: remake.
            if unit.views_track_grad:
                return
        else:
            self.order.visit(unit.index)
            if not unit.gathered:
                self._gather(unit, self.forward_phase)
            self._prefetch(self.order.after(unit.index), backward=False)
        unit.set_views()

    def post_forward(self, unit: FlatUnit, output) -> None:
        if self.in_backward:
            return
        training = torch.is_grad_enabled()
        if training:
            for tensor in tensors_within(output):
                if tensor.requires_grad:
                    tensor.register_hook(lambda grad, u=unit: self.pre_backward(u))
        if unit.shardable and not (training and self.forward_phase == "fwd_gather" and self.order.is_last(unit.index)):
            unit.release()  # the last unit's backward follows at once: it stays gathered for it

    def pre_backward(self, unit: FlatUnit) -> None:
        if unit.index in self.order.reduced:
            return
        if not unit.gathered:
            if unit.state is UnitState.RELEASED:
                self._start_backward(unit)
            self._finish(unit)
        self._prefetch(self.order.before(unit.index), backward=True)

    def after_reduce(self, unit: FlatUnit) -> None:
        unit.pending_bwd_charges = None
        self.order.reduced.add(unit.index)
        if unit.shardable:
            unit.release()

    # -- gathers ----------------------------------------------------------------------------------
    def _start(self, unit: FlatUnit, phase: str) -> dict[str, int]:
        """Issue the unit's gather (charged now); ``_finish`` waits for it. Returns the charges."""
        unit.inflight = self.schedule.start_gather(unit, phase)
        unit.state = UnitState.GATHERING
        return unit.inflight.charges

    def _finish(self, unit: FlatUnit) -> dict[str, int]:
        inflight, unit.inflight = unit.inflight, None
        inflight.pending.wait()
        if inflight.finish is not None:
            inflight.finish()
        unit.state = UnitState.GATHERED
        return inflight.charges

    def _gather(self, unit: FlatUnit, phase: str) -> None:
        """Gather now: finish an in-flight (prefetched) gather, else issue one and wait for it."""
        if unit.state is UnitState.RELEASED:
            self._start(unit, phase)
        self._finish(unit)

    def _start_backward(self, unit: FlatUnit) -> None:
        """A backward gather is charged ``bwd_gather`` until the unit is seen recomputing."""
        phase = "recompute_gather" if unit.recomputes else "bwd_gather"
        charges = self._start(unit, phase)
        unit.pending_bwd_charges = charges if phase == "bwd_gather" else None

    def _prefetch(self, index: Optional[int], backward: bool) -> None:
        """Issue unit ``index``'s gather now; it is waited for when the unit needs it."""
        if index is None or not self.prefetch:
            return
        unit = self.units[index]
        if unit.state is not UnitState.RELEASED:
            return
        if backward:
            self._start_backward(unit)
        else:
            self._start(unit, self.forward_phase)

