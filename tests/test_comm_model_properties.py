"""Structural properties of the communication model that hold for any unit sizes."""
import pytest

from megatron.topology.layout import ShardLayout
from megatron.analytic.comm_model import (
    CommSpec, bytes_by_tier, groups_of_kind, predict_ledger, ring_hops, tier_between, transformer_block_units)
from megatron.topology import Topology
from megatron.analytic.hardware import Hardware, TierLink
from megatron.analytic.time_model import COMPUTE, RECOMPUTE, StepWork, footprint, step_time
from megatron.analytic.memory_model import neox_unit_sizes

UNITS = (1000, 3333, 3333, 3333, 777)
GATHERS = ("fwd_gather", "bwd_gather", "recompute_gather", "eval_gather")


def inter_node_bytes(spec):
    return bytes_by_tier(predict_ledger(spec)).get("inter_node", 0)


@pytest.mark.parametrize("layout, factors", [
    ((2, 2, 2), "stage0"), ((2, 2, 2), "stage1"), ((2, 2, 2), "stage2"),
    ((2, 2, 2), (1, 2, 8)), ((3, 2, 2), (1, 4, 4)), ((4, 4), (1, 4, 16))])
def test_ladder_with_w1_has_no_gather_bytes(layout, factors):
    kind = {"preset": factors} if isinstance(factors, str) else {"shard_factors": factors}
    spec = CommSpec(UNITS, ShardLayout.resolve(layout, **kind), micro_batches=3, eval_forward_passes=2,
                    checkpointed_units=transformer_block_units(len(UNITS)))
    assert not [key for key in predict_ledger(spec) if key[0] in GATHERS]


@pytest.mark.parametrize("layout", [(2, 2, 2), (3, 4, 2), (4, 2, 2)])
def test_zero_topo_keeps_micro_step_traffic_inside_nodes(layout):
    spec = CommSpec(UNITS, ShardLayout.resolve(layout, preset="zero_topo"), micro_batches=4, eval_forward_passes=1,
                    checkpointed_units=transformer_block_units(len(UNITS)))
    ledger = predict_ledger(spec)
    assert not [key for key in ledger if key[1] == "inter_node" and key[0] in GATHERS + ("grad_reduce",)]
    # the gathers stay on the GCD pair
    assert {tier for phase, tier in ledger if phase in GATHERS} == {"intra_gpu"}
    # ...and the step-boundary terms do cross nodes
    assert ledger[("cross_grad_reduce", "inter_node")] > 0 and ledger[("refresh", "inter_node")] > 0


def test_zero_topo_inter_node_is_flat_in_accumulation_zero3_linear():
    def inter(preset, a):
        return inter_node_bytes(CommSpec(UNITS, ShardLayout.resolve((4, 2, 2), preset=preset), micro_batches=a, compute_bytes=2))

    topo = [inter("zero_topo", a) for a in (1, 2, 5)]
    assert topo[0] == topo[1] == topo[2] > 0
    zero3 = [inter("stage3", a) for a in (1, 2, 3, 4)]
    per_micro_step = zero3[1] - zero3[0]
    assert per_micro_step > 0
    assert [b - a for a, b in zip(zero3, zero3[1:])] == [per_micro_step] * 3
    # what does not grow is exactly the control traffic
    control = predict_ledger(CommSpec(UNITS, ShardLayout.resolve((4, 2, 2), preset="stage3"), compute_bytes=2))[("control", "inter_node")]
    assert zero3[0] - per_micro_step == control


@pytest.mark.parametrize("layout", [(2, 2, 2), (3, 4), (4, 2, 2), (5, 1, 3), (1, 4, 2), (6, 1)])
def test_node_ordered_ring_crosses_each_node_boundary_once(layout):
    nodes, world = layout[0], 1
    for size in layout:
        world *= size
    tiers = [tier for _s, _d, tier in ring_hops(list(range(world)), layout)]
    assert tiers.count("inter_node") == (nodes if nodes > 1 else 0)
    assert len(tiers) == world


def test_tier_between_follows_coordinates():
    layout = (2, 2, 2)
    assert tier_between(0, 1, layout) == "intra_gpu"
    assert tier_between(1, 2, layout) == "intra_node"
    assert tier_between(3, 4, layout) == "inter_node"
    assert tier_between(0, 7, layout) == "inter_node"
    assert tier_between(2, 1, (2, 2)) == "inter_node"
    assert tier_between(2, 3, (2, 2)) == "intra_node"


def test_groups_match_the_worked_example():
    # docs/engine.md: N = 8 as 2 x 2 x 2 with (w, g, os) = (2, 4, 8).
    spec = CommSpec(UNITS, ShardLayout.resolve((2, 2, 2), shard_factors=(2, 4, 8)))
    assert groups_of_kind("weight", spec) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert sorted(groups_of_kind("stride", spec)) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert sorted(groups_of_kind("cross", spec)) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups_of_kind("replica", spec) == [[r] for r in range(8)]


