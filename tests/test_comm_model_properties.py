"""Structural properties of the communication model that hold for any unit sizes."""
import pytest

from megatron.zero_topo.comm_model import (
    CommSpec, bytes_by_tier, groups_of_kind, predict_ledger, ring_hops, tier_between, transformer_block_units)
from megatron.zero_topo.comm_time import FRONTIER, Hardware, TierLink, domain_load_fractions, simulate_step_time
from megatron.zero_topo.memory_model import neox_unit_sizes

UNITS = (1000, 3333, 3333, 3333, 777)
GATHERS = ("fwd_gather", "bwd_gather", "recompute_gather", "eval_gather")


def inter_node_bytes(spec):
    return bytes_by_tier(predict_ledger(spec)).get("inter_node", 0)


@pytest.mark.parametrize("layout, factors", [
    ((2, 2, 2), "stage0"), ((2, 2, 2), "stage1"), ((2, 2, 2), "stage2"),
    ((2, 2, 2), (1, 2, 8)), ((3, 2, 2), (1, 4, 4)), ((4, 4), (1, 4, 16))])
def test_ladder_with_w1_has_no_gather_bytes(layout, factors):
    kind = {"preset": factors} if isinstance(factors, str) else {"factors": factors}
    spec = CommSpec(UNITS, layout, micro_batches=3, eval_forward_passes=2,
                    checkpointed_units=transformer_block_units(len(UNITS)), **kind)
    assert not [key for key in predict_ledger(spec) if key[0] in GATHERS]


@pytest.mark.parametrize("layout", [(2, 2, 2), (3, 4, 2), (4, 2, 2)])
def test_zero_topo_keeps_micro_step_traffic_inside_nodes(layout):
    spec = CommSpec(UNITS, layout, preset="zero_topo", micro_batches=4, eval_forward_passes=1,
                    checkpointed_units=transformer_block_units(len(UNITS)))
    ledger = predict_ledger(spec)
    assert not [key for key in ledger if key[1] == "inter_node" and key[0] in GATHERS + ("grad_reduce",)]
    # the gathers stay on the GCD pair
    assert {tier for phase, tier in ledger if phase in GATHERS} == {"intra_gpu"}
    # ...and the step-boundary terms do cross nodes
    assert ledger[("cross_grad_reduce", "inter_node")] > 0 and ledger[("refresh", "inter_node")] > 0


def test_zero_topo_inter_node_is_flat_in_accumulation_zero3_linear():
    def inter(preset, a):
        return inter_node_bytes(CommSpec(UNITS, (4, 2, 2), preset=preset, micro_batches=a, compute_bytes=2))

    topo = [inter("zero_topo", a) for a in (1, 2, 5)]
    assert topo[0] == topo[1] == topo[2] > 0
    zero3 = [inter("stage3", a) for a in (1, 2, 3, 4)]
    per_micro_step = zero3[1] - zero3[0]
    assert per_micro_step > 0
    assert [b - a for a, b in zip(zero3, zero3[1:])] == [per_micro_step] * 3
    # what does not grow is exactly the control traffic
    control = predict_ledger(CommSpec(UNITS, (4, 2, 2), preset="stage3", compute_bytes=2))[("control", "inter_node")]
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
    # engine.md / ARCHITECTURE.md: N = 8 as 2 x 2 x 2 with (w, g, os) = (2, 4, 8).
    spec = CommSpec(UNITS, (2, 2, 2), factors=(2, 4, 8))
    assert groups_of_kind("weight", spec) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert sorted(groups_of_kind("stride", spec)) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert sorted(groups_of_kind("cross", spec)) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups_of_kind("replica", spec) == [[r] for r in range(8)]


def test_every_kind_partitions_the_world():
    spec = CommSpec(UNITS, (3, 2, 2), factors=(2, 4, 12))
    for kind in ("weight", "stride", "cross", "replica", "node", "world"):
        members = sorted(r for grp in groups_of_kind(kind, spec) for r in grp)
        assert members == list(range(12)), kind


