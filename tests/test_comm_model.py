"""The communication model against hand-computed ledgers (docs/engine.md applied by hand).

Common setting: units of 100, 240, 240, 96 elements on 2 nodes x 2 GPUs x 2 GCDs (N = 8, R = 4),
A = 2 micro-batches. Ranks r -> (node r//4, gpu (r//2)%2, gcd r%2). The world ring 0->1->...->7->0
has 4 intra_gpu hops (0-1, 2-3, 4-5, 6-7), 2 intra_node (1-2, 5-6) and 2 inter_node (3-4, 7-0).
Every number below is written out by hand; none is computed by the model. The last unit (96, the
head) stays gathered from its forward to its backward: it has no backward gather.
"""
import pytest

from megatron.analytic.comm_model import (
    CommModelError, CommSpec, predict_ledger, predict_ledger_per_rank, transformer_block_units)
from megatron.config.quant_spec import QuantSpec
from megatron.topology import TopologyError
from megatron.topology.layout import ShardLayout

UNITS = (100, 240, 240, 96)
LAYOUT = (2, 2, 2)
BLOCKS = frozenset({1, 2})

# Control collectives, every preset, N = 8 (allreduce: each rank sends 2 x 7/8 x B):
#   grad norm: 8 fp32 = 32 B -> 56 per rank; step vector (loss sum, count, stop flag): 3 -> 8 float64
#   = 64 B -> 112;
#   ledger: 30 counters (10 phases x 3 tiers) -> 32 float64 = 256 B -> 448.
#   Per rank 56 + 112 + 448 = 616 on the world ring:
#   intra_gpu 4 x 616 = 2464, intra_node 2 x 616 = 1232, inter_node 2 x 616 = 1232.
CONTROL = {("control", "intra_gpu"): 2464, ("control", "intra_node"): 1232, ("control", "inter_node"): 1232}

# Padded sizes: q = N = 8 for every preset gives S = 104, 240, 240, 96 (sum 680).
# A world allgather/reduce-scatter of the full fp32 unit: 7/8 x 4S per rank
#   = 364 + 840 + 840 + 336 = 2380 per rank; world ring -> gpu 4 x, node 2 x, inter 2 x.