def test_every_kind_partitions_the_world():
    spec = CommSpec(UNITS, ShardLayout.resolve((3, 2, 2), shard_factors=(2, 4, 12)))
    for kind in ("weight", "stride", "cross", "replica", "node", "world"):
        members = sorted(r for grp in groups_of_kind(kind, spec) for r in grp)
        assert members == list(range(12)), kind


def frontier(layout) -> Hardware:
    return Hardware.from_topology(Topology.simulated(layout), device="mi250x_gcd", backend="nccl")


def work(units, overlap: bool = True) -> StepWork:
    # one 2048-token micro-batch per rank; FLOPs per token of each unit ~ 2 x its parameters
    return StepWork(2048, tuple(2.0 * p for p in units), prefetch_gathers=overlap, overlap_comm=overlap)


def compute_of(t) -> float:
    return t.exposed_s.get(COMPUTE, 0.0) + t.exposed_s.get(RECOMPUTE, 0.0)


def test_a_node_ordered_world_ring_crosses_each_node_boundary_once():
    # World ring on 2 x 2 x 2: 0..7 in order, so one hop leaves each node (3 -> 4, 7 -> 0) carrying
    # 7/8 of B, one leaves each GPU, and every rank sends 7/8 of B to its next member.
    fp = footprint([list(range(8))], (2, 2, 2), "ring_allgather")
    assert fp.domain_load == {"inter_node": 0.875, "intra_node": 0.875, "intra_gpu": 0.875}
    # Cross pairs {r, r+4}: a node sends its 4 ranks' halves at once; nothing moves inside the node.
    pairs = groups_of_kind("cross", CommSpec(UNITS, ShardLayout.resolve((2, 2, 2), preset="zero_topo")))
    assert footprint(pairs, (2, 2, 2), "ring_allgather").domain_load == {
        "inter_node": 2.0, "intra_node": 0.0, "intra_gpu": 0.0}


def test_step_time_responds_to_bandwidth_and_compute():
    units = neox_unit_sizes(4, 512, 8, 1024)
    spec = CommSpec(units, ShardLayout.resolve((4, 4, 2), preset="zero_topo"), micro_batches=2, compute_bytes=2)
    hw = frontier((4, 4, 2))
    base = step_time(spec, hw, work(units, overlap=False))
    faster = Hardware({t: TierLink(2 * link.bandwidth, link.latency_s) for t, link in hw.links.items()},
                      hw.device, hw.backend)
    fast = step_time(spec, faster, work(units, overlap=False))
    assert compute_of(fast) == compute_of(base)
    assert 0 < sum(fast.comm_s.values()) < sum(base.comm_s.values())
    assert step_time(spec, hw, work(units)).total_s <= base.total_s
    more = step_time(CommSpec(units, ShardLayout.resolve((4, 4, 2), preset="zero_topo"), micro_batches=4, compute_bytes=2), hw,
                     work(units, overlap=False))
    assert compute_of(more) == pytest.approx(2 * compute_of(base))
    assert set(base.comm_s) <= {"fwd_gather", "bwd_gather", "grad_reduce", "cross_grad_reduce", "refresh", "control"}


def test_zero_topo_is_faster_than_zero3_across_slow_links():
    # 20B shape, 48 Frontier nodes, 8 micro-batches: zero3 moves ~6 x params per GCD over the NICs.
    units = neox_unit_sizes(44, 6144, 64, 50432)
    hw = frontier((48, 4, 2))
    times = {p: step_time(CommSpec(units, ShardLayout.resolve((48, 4, 2), preset=p), micro_batches=8, compute_bytes=2), hw,
                          work(units, overlap=False))
             for p in ("stage3", "zero_topo")}
    assert sum(times["zero_topo"].comm_s.values()) < sum(times["stage3"].comm_s.values())
    assert compute_of(times["zero_topo"]) == compute_of(times["stage3"])
    assert sum(times["zero_topo"].inter_node_comm_s.values()) < sum(times["stage3"].inter_node_comm_s.values()) / 4


def test_overlap_hides_communication_only_where_the_engine_overlaps():
    units = neox_unit_sizes(4, 512, 8, 1024)
    hw = frontier((4, 4, 2))
    for preset, micro_step_comm in (("stage3", True), ("zero_topo", True), ("stage1", False)):
        spec = CommSpec(units, ShardLayout.resolve((4, 4, 2), preset=preset), micro_batches=2, compute_bytes=2)
        flat, overlapped = step_time(spec, hw, work(units, overlap=False)), step_time(spec, hw, work(units))
        assert overlapped.total_s <= flat.total_s
        assert (overlapped.hidden_s > 0) == micro_step_comm, preset
        # the step boundary and control overlap nothing
        for phase in ("cross_grad_reduce", "refresh", "replica_allreduce", "control"):
            assert overlapped.exposed_s.get(phase, 0.0) == pytest.approx(flat.exposed_s.get(phase, 0.0))
