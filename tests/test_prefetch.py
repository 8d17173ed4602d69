"""Prefetching the next unit's weight gather (megatron/engine/prefetch.py, engine hooks).

One 4-rank launch (2 nodes x 2 ranks) trains each case twice, prefetch on and off, and records the
order of gather issues, gather waits, unit forwards and gradient reductions on rank 0. Judged here:
- a gather is issued one unit early: forward, unit i+1's before unit i's forward ends; backward,
  unit i-1's before unit i's gradient is reduced (and, without prefetch, never early);
- no more than two sharded units are gathered or in flight when a gather is issued;
- prefetch changes nothing else: parameters, losses and every ledger cell are identical, bit for bit
  (plain and checkpointed blocks, re-entrant recompute, zeropp's secondary copy, INT8/INT4 messages).
"""
from __future__ import annotations

import pytest
import torch

from dist_harness import run_ranks
from megatron.engine.flat_unit import UnitState
from megatron.engine.settings import EngineSettings
from megatron.topology.layout import ShardLayout
from megatron.engine import lm_loss
from megatron.topology import ProcessGroups, Topology
from megatron.engine import Communicator, ZeroTopoEngine
from megatron.engine.prefetch import PassOrder
from megatron.engine.quantized import QuantSpec
from test_engine import LR, OPT, build_model, make_batch

LAYOUT, STEPS, ACCUM = [2, 2], 2, 2
QUANT = QuantSpec(weight_gather_bits=8, grad_reduce_bits=4, cross_node_grad_bits=4, refresh_bits=8, block_size=8, impl="reference")
CASES = [  # (name, preset, checkpoint_activations, quantization); re-entrant last: it patches the model
    ("zero3", "stage3", False, None),
    ("zero_topo_recompute", "zero_topo", True, None),
    ("zeropp", "zeropp", False, None),
    ("zeropp_int8", "zeropp", False, QuantSpec(weight_gather_bits=8, grad_reduce_bits=4, block_size=8, impl="reference")),
    ("zero_topo_quant_recompute", "zero_topo", True, QUANT),
    ("zero3_reentrant", "stage3", True, None),
]


# ---------------------------------------------------------------------------------------- pure order

def test_pass_order_guesses_list_order_then_follows_the_last_forward():
    order = PassOrder(4)
    order.begin()
    assert order.after(0) == 1 and order.after(3) is None
    for i in (0, 2, 1, 3):  # the model ran its units in another order
        order.visit(i)
    order.end_forward()
    assert [order.before(i) for i in (0, 2, 1, 3)] == [None, 0, 2, 1]
    order.reduced.add(2)
    assert order.before(1) is None  # unit 2's backward is over: nothing to fetch for it
    order.begin()
    assert [order.after(i) for i in (0, 2, 1, 3)] == [2, 1, 3, None]
    order.visit(0), order.visit(3)
    assert order.after(1) is None  # unit 3 already ran in this pass
    assert order.before(5) is None and order.after(5) is None


# ---------------------------------------------------------------------------------------- the worker

def _engine(rank: int, preset: str, recompute: bool, quant, prefetch: bool) -> ZeroTopoEngine:
    topology = Topology.simulated(LAYOUT)
    groups = ProcessGroups(topology, ShardLayout.from_topology(topology, preset=preset), rank)
    model = build_model(checkpoint_activations=recompute)
    return ZeroTopoEngine(model, lm_loss, groups, Communicator(groups), EngineSettings(optimizer=OPT, precision="fp32", accumulation_steps=ACCUM, quant=quant, prefetch=prefetch))