def test_load_fractions_of_a_world_ring():
    # World group on 2 x 2 x 2: a node must take in the other node's half of the buffer, a GPU the
    # other GPU's 2 of 8 chunks, a rank its partner's 1 of 8 chunks.
    spec = CommSpec(UNITS, (2, 2, 2), preset="stage3")
    assert domain_load_fractions("world", spec) == {"inter_node": 0.5, "intra_node": 0.25, "intra_gpu": 0.125}
    # Cross pairs {r, r+4}: each node takes in 4 concurrent halves; nothing moves inside the node.
    spec = CommSpec(UNITS, (2, 2, 2), preset="zero_topo")
    assert domain_load_fractions("cross", spec) == {"inter_node": 2.0, "intra_node": 0.0, "intra_gpu": 0.0}


def test_step_time_responds_to_bandwidth_and_compute():
    units = neox_unit_sizes(4, 512, 8, 1024)
    spec = CommSpec(units, (4, 4, 2), preset="zero_topo", micro_batches=2, compute_bytes=2)
    base = simulate_step_time(spec, FRONTIER, tokens_per_micro_batch=2048)
    faster_links = Hardware(links={t: TierLink(2 * link.bandwidth, link.latency_s)
                                   for t, link in FRONTIER.links.items()},
                            peak_flops=FRONTIER.peak_flops, mfu=FRONTIER.mfu)
    fast = simulate_step_time(spec, faster_links, tokens_per_micro_batch=2048)
    assert fast.compute_s == base.compute_s
    assert 0 < fast.comm_total_s < base.comm_total_s
    assert base.full_overlap_s <= base.no_overlap_s
    more = simulate_step_time(CommSpec(units, (4, 4, 2), preset="zero_topo", micro_batches=4, compute_bytes=2),
                              FRONTIER, tokens_per_micro_batch=2048)
    assert more.compute_s == pytest.approx(2 * base.compute_s)
    assert set(base.comm_s) <= {"fwd_gather", "bwd_gather", "grad_reduce", "cross_grad_reduce", "refresh", "control"}


def test_zero_topo_is_faster_than_zero3_across_slow_links():
    # 20B shape, 48 Frontier nodes, 8 micro-batches: zero3 moves ~6 x params per GCD over the NICs.
    units = neox_unit_sizes(44, 6144, 64, 50432)
    times = {p: simulate_step_time(CommSpec(units, (48, 4, 2), preset=p, micro_batches=8, compute_bytes=2),
                                   FRONTIER, tokens_per_micro_batch=2048)
             for p in ("stage3", "zero_topo")}
    assert times["zero_topo"].comm_total_s < times["stage3"].comm_total_s
    assert times["zero_topo"].compute_s == times["stage3"].compute_s


def test_prefetch_hides_only_the_weight_gathers():
    units = neox_unit_sizes(4, 512, 8, 1024)
    for preset, gathers in (("stage3", True), ("zero_topo", True), ("stage1", False)):
        t = simulate_step_time(CommSpec(units, (4, 4, 2), preset=preset, micro_batches=2, compute_bytes=2),
                               FRONTIER, tokens_per_micro_batch=2048)
        hidden = sum(s for p, s in t.comm_s.items() if p.endswith("_gather"))
        assert (hidden > 0) == gathers
        assert t.full_overlap_s <= t.prefetch_s <= t.no_overlap_s
        assert t.prefetch_s == pytest.approx(t.no_overlap_s - min(hidden, t.compute_s))
    # A compute too short to hide the gathers behind: the gathers are the critical path.
    fast_compute = Hardware(links=FRONTIER.links, peak_flops=FRONTIER.peak_flops * 1e6, mfu=FRONTIER.mfu)
    t = simulate_step_time(CommSpec(units, (4, 4, 2), preset="stage3", compute_bytes=2), fast_compute, 2048)
    gathers = t.comm_s["fwd_gather"] + t.comm_s["bwd_gather"]
    assert t.prefetch_s == pytest.approx(t.comm_total_s)
    assert gathers > t.compute_s