EXPECTED = {
    # stage 0 (1,1,1): only the replica allreduce over the world of the fp32 S, per unit
    #   2 x 7/8 x (416, 960, 960, 384) = 728 + 1680 + 1680 + 672 = 4760 per rank;
    #   world ring: 4 x 4760 = 19040 intra_gpu, 2 x 4760 = 9520 intra_node and inter_node.
    "stage0": {("replica_allreduce", "intra_gpu"): 19040, ("replica_allreduce", "intra_node"): 9520,
               ("replica_allreduce", "inter_node"): 9520},
    # stage 1 (1,1,8): cross reduce-scatter over the world (2380 per rank) and the refresh allgather
    #   over the world (2380 per rank), once per step.
    "stage1": {("cross_grad_reduce", "intra_gpu"): 9520, ("cross_grad_reduce", "intra_node"): 4760,
               ("cross_grad_reduce", "inter_node"): 4760,
               ("refresh", "intra_gpu"): 9520, ("refresh", "intra_node"): 4760, ("refresh", "inter_node"): 4760},
    # stage 2 (1,8,8): stride reduce-scatter over the world per micro-batch: 2 x 2380 = 4760 per rank;
    #   refresh: stride allgather over the world, 2380 per rank.
    "stage2": {("grad_reduce", "intra_gpu"): 19040, ("grad_reduce", "intra_node"): 9520,
               ("grad_reduce", "inter_node"): 9520,
               ("refresh", "intra_gpu"): 9520, ("refresh", "intra_node"): 4760, ("refresh", "inter_node"): 4760},
    # stage 3 (8,8,8): forward gather and weight reduce-scatter over the world, each 2 x 2380 = 4760
    #   per rank; backward gather of units 0-2 only: 2 x 7/8 x 4 x 584 = 4088 per rank; no refresh
    #   (the optimizer slice is the weight shard).
    "stage3": {**{(phase, tier): nbytes for phase in ("fwd_gather", "grad_reduce")
                  for tier, nbytes in (("intra_gpu", 19040), ("intra_node", 9520), ("inter_node", 9520))},
               ("bwd_gather", "intra_gpu"): 16352, ("bwd_gather", "intra_node"): 8176,
               ("bwd_gather", "inter_node"): 8176},
    # hsdp (4,4,4): weight groups {0..3} {4..7}, ring 0-1 gpu, 1-2 node, 2-3 gpu, 3-0 node (4 + 4 hops).
    #   Gather/reduce-scatter of 4S: 3/4 x (416, 960, 960, 384) = 312 + 720 + 720 + 288 = 2040 per rank
    #   per micro-batch, x 2 = 4080 -> 4 x 4080 = 16320 per tier. Replica groups {r, r+4}: allreduce of
    #   S/4 fp32 = S = 680 bytes, 2 x 1/2 x 680 = 680 per rank, both hops inter_node: 8 x 680 = 5440.
    #   Backward gathers of units 0-2: 3/4 x 4 x 584 = 1752, x 2 = 3504 per rank -> 14016 per tier.
    "hsdp": {**{(phase, tier): 16320 for phase in ("fwd_gather", "grad_reduce")
                for tier in ("intra_gpu", "intra_node")},
             ("bwd_gather", "intra_gpu"): 14016, ("bwd_gather", "intra_node"): 14016,
             ("replica_allreduce", "inter_node"): 5440},
    # zero_topo (2,4,8): weight pairs (intra_gpu): gather of 4S, 1/2 -> 2S = 1360 per micro-batch,
    #   x 2 = 2720 per rank, x 8 ranks = 21760 for fwd, bwd and the weight reduce-scatter.
    #   Stride pairs {0,2} {1,3} {4,6} {5,7} (intra_node): reduce-scatter of S/2 fp32 = 2S bytes -> S =
    #   680 per micro-batch, x 2 x 8 = 10880. Cross pairs {r, r+4} (inter_node): reduce-scatter of S/4
    #   fp32 = S bytes -> S/2 = 340 per rank, x 8 = 2720. Refresh: cross allgather to S/4 (S bytes)
    #   -> 340 x 8 = 2720 inter_node; stride allgather to S/2 (2S bytes) -> 680 x 8 = 5440 intra_node.
    #   Backward gathers of units 0-2: 2 x 584 = 1168 per micro-batch, x 2 x 8 = 18688.
    "zero_topo": {("fwd_gather", "intra_gpu"): 21760, ("bwd_gather", "intra_gpu"): 18688,
                  ("grad_reduce", "intra_gpu"): 21760, ("grad_reduce", "intra_node"): 10880,
                  ("cross_grad_reduce", "inter_node"): 2720,
                  ("refresh", "inter_node"): 2720, ("refresh", "intra_node"): 5440},
    # zeropp (q = 8, R = 4): each unit's first forward gather is over the world (2380 per rank);
    #   the second micro-batch's forward and both backward gathers use the node groups {0..3} {4..7}
    #   (ring: 2 gpu + 2 node hops each): 3/4 x 4S = 3S = 2040 per rank per gather.
    #   fwd: gpu 9520 + 4 x 2040 = 17680, node 4760 + 4 x 2040 = 12920, inter 4760;
    #   bwd: 2 node gathers of units 0-2, 3 x 584 = 1752 each -> 3504 per rank -> gpu 14016, node 14016;
    #   grad_reduce: world reduce-scatter per micro-batch -> 4760 per rank -> 19040 / 9520 / 9520.
    "zeropp": {("fwd_gather", "intra_gpu"): 17680, ("fwd_gather", "intra_node"): 12920,
               ("fwd_gather", "inter_node"): 4760,
               ("bwd_gather", "intra_gpu"): 14016, ("bwd_gather", "intra_node"): 14016,
               ("grad_reduce", "intra_gpu"): 19040, ("grad_reduce", "intra_node"): 9520,
               ("grad_reduce", "inter_node"): 9520},
}