def _trace(engine: ZeroTopoEngine, events: list) -> None:
    """Record (event, unit index, sharded units gathered or in flight just before it)."""
    def live() -> int:
        return sum(1 for u in engine.units if u.shardable and u.state is not UnitState.RELEASED)

    def wrap(name, fn):
        def traced(unit, *args, **kwargs):
            events.append((name, unit.index, live()))
            return fn(unit, *args, **kwargs)
        return traced

    engine.gathers._start = wrap("start", engine.gathers._start)
    engine.gathers._finish = wrap("wait", engine.gathers._finish)
    engine.reduce_gradient = wrap("reduce", engine.reduce_gradient)
    for unit in engine.units:  # after the engine's own post-forward hook
        unit.module.register_forward_hook(
            lambda _m, _a, _o, i=unit.index: None if engine.gathers.in_backward else events.append(("fwd_end", i, live())))


def _worker(rank: int, world_size: int) -> dict:
    results = {}
    for name, preset, recompute, quant in CASES:
        if name.endswith("reentrant"):
            import megatron.model.gpt_neox as gpt_neox
            from torch.utils.checkpoint import checkpoint
            gpt_neox.checkpoint = lambda fn, *a, **kw: checkpoint(fn, *a, **dict(kw, use_reentrant=True))
        for prefetch in (True, False):
            engine = _engine(rank, preset, recompute, quant, prefetch)
            losses, ledgers, events = [], [], []
            for step in range(STEPS):
                engine.ledger.reset()
                if step == STEPS - 1:
                    _trace(engine, events)  # the last step: the forward order is known from before
                losses += [engine.forward_backward(make_batch(step, m, rank)).item() for m in range(ACCUM)]
                engine.optimizer_step(LR)
                ledgers.append(engine.ledger.snapshot())
            engine.ledger.reset()
            losses.append(engine.eval_loss(make_batch(99, 0, rank)).item())
            ledgers.append(engine.ledger.snapshot())
            results[(name, prefetch)] = {"losses": losses, "ledgers": ledgers, "events": events,
                                         "units": len(engine.units), "params": engine.full_state_dict()}
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ranks("test_prefetch:_worker", 4, tmp_path_factory.mktemp("prefetch"))


def _first_micro_step(events: list) -> list:
    """Events of the traced step's first micro-batch: up to the last unit's gradient reduction."""
    reduce_zero = next(i for i, e in enumerate(events) if e[:2] == ("reduce", 0))
    return events[: reduce_zero + 1]


def _position(events: list, name: str, unit: int) -> int:
    return next(i for i, e in enumerate(events) if e[:2] == (name, unit))


def _backward_start(events: list, units: int) -> int:
    return _position(events, "fwd_end", units - 1) + 1


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_prefetch_issues_each_gather_one_unit_early(runs, name):
    on = _first_micro_step(runs[0][(name, True)]["events"])
    off = _first_micro_step(runs[0][(name, False)]["events"])
    units = runs[0][(name, True)]["units"]
    for i in range(units - 1):  # forward: unit i+1's gather leaves before unit i has finished
        assert _position(on, "start", i + 1) < _position(on, "fwd_end", i), (i, on)
        assert _position(off, "start", i + 1) > _position(off, "fwd_end", i), (i, off)
    for events, early in ((on, True), (off, False)):
        back = events[_backward_start(events, units):]
        for i in range(1, units):  # backward: unit i-1's gather leaves before unit i's gradient is reduced
            assert (_position(back, "start", i - 1) < _position(back, "reduce", i)) == early, (i, back)


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_prefetch_holds_at_most_two_units(runs, name):
    for prefetch in (True, False):
        events = runs[0][(name, prefetch)]["events"]
        held = max(e[2] for e in events if e[0] == "start")
        assert held <= (1 if prefetch else 0), (prefetch, held, events)


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_prefetch_changes_no_value_and_no_byte(runs, name):
    for rank, result in enumerate(runs):
        on, off = result[(name, True)], result[(name, False)]
        assert on["losses"] == off["losses"], rank
        assert on["ledgers"] == off["ledgers"], rank
        assert on["params"].keys() == off["params"].keys()
        for key, value in on["params"].items():
            assert torch.equal(value, off["params"][key]), (rank, key)
