"""The fast planner chooses what the exhaustive search chooses (megatron/analytic/planner.py, issue 39).

The search times only the candidates that fit, and the time model shares work between candidates
(footprints keyed by the factors a group kind reads, transfers timed once per distinct collective,
group spans counted instead of paired). Each shortcut is checked here against the slow statement
it replaces, and the whole search against ``search(..., exhaustive=True)`` (every candidate timed)
and against rows recorded from the planner before the shortcuts existed.
"""
from __future__ import annotations

import itertools
import math
import random

import pytest

from megatron.analytic.comm_model import CommSpec, bytes_by_tier, groups_of_kind, predict_ledger, tier_between
from megatron.analytic.hardware import Device, Hardware, TierLink
from megatron.analytic.planner import (PlanInputs, candidate_layouts, nested_factors, ranked, search)
from megatron.analytic.time_model import StepWork, _GroupSpec, _kind_factors, ledger_bytes_by_tier, spans_one_tier

UNITS = (20_000, 60_000, 60_000, 60_000, 30_000)  # embedding, 3 blocks, head
QUANTS = ("none", "boundary", "int8w-int4g")


def toy_inputs(budget: float, backend: str = "nccl") -> PlanInputs:
    links = {"inter_node": TierLink(1e9, 1e-5), "intra_node": TierLink(1e10, 2e-6), "intra_gpu": TierLink(4e10, 1e-6)}
    hw = Hardware(links, Device("toy", 1e12, 1e10, 1e10, 0.5, 1e12), backend)
    work = StepWork(512, (0.0, 2e5, 2e5, 2e5, 1e5))
    return PlanInputs(UNITS, work, 2, 2, True, {False: 3_000_000, True: 1_000_000}, hw, budget)


def table_key(row) -> tuple:
    c = row.candidate
    return (row.factors, c.layout.hpz, c.quant_name, c.checkpointed, row.time.total_s)


# -- the shortcuts inside the time model, against what they replace ------------------------------

def pairwise_spans_one_tier(ranks, layout) -> bool:
    """The definition: every pair of members separated by the same tier."""
    return len({tier_between(a, b, layout) for a, b in itertools.combinations(ranks, 2)}) <= 1


@pytest.mark.parametrize("layout", [(2, 2, 2), (3, 2, 2), (2, 4), (4, 3), (2, 3, 2)])
def test_counted_spans_equal_the_pairwise_definition(layout):
    n = math.prod(layout)
    rng = random.Random(n)
    groups = [sorted(rng.sample(range(n), rng.randint(2, n))) for _ in range(200)]
    for factors in nested_factors(n):
        spec = _GroupSpec(layout, factors)
        groups += [grp for kind in ("weight", "stride", "cross", "replica", "node", "rail", "world")
                   for grp in groups_of_kind(kind, spec)[:2]]
    answers = {spans_one_tier(grp, layout) for grp in groups}
    assert answers == {True, False}  # both outcomes exercised
    assert all(spans_one_tier(grp, layout) == pairwise_spans_one_tier(grp, layout) for grp in groups)


@pytest.mark.parametrize("layout", [(2, 2, 2), (3, 2, 2), (2, 4), (4, 2, 2)])
def test_a_kinds_groups_depend_only_on_the_factors_it_reads(layout):
    for factors in nested_factors(math.prod(layout)):
        for kind in ("weight", "stride", "cross", "replica", "node", "rail", "world"):
            collapsed = _kind_factors(kind, factors)
            assert groups_of_kind(kind, _GroupSpec(layout, factors)) == groups_of_kind(kind, _GroupSpec(layout, collapsed))


@pytest.mark.parametrize("layout", [(2, 2, 2), (3, 2, 2), (2, 4)])
def test_bytes_per_tier_of_every_candidate_equal_the_rank_by_rank_ledger(layout):
    for lay in candidate_layouts(layout):
        spec = CommSpec((1024, 3072, 2048), lay, micro_batches=2)
        slow = bytes_by_tier(predict_ledger(spec))
        fast = ledger_bytes_by_tier(spec)
        assert set(fast) == set(slow), lay
        assert all(fast[t] == pytest.approx(slow[t], rel=1e-12) for t in slow), lay


# -- the search: fast against exhaustive --------------------------------------------------------

def both(tiers, budget, backend="nccl", checkpointing=(False, True)):
    kw = dict(quant_names=QUANTS, checkpointing=checkpointing)
    return (search(tiers, toy_inputs(budget, backend), **kw),
            search(tiers, toy_inputs(budget, backend), exhaustive=True, **kw))


@pytest.mark.parametrize("tiers,backend", [((2, 2, 2), "nccl"), ((4, 2, 2), "nccl"), ((3, 2, 2), "gloo"),
                                           ((4, 4), "gloo")])