@pytest.mark.parametrize("preset", sorted(EXPECTED))
def test_hand_computed_ledger(preset):
    spec = CommSpec(UNITS, ShardLayout.resolve(LAYOUT, preset=preset), micro_batches=2, compute_bytes=4)
    assert predict_ledger(spec) == {**EXPECTED[preset], **CONTROL}


def test_zero_topo_bf16_checkpointing_eval_fp32_allreduce():
    # c = 2, blocks (units 1, 2) checkpointed, 1 eval pass, step-boundary hops in fp32. S = 104, 240, 240, 96.
    spec = CommSpec(UNITS, ShardLayout.resolve(LAYOUT, preset="zero_topo"), micro_batches=2, compute_bytes=2,
                    fp32_allreduce=True, checkpointed_units=BLOCKS, eval_forward_passes=1)
    expected = {
        # weight-pair gather of 2S bytes: S per rank per pass. eval: 680 x 8 ranks.
        ("eval_gather", "intra_gpu"): 5440,
        ("fwd_gather", "intra_gpu"): 2 * 680 * 8,             # 10880
        ("bwd_gather", "intra_gpu"): 2 * 104 * 8,             # unit 0 (3, the last, stays gathered): 1664
        ("recompute_gather", "intra_gpu"): 2 * (240 + 240) * 8,  # units 1, 2: 7680
        # weight reduce-scatter as the gathers (10880); stride reduce-scatter of S/2 bf16 = S bytes
        #   -> S/2 = 340 per micro-batch, x 2 x 8 = 5440.
        ("grad_reduce", "intra_gpu"): 10880, ("grad_reduce", "intra_node"): 5440,
        # cross reduce-scatter of S/4 in fp32 = S bytes -> 340 per rank -> 2720.
        ("cross_grad_reduce", "inter_node"): 2720,
        # refresh in bf16: cross gather to S/4 (S/2 bytes) -> 170 x 8 = 1360;
        #   stride gather to S/2 (S bytes) -> 340 x 8 = 2720.
        ("refresh", "inter_node"): 1360, ("refresh", "intra_node"): 2720,
        # control plus the eval-loss allreduce (2 -> 8 float64 = 64 B -> 112 per rank): 728 per rank.
        ("control", "intra_gpu"): 4 * 728, ("control", "intra_node"): 2 * 728, ("control", "inter_node"): 2 * 728,
    }
    assert predict_ledger(spec) == expected


def test_zeropp_eval_takes_the_world_gather():
    # With an eval pass in the window, the first gather after the update is the eval's (world);
    # every training gather is then node-local. Blocks checkpointed; fp32; A = 2.
    spec = CommSpec(UNITS, ShardLayout.resolve(LAYOUT, preset="zeropp"), micro_batches=2, checkpointed_units=BLOCKS,
                    eval_forward_passes=1)
    expected = {
        ("eval_gather", "intra_gpu"): 9520, ("eval_gather", "intra_node"): 4760, ("eval_gather", "inter_node"): 4760,
        # two node gathers per unit, 3S = 2040 per rank each -> 4080 x 4 per tier
        ("fwd_gather", "intra_gpu"): 16320, ("fwd_gather", "intra_node"): 16320,
        # unit 0 (3, the last, stays gathered): 3 x 104 = 312 per gather, x 2 = 624 per rank
        ("bwd_gather", "intra_gpu"): 2496, ("bwd_gather", "intra_node"): 2496,
        # units 1, 2: 3 x 480 = 1440 per gather, x 2 = 2880 per rank
        ("recompute_gather", "intra_gpu"): 11520, ("recompute_gather", "intra_node"): 11520,
        ("grad_reduce", "intra_gpu"): 19040, ("grad_reduce", "intra_node"): 9520, ("grad_reduce", "inter_node"): 9520,
        ("control", "intra_gpu"): 2912, ("control", "intra_node"): 1456, ("control", "inter_node"): 1456,
    }
    assert predict_ledger(spec) == expected


