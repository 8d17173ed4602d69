"""Topology (tiers, coordinates, constructors), shard factors, the shard map and group rank lists.

Pure functions and objects: no process is started here.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron.topology import (
    ProcessGroups, ShardChunks, ShardFactors, ShardLayout, Topology, TopologyError, chunk_range, group_ranks,
    preset_factors, validate_factors,
)


# ------------------------------------------------------------------------------------------ topology

def test_simulated_three_tier_coordinates_and_tiers():
    topo = Topology.simulated([2, 2, 2])
    assert [t.name for t in topo.tiers] == ["intra_gpu", "intra_node", "inter_node"]
    assert (topo.world_size, topo.ranks_per_node, topo.num_nodes, topo.fastest_tier_size) == (8, 4, 2, 2)
    assert [tuple(vars(topo.coordinates(r)).values()) for r in range(8)] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    assert topo.tier_between(0, 1) == "intra_gpu"
    assert topo.tier_between(1, 2) == "intra_node"
    assert topo.tier_between(2, 0) == "intra_node"
    assert topo.tier_between(3, 4) == "inter_node"
    assert topo.tier_between(6, 7) == "intra_gpu"
    with pytest.raises(TopologyError, match="itself"):
        topo.tier_between(3, 3)
    with pytest.raises(TopologyError, match="outside"):
        topo.coordinates(8)


def test_simulated_two_tier_has_no_intra_gpu():
    topo = Topology.simulated([2, 2])
    assert [t.name for t in topo.tiers] == ["intra_node", "inter_node"]
    assert (topo.world_size, topo.ranks_per_node, topo.fastest_tier_size) == (4, 2, 2)
    assert topo.tier_between(0, 1) == "intra_node" and topo.tier_between(1, 2) == "inter_node"
    assert Topology.simulated([2, 1]).tier_between(0, 1) == "inter_node"
    for bad in ([2], [2, 2, 2, 2], [0, 2]):
        with pytest.raises(TopologyError, match="simulate"):
            Topology.simulated(bad)


def test_presets():
    frontier = Topology.preset("frontier", 3)
    assert (frontier.world_size, frontier.ranks_per_node, frontier.gcds_per_gpu) == (24, 8, 2)
    assert frontier.tier("intra_gpu").bandwidth_gbs == 200.0
    assert frontier.tier("inter_node").links == 4 and frontier.tier("inter_node").bandwidth_gbs == 25.0
    assert frontier.tier_between(8, 9) == "intra_gpu" and frontier.tier_between(9, 10) == "intra_node"
    dgx = Topology.preset("dgx", 2)
    assert (dgx.world_size, dgx.ranks_per_node, dgx.num_tiers) == (16, 8, 2)
    assert dgx.tier_between(0, 7) == "intra_node" and dgx.tier_between(7, 8) == "inter_node"
    with pytest.raises(TopologyError, match="unknown topology preset"):
        Topology.preset("summit", 1)


def test_from_slurm():
    env = {"SLURM_PROCID": "13", "SLURM_LOCALID": "5", "SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "8(x2)"}
    assert Topology.from_slurm(env, preset="frontier") == Topology.preset("frontier", 2)
    generic = Topology.from_slurm(env)
    assert (generic.world_size, generic.ranks_per_node, generic.num_tiers) == (16, 8, 2)
    by_total = Topology.from_slurm({"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NNODES": "2", "SLURM_NTASKS": "4"})
    assert (by_total.world_size, by_total.ranks_per_node) == (4, 2)
    with pytest.raises(TopologyError, match="block"):
        Topology.from_slurm(dict(env, SLURM_LOCALID="4"))
    with pytest.raises(TopologyError, match="SLURM_NNODES"):
        Topology.from_slurm({"SLURM_PROCID": "0", "SLURM_LOCALID": "0"})
    with pytest.raises(TopologyError, match="same number of tasks"):
        Topology.from_slurm(dict(env, SLURM_NTASKS_PER_NODE="8,4"))


def _cfg(preset=None, simulate=None, layout=None):
    return SimpleNamespace(topology=SimpleNamespace(preset=preset, simulate=simulate, layout=layout))


def test_from_config():
    assert Topology.from_config(_cfg(simulate=[2, 2, 2]), 8) == Topology.simulated([2, 2, 2])
    assert Topology.from_config(_cfg(preset="frontier"), 16) == Topology.preset("frontier", 2)
    single = Topology.from_config(_cfg(), 4)
    assert (single.num_nodes, single.ranks_per_node) == (1, 4)
    allocated = Topology.from_config(_cfg(layout=[3, 4]), 12)  # launcher slurm: the allocation's shape
    assert (allocated.num_nodes, allocated.ranks_per_node, allocated.tier_between(3, 4)) == (3, 4, "inter_node")
    with pytest.raises(TopologyError, match="has 8 ranks but the run has 4"):
        Topology.from_config(_cfg(simulate=[2, 2, 2]), 4)
    with pytest.raises(TopologyError, match="multiple of 8"):
        Topology.from_config(_cfg(preset="dgx"), 12)
    with pytest.raises(TopologyError, match="simulate"):
        Topology.from_config(_cfg(preset="sim"), 4)


# ------------------------------------------------------------------------------------ factors, map

def test_validate_factors_says_which_divisibility_fails():
    assert validate_factors(8, 2, 4, 8) == ShardFactors(2, 4, 8)
    with pytest.raises(TopologyError, match="w=3 does not divide g=4"):
        validate_factors(8, 3, 4, 8)
    with pytest.raises(TopologyError, match="g=4 does not divide os=6"):
        validate_factors(12, 2, 4, 6)
    with pytest.raises(TopologyError, match="os=8 does not divide N=12"):
        validate_factors(12, 2, 4, 8)
    with pytest.raises(TopologyError, match="positive"):
        validate_factors(8, 0, 4, 8)


def test_worked_example_shard_map():
    """docs/engine.md: N = 8 as 2 nodes x 2 GPUs x 2 GCDs, (w, g, os) = (2, 4, 8)."""
    table = {  # rank: (weight half, gradient quarter, optimizer eighth)
        0: (0, 0, 0), 1: (1, 2, 4), 2: (0, 1, 2), 3: (1, 3, 6),
        4: (0, 0, 1), 5: (1, 2, 5), 6: (0, 1, 3), 7: (1, 3, 7),
    }
    layout = ShardLayout((2, 2, 2), ShardFactors(2, 4, 8))
    assert [layout.chunks(r) for r in range(8)] == [ShardChunks(*table[r]) for r in range(8)]
    groups = {kind: sorted({group_ranks(kind, r, 8, ShardFactors(2, 4, 8), 4) for r in range(8)})
              for kind in ("weight", "stride", "cross", "replica")}
    assert groups["weight"] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert groups["stride"] == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert groups["cross"] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert groups["replica"] == [(r,) for r in range(8)]


def _valid_factors(n: int):
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    return [(w, g, os) for os in divisors for g in divisors for w in divisors if os % g == 0 and g % w == 0]


@pytest.mark.parametrize("n,rpn", [(8, 4), (16, 8), (16, 4)])
def test_shards_nest_and_groups_compose(n, rpn):
    """For every valid (w, g, os): slice inside gradient shard inside weight shard, and gathering
    each group's chunks in sorted rank order yields exactly the next bigger chunk."""
    size = 4 * n
    for w, g, os in _valid_factors(n):
        factors = ShardFactors(w, g, os)
        layout = ShardLayout((n // rpn, rpn), factors)
        table = [layout.chunks(r) for r in range(n)]
        for r, c in enumerate(table):
            wr, gr, orr = chunk_range(size, w, c.weight), chunk_range(size, g, c.grad), chunk_range(size, os, c.opt)
            assert wr[0] <= gr[0] < gr[1] <= wr[1] and gr[0] <= orr[0] < orr[1] <= gr[1], (w, g, os, r)
            stride = group_ranks("stride", r, n, factors, rpn)
            assert [table[m].grad for m in stride] == list(range(c.weight * (g // w), (c.weight + 1) * (g // w)))
            cross = group_ranks("cross", r, n, factors, rpn)
            assert [table[m].opt for m in cross] == list(range(c.grad * (os // g), (c.grad + 1) * (os // g)))
            weight = group_ranks("weight", r, n, factors, rpn)
            assert [table[m].weight for m in weight] == list(range(w))
            assert {table[m].opt for m in group_ranks("replica", r, n, factors, rpn)} == {c.opt}
        for block in range(n // os):  # each os-block holds every optimizer chunk exactly once
            assert sorted(table[r].opt for r in range(block * os, block * os + os)) == list(range(os))


def test_preset_factors_and_resolution_from_config_parts():
    three, two = Topology.simulated([2, 2, 2]), Topology.simulated([2, 2])
    assert preset_factors("zero_topo", three).as_tuple() == (2, 4, 8)
    assert preset_factors("zero_topo", two).as_tuple() == (2, 2, 4)
    assert preset_factors("hsdp", three).as_tuple() == (4, 4, 4)
    assert [preset_factors(f"stage{s}", three).as_tuple() for s in range(4)] == [(1, 1, 1), (1, 1, 8), (1, 8, 8), (8, 8, 8)]
    assert preset_factors("zeropp", three).as_tuple() == (8, 8, 8)
    with pytest.raises(TopologyError, match="unknown ZeRO preset"):
        preset_factors("zero4", three)
    tiers = (2, 2, 2)
    assert ShardLayout.resolve(tiers, stage=2) == ShardLayout(tiers, ShardFactors(1, 8, 8), "stage2")
    assert ShardLayout.resolve(tiers, stage=3, preset="hsdp").preset == "hsdp"
    assert ShardLayout.resolve(tiers, stage=3, preset="hsdp", shard_factors=[1, 2, 4]) == ShardLayout(
        tiers, ShardFactors(1, 2, 4), "custom")
    with pytest.raises(TopologyError, match="does not divide"):
        ShardLayout.resolve(tiers, shard_factors=[2, 3, 6])


def test_process_groups_rank_lists_without_processes():
    groups = ProcessGroups(Topology.simulated([2, 2, 2]), ShardLayout.from_topology(Topology.simulated([2, 2, 2]), ShardFactors(2, 4, 8)), 5, create=False)
    assert groups.weight.ranks == (4, 5) and groups.stride.ranks == (5, 7) and groups.cross.ranks == (1, 5)
    assert groups.replica.ranks == (5,) and groups.node.ranks == (4, 5, 6, 7) and groups.world.size == 8
    assert groups.weight.handle is None
    hsdp = ProcessGroups(Topology.simulated([2, 2, 2]), ShardLayout.from_topology(Topology.simulated([2, 2, 2]), ShardFactors(4, 4, 4)), 6, create=False)
    assert hsdp.replica.ranks == (2, 6) and hsdp.cross.size == 1 and hsdp.stride.size == 1


def test_tiers_among_equals_every_pair_in_linear_time():
    """``tiers_among`` (O(k), used for every group at 384 ranks) against the tiers of every pair."""
    import itertools
    import random
    rng = random.Random(3)
    for topo in (Topology.simulated([2, 2, 2]), Topology.simulated([3, 4]), Topology.preset("frontier", 4),
                 Topology.simulated([1, 4, 2]), Topology.simulated([4, 1, 2])):
        for _ in range(200):
            ranks = sorted(rng.sample(range(topo.world_size), rng.randint(2, topo.world_size)))
            pairs = {topo.tier_between(a, b) for a, b in itertools.combinations(ranks, 2)}
            assert topo.tiers_among(ranks) == pairs, (topo.name, ranks)
    frontier = Topology.preset("frontier", 48)
    assert frontier.tiers_among(range(384)) == {"intra_gpu", "intra_node", "inter_node"}
    assert frontier.tiers_among(range(5, 384, 8)) == {"inter_node"}  # one rank per node: one tier
    assert frontier.tiers_among([0, 1]) == {"intra_gpu"} and frontier.tiers_among([0, 2, 4, 6]) == {"intra_node"}