@pytest.mark.parametrize("budget", [2.0e6, 4.0e6, 5.0e6, 1e15])
def test_the_fast_search_chooses_and_ranks_as_the_exhaustive_one(tiers, backend, budget):
    fast, full = both(tiers, budget, backend)
    assert (fast.best is None) == (full.best is None)
    if full.best is not None:
        assert fast.best == full.best and fast.reason() == full.reason()
    assert len(fast.rows) == len(full.rows)
    for quick, slow in zip(fast.rows, full.rows):
        assert quick.candidate == slow.candidate and quick.peak_bytes == slow.peak_bytes
        assert quick.feasible == slow.feasible
        assert quick == slow if quick.time is not None else not quick.feasible
    inputs = toy_inputs(budget, backend)
    for top in (1, 4, 12, 0):  # the table's rows, untimed ones timed where the table reaches them
        assert [table_key(r) for r in ranked(fast, inputs, top)] == [table_key(r) for r in ranked(full, inputs, top)]
    every = sorted(full.rows, key=lambda r: (not r.feasible, r.time.total_s))  # the CLI's order before ranked
    assert [table_key(r) for r in ranked(fast, inputs)] == [table_key(r) for r in every]


def test_the_fast_search_skips_timing_only_what_does_not_fit():
    fast, _ = both((4, 2, 2), 4.0e6)
    untimed = [r for r in fast.rows if r.time is None]
    assert untimed and all(not r.feasible for r in untimed)
    assert all(r.time is not None for r in fast.rows if r.feasible)


# The planner's top rows for the toy inputs at a 4e6-byte budget, printed by the search before its
# shortcuts (commit af858db, every candidate timed one by one): (factors, zeropp, quantization,
# checkpointed, step seconds), then how many of how many candidates fit.
RECORDED = {
    ((2, 2, 2), "nccl"): ([((2, 4, 8), False, "boundary", True, 0.0034296239999999996),
                           ((1, 4, 8), False, "boundary", True, 0.003493927999999999),
                           ((1, 4, 8), False, "int8w-int4g", True, 0.0035015999999999992),
                           ((2, 4, 8), False, "int8w-int4g", True, 0.003542231999999999)], 54, 126),
    ((4, 2, 2), "nccl"): ([((2, 4, 16), False, "boundary", True, 0.004040555199999999),
                           ((1, 4, 16), False, "boundary", True, 0.0041051664),
                           ((1, 4, 16), False, "int8w-int4g", True, 0.0041129936),
                           ((2, 4, 16), False, "int8w-int4g", True, 0.0041539455999999985)], 99, 216),
    ((3, 2, 2), "gloo"): ([((2, 4, 12), False, "boundary", True, 0.0037496367999999987),
                           ((1, 4, 12), False, "int8w-int4g", True, 0.003821742399999999),
                           ((1, 4, 12), False, "boundary", True, 0.003855159999999999),
                           ((2, 4, 12), False, "int8w-int4g", True, 0.003862707399999999)], 111, 246),
    ((4, 4), "gloo"): ([((1, 4, 16), False, "boundary", True, 0.0041051664),
                        ((1, 4, 16), False, "int8w-int4g", True, 0.004117111999999999),
                        ((2, 4, 16), False, "boundary", True, 0.004121838399999999),
                        ((4, 4, 16), False, "boundary", True, 0.0041841744)], 99, 216),
}


@pytest.mark.parametrize("case", sorted(RECORDED))
def test_both_searches_give_the_rows_recorded_before_the_shortcuts(case):
    tiers, backend = case
    rows, fit, total = RECORDED[case]
    fast, full = both(tiers, 4.0e6, backend)
    inputs = toy_inputs(4.0e6, backend)
    for plan in (fast, full):
        assert [table_key(r) for r in ranked(plan, inputs, 4)] == rows
        assert table_key(plan.best) == rows[0]
        assert (sum(r.feasible for r in plan.rows), len(plan.rows)) == (fit, total)


def test_the_fast_search_on_the_20b_on_two_frontier_nodes_matches_the_exhaustive_one():
    """The real model, figures and curves (the shipped frontier-measured set) on 16 ranks."""
    from megatron.config import load_config
    from megatron.analytic.model_inputs import figure_set_of, padded_vocab_of
    from megatron.analytic.planner import inputs_from_config
    from megatron.topology import Topology
    from conftest import REPO
    cfg = load_config([str(REPO / "configs" / "20B.yml")], ["topology.preset=frontier", "num_nodes=2"], notices=[])
    hw = Hardware.from_topology(Topology.from_config(cfg, cfg.topology.world_size), backend="nccl",
                                figures=figure_set_of(cfg))
    for budget in (None, 40e9):  # the device's 64 GB, and one that leaves out more of them
        inputs = inputs_from_config(cfg, padded_vocab_of(cfg), hw, budget)
        kw = dict(quant_names=QUANTS, checkpointing=(False, True))
        fast = search(cfg.topology.layout, inputs, **kw)
        full = search(cfg.topology.layout, inputs, exhaustive=True, **kw)
        assert fast.best == full.best and fast.reason() == full.reason()
        assert 0 < sum(r.feasible for r in full.rows) < len(full.rows)
        for top in (12, 0):
            assert [table_key(r) for r in ranked(fast, inputs, top)] == [table_key(r) for r in ranked(full, inputs, top)]