def test_hsdp_per_rank_follows_ring_order():
    # Weight group {0,1,2,3}: rank 0 sends to 1 (intra_gpu), rank 1 to 2 (intra_node), rank 3 to 0
    # (intra_node); 4080 per rank per gather phase (see EXPECTED["hsdp"]). Replica: 680 inter_node.
    per_rank = predict_ledger_per_rank(CommSpec(UNITS, ShardLayout.resolve(LAYOUT, preset="hsdp"), micro_batches=2))
    assert per_rank[0][("fwd_gather", "intra_gpu")] == 4080
    assert ("fwd_gather", "intra_node") not in per_rank[0]
    assert per_rank[1][("fwd_gather", "intra_node")] == 4080
    assert per_rank[3][("grad_reduce", "intra_node")] == 4080
    assert per_rank[5][("replica_allreduce", "inter_node")] == 680
    # control on the world ring: rank 3 -> 4 and rank 7 -> 0 cross nodes, 616 each
    assert per_rank[3][("control", "inter_node")] == 616
    assert ("control", "inter_node") not in per_rank[2]


def test_two_tier_zero_topo():
    # Layout 2 nodes x 2 ranks: zero_topo = (2, 2, 4), q = 4, S = 100, 240, 240, 96 (676), fp32, A = 1.
    # Weight pairs {0,1} {2,3} are intra_node: gather of 4S, 1/2 -> 2S = 1352 per rank, x 4 ranks = 5408
    # per phase (backward: units 0-2, 2 x 580 = 1160 per rank -> 4640); stride groups have one member. Cross pairs {0,2} {1,3}: reduce-scatter of S/2 fp32 =
    # 2S bytes -> S = 676 per rank -> 2704 inter_node; refresh the same. Control, N = 4: grad norm 16 B
    # -> 2 x 3/4 x 16 = 24; step vector 3 -> 4 float64 = 32 B -> 48; ledger 30 -> 32 float64 = 256 B -> 384;
    # 456 per rank; world ring 0-1 node, 1-2 inter, 2-3 node, 3-0 inter -> 2 x 456 = 912 each.
    spec = CommSpec(UNITS, ShardLayout.resolve((2, 2), preset="zero_topo"))
    assert predict_ledger(spec) == {
        ("fwd_gather", "intra_node"): 5408, ("bwd_gather", "intra_node"): 4640, ("grad_reduce", "intra_node"): 5408,
        ("cross_grad_reduce", "inter_node"): 2704, ("refresh", "inter_node"): 2704,
        ("control", "intra_node"): 912, ("control", "inter_node"): 912}


@pytest.mark.parametrize("factors, compute_bytes, expected", [
    # zero_topo (2, 4, 8), fp32: cross pairs {r, r+4}, both ring hops inter_node. S/g = S/4 = 26 + 60 + 60
    #   + 24 = 170 elements = 680 B per rank. Reduce-scatter over k = 2: 1/2 x 680 = 340 per rank -> 2720
    #   (as EXPECTED["zero_topo"]); all-reduce: 2 x 1/2 x 680 = 680 per rank -> 5440.
    ((2, 4, 8), 4, {"reduce_scatter": {"inter_node": 2720}, "all_reduce": {"inter_node": 5440}}),
    # the same in bf16 without fp32_allreduce: 340 B per rank -> 1360; all-reduce 2720.
    ((2, 4, 8), 2, {"reduce_scatter": {"inter_node": 1360}, "all_reduce": {"inter_node": 2720}}),
    # (1, 2, 8), fp32: g = 2 (a GCD pair); cross groups {0, 2, 4, 6} {1, 3, 5, 7}, ring 0-2 intra_node,
    #   2-4 inter_node, 4-6 intra_node, 6-0 inter_node. S/2 = 52 + 120 + 120 + 48 = 340 elements = 1360 B.
    #   Reduce-scatter over k = 4: 3/4 x 1360 = 1020 per rank, 4 senders per tier -> 4080 each;
    #   all-reduce: 2 x 3/4 x 1360 = 2040 per rank -> 8160 each.
    ((1, 2, 8), 4, {"reduce_scatter": {"intra_node": 4080, "inter_node": 4080},
                    "all_reduce": {"intra_node": 8160, "inter_node": 8160}}),
])
def test_paper_all_reduce_cross_hop_sends_twice_the_reduce_scatter(factors, compute_bytes, expected):
    ledgers = {how: predict_ledger(CommSpec(UNITS, ShardLayout.resolve(LAYOUT, shard_factors=factors), micro_batches=2, compute_bytes=compute_bytes,
                                            cross_node_reduction=how))
               for how in ("reduce_scatter", "all_reduce")}
    for how, ledger in ledgers.items():
        assert {tier: n for (phase, tier), n in ledger.items() if phase == "cross_grad_reduce"} == expected[how]
    others = [{key: n for key, n in ledger.items() if key[0] != "cross_grad_reduce"} for ledger in ledgers.values()]
    assert others[0] == others[1]  # every other collective is the same


def test_two_ranks_eval_loss_vector_is_not_the_step_vector():
    # 1 node x 2 ranks (both intra_node), stage 0, one unit of 2 elements (S = 2), fp32, A = 1, one eval.
    # Each allreduce over 2 ranks sends 2 x 1/2 x B = B per rank. Replica allreduce of S fp32 = 8 B.
    # Control: grad norm 2 fp32 = 8 B; step vector 3 -> 4 float64 = 32 B; ledger 30 float64 = 240 B;
    # eval vector 2 float64 = 16 B (not padded to the step vector's 4): 8 + 32 + 240 + 16 = 296 per rank.
    spec = CommSpec((2,), ShardLayout.resolve((1, 2), preset="stage0"), eval_forward_passes=1)
    assert predict_ledger(spec) == {("replica_allreduce", "intra_node"): 16, ("control", "intra_node"): 592}


@pytest.mark.parametrize("preset", ["stage0", "stage2", "hsdp", "zero_topo", "zeropp"])
def test_per_rank_sums_to_total(preset):
    spec = CommSpec(UNITS, ShardLayout.resolve(LAYOUT, preset=preset), micro_batches=3, compute_bytes=2,
                    checkpointed_units=transformer_block_units(len(UNITS)), eval_forward_passes=2)
    total: dict = {}
    for entries in predict_ledger_per_rank(spec).values():
        for key, nbytes in entries.items():
            total[key] = total.get(key, 0) + nbytes
    assert total == predict_ledger(spec)


@pytest.mark.parametrize("tiers, kwargs, message", [
    ((8,), dict(preset="stage3"), "layout"),
    ((2, 2, 2), dict(preset="stage4"), "unknown ZeRO preset"),
    ((2, 2, 2), dict(shard_factors=(2, 3, 6)), "w | g | os"),
    ((2, 2, 2), dict(shard_factors=(2, 4, 16)), "w | g | os"),
])
def test_bad_layouts_are_refused_by_the_layout(tiers, kwargs, message):
    with pytest.raises(TopologyError, match=message):
        ShardLayout.resolve(tiers, **kwargs)


HSDP, ZERO_TOPO, ZEROPP = (ShardLayout.resolve((2, 2, 2), preset=p) for p in ("hsdp", "zero_topo", "zeropp"))


@pytest.mark.parametrize("kwargs, message", [
    (dict(layout=(2, 2, 2)), "layout must be a ShardLayout"),
    (dict(layout=HSDP, compute_bytes=3), "compute_bytes"),
    (dict(layout=HSDP, checkpointed_units={7}), "checkpointed_units"),
    (dict(layout=ZERO_TOPO, cross_node_reduction="ring"), "cross_node_reduction must be one of"),
    (dict(layout=ZERO_TOPO, cross_node_reduction="all_reduce",
          quant=QuantSpec(cross_node_grad_bits=4)), r"needs cross_node_grad_bits 0 \(got 4\)"),
    (dict(layout=ZEROPP, cross_node_reduction="all_reduce"), "not zeropp"),
])
def test_bad_specs_are_refused(kwargs, message):
    with pytest.raises(CommModelError, match=message):
        CommSpec(UNITS, **kwargs)
