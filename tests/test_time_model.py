"""The step-time model (megatron/analytic/time_model.py) against values worked out by hand.

Each expected number below is written as the arithmetic a reader would do on paper from the
algorithm's definition (a ring over k ranks takes k - 1 steps and moves (k - 1)/k of the buffer
through each member; the engine's schedule of docs/engine.md), never by calling the model's helpers.
"""
from __future__ import annotations

import json

import pytest

from megatron.topology.layout import ShardLayout
from megatron.analytic.comm_model import CommModelError, CommSpec, bytes_by_tier, predict_ledger
from megatron.config.quant_spec import QuantSpec
from megatron.topology.names import ALL_GATHER, REDUCE_SCATTER
from megatron.topology.algorithms import ALL_TO_ALL_SUM, RING_ALLGATHER, RING_REDUCE_SCATTER
from megatron.analytic.hardware import PROBE_FORMAT, Device, Hardware, TierLink
from megatron.analytic.time_model import (COMPUTE, OPTIMIZER, RECOMPUTE, StepWork, algorithm_of, footprint,
                                           footprint_time_s, ledger_bytes_by_tier, scaling_efficiency, step_time)

# Round figures so the hand arithmetic stays readable: bytes/s into one domain, seconds per step.
INTER_BW, INTER_LAT = 100.0, 1.0    # a node's NICs
INTRA_BW, INTRA_LAT = 1000.0, 0.1   # one rank's in-node links
GCD_BW, GCD_LAT = 4000.0, 0.01      # one rank's link to its package twin


def toy_hardware(backend: str = "nccl", efficiency: float = 0.0, flops: float = 1000.0,
                 optimizer_rate: float = 100.0, quantize_rate: float = 1e9) -> Hardware:
    links = {"inter_node": TierLink(INTER_BW, INTER_LAT), "intra_node": TierLink(INTRA_BW, INTRA_LAT),
             "intra_gpu": TierLink(GCD_BW, GCD_LAT)}
    return Hardware(links, Device("toy", flops, optimizer_rate, quantize_rate, efficiency, 1e12), backend)


# -- one collective ------------------------------------------------------------------------------

def test_a_world_ring_on_two_nodes_of_two_is_bound_by_the_node_link():
    # Ring 0 -> 1 -> 2 -> 3 -> 0 on nodes {0, 1} {2, 3}: hops 1->2 and 3->0 cross nodes, so each node
    # sends out 3/4 of B once and receives 3/4 of B once; each rank sends 3/4 of B over its tier.
    fp = footprint([[0, 1, 2, 3]], (2, 2), RING_ALLGATHER)
    assert fp.steps == 3 and fp.slowest_tier == "inter_node"
    assert fp.domain_load == {"inter_node": 0.75, "intra_node": 0.75}
    hw = toy_hardware()
    nbytes = 1600
    expected = 3 * INTER_LAT + max(0.75 * nbytes / INTER_BW, 0.75 * nbytes / INTRA_BW)
    assert footprint_time_s(fp, nbytes, hw) == pytest.approx(expected)  # 3 + 12 s


def test_an_all_to_all_loads_a_node_with_what_its_ranks_send_off_node():
    # k = 4 on (2, 2): each rank sends B/4 to each of the 2 ranks on the other node, so a node sends
    # 2 ranks x 2 x B/4 = B; and B/4 to its node twin over the in-node tier.
    fp = footprint([[0, 1, 2, 3]], (2, 2), "all_to_all")
    assert fp.steps == 3
    assert fp.domain_load == {"inter_node": 1.0, "intra_node": 0.25}


def test_concurrent_groups_share_a_node_link():
    # Two cross groups {0, 2} and {1, 3} run at once: node 0 sends rank 0's and rank 1's halves.
    one = footprint([[0, 2]], (2, 2), RING_ALLGATHER)
    both = footprint([[0, 2], [1, 3]], (2, 2), RING_ALLGATHER)
    assert one.domain_load["inter_node"] == 0.5
    assert both.domain_load["inter_node"] == 1.0
    assert both.domain_load["intra_node"] == 0.0


def test_the_reduce_scatter_is_the_one_the_backend_runs():
    # gloo: ours (comm.py) is an all-to-all + local sum inside one tier, a ring of sends across tiers.
    assert algorithm_of(REDUCE_SCATTER, [0, 1], (2, 2), "gloo") == ALL_TO_ALL_SUM
    assert algorithm_of(REDUCE_SCATTER, [0, 2], (2, 2), "gloo") == ALL_TO_ALL_SUM
    assert algorithm_of(REDUCE_SCATTER, [0, 1, 2, 3], (2, 2), "gloo") == RING_REDUCE_SCATTER
    assert algorithm_of(REDUCE_SCATTER, [0, 1], (2, 2), "nccl") == RING_REDUCE_SCATTER
    assert algorithm_of(ALL_GATHER, [0, 1], (2, 2), "gloo") == RING_ALLGATHER
    with pytest.raises(CommModelError, match="unknown collective op"):
        algorithm_of("broadcast", [0, 1], (2, 2), "nccl")


# -- a whole step, by hand ---------------------------------------------------------------------

# zero3 on 2 nodes x 2 ranks, fp32, three units of 400 elements (multiples of N = 4: no padding).
UNITS = (400, 400, 400)
B = 400 * 4                                                   # one unit in fp32, bytes
RING = 3 * INTER_LAT + 0.75 * B / INTER_BW                    # world all-gather / reduce-scatter: 3 + 12 s
CONTROL = sum(6 * INTER_LAT + 1.5 * nbytes / INTER_BW         # world all-reduces: 2(k-1) steps, 2(k-1)/k of B
              for nbytes in (4 * 4, 36 * 8))                  # norm partials (fp32 x N), the step vector: loss
#                                                               (3) and the ledger's counters (30), 33 -> 36 x fp64
TOKENS, FLOPS_PER_TOKEN = 10, (0.0, 400.0, 300.0)             # embedding lookup, a block, the head
FWD = [f * TOKENS / 1000.0 for f in FLOPS_PER_TOKEN]          # 0, 4, 3 s at 1000 FLOP/s
OPTIMIZER_S = 3 * 100 / 100.0                                 # 3 units x S/os = 100 elements at 100/s


def zero3_spec(**kw) -> CommSpec:
    return CommSpec(UNITS, ShardLayout.resolve((2, 2), preset="stage3"), **kw)


def test_a_step_with_nothing_overlapped_is_the_sum_of_its_parts():
    # Per micro-batch: 3 forward gathers, 2 backward gathers (the head stays gathered), 3 reductions.
    work = StepWork(TOKENS, FLOPS_PER_TOKEN, prefetch_gathers=False, overlap_comm=False)
    st = step_time(zero3_spec(), toy_hardware(), work)
    compute = sum(FWD) + sum(2 * f for f in FWD)
    assert st.exposed_s[COMPUTE] == pytest.approx(compute)
    assert st.exposed_s["fwd_gather"] == pytest.approx(3 * RING)
    assert st.exposed_s["bwd_gather"] == pytest.approx(2 * RING)
    assert st.exposed_s["grad_reduce"] == pytest.approx(3 * RING)
    assert st.exposed_s["control"] == pytest.approx(CONTROL)
    assert st.exposed_s[OPTIMIZER] == pytest.approx(OPTIMIZER_S)
    assert st.total_s == pytest.approx(compute + 8 * RING + CONTROL + OPTIMIZER_S)
    assert st.hidden_s == pytest.approx(0.0)
    assert st.model_flops == pytest.approx(3 * sum(FLOPS_PER_TOKEN) * TOKENS)
    assert st.tflops_per_device == pytest.approx(st.model_flops / st.total_s / 1e12)


@pytest.mark.parametrize("matmuls", [True, False])
def test_a_checkpointed_block_recomputes_its_forward_unless_selective(matmuls):
    # Block 1 checkpointed: full recompute runs its forward (4 s) again before its backward;
    # selective recompute repeats no matmul (nothing the FLOP formula counts). Either way the
    # block's backward gather is the recompute's (recompute_gather), same ring.
    work = StepWork(TOKENS, FLOPS_PER_TOKEN, prefetch_gathers=False, overlap_comm=False, recompute_matmuls=matmuls)
    st = step_time(zero3_spec(checkpointed_units={1}), toy_hardware(), work)
    assert st.exposed_s.get(RECOMPUTE, 0.0) == pytest.approx(4.0 if matmuls else 0.0)
    assert st.exposed_s["recompute_gather"] == pytest.approx(RING)
    assert st.exposed_s["bwd_gather"] == pytest.approx(RING)  # the head's neighbour, unit 0
    assert st.model_flops == pytest.approx(3 * sum(FLOPS_PER_TOKEN) * TOKENS)  # recompute is not model work


def test_prefetch_and_overlapped_reduction_hide_what_the_schedule_says():
    # docs/engine.md: forward, unit 0's gather is exposed and unit u's compute hides unit u+1's
    # gather; backward (units 2, 1, 0), unit u's compute hides unit u-1's gather and unit u+1's
    # reduction; unit 0's reduction is waited for at the end. Hardware that overlaps fully: a
    # window of compute C and communication M costs max(C, M).
    G = R = RING
    f0, f1, f2 = FWD
    forward = G + max(f0, G) + max(f1, G) + f2
    backward = max(2 * f2, G) + max(2 * f1, G + R) + max(2 * f0, R) + R
    expected = forward + backward + CONTROL + OPTIMIZER_S
    work = StepWork(TOKENS, FLOPS_PER_TOKEN, prefetch_gathers=True, overlap_comm=True)
    st = step_time(zero3_spec(), toy_hardware(efficiency=1.0), work)
    assert st.total_s == pytest.approx(expected)
    # Nothing is hidden on hardware that cannot overlap: the sum again.
    flat = step_time(zero3_spec(), toy_hardware(efficiency=0.0), work)
    assert flat.total_s == pytest.approx(sum(FWD) * 3 + 8 * RING + CONTROL + OPTIMIZER_S)


def test_each_tier_hides_with_its_own_overlap_efficiency():
    # zero_topo (2, 2, 4) on (2, 2): micro-step gathers and reductions stay in the node (intra_node).
    # A device that hides in-node transfers at 0.5 and cross-node ones fully: in-node windows of
    # compute C and transfers M cost C + M - min(0.5 M, 0.5 C); the boundary hides nothing anyway.
    units = (800, 800, 800)
    spec = CommSpec(units, ShardLayout.resolve((2, 2), preset="zero_topo"))
    node_pair = 1 * INTRA_LAT + 0.5 * 800 * 4 / INTRA_BW           # one gather or reduce-scatter: 1.7 s
    f0, f1, f2 = FWD
    G = R = node_pair

    def window(c, m):
        return c + m - min(0.5 * m, 0.5 * c)
    forward = G + window(f0, G) + window(f1, G) + f2
    backward = window(2 * f2, G) + window(2 * f1, G + R) + window(2 * f0, R) + R
    cross = 1 * INTER_LAT + 1.0 * 800 * 4 // 2 / INTER_BW            # S/g over two concurrent pairs per node
    control = sum(_allreduce(n) for n in (4 * 4, 36 * 8))  # norm; step vector with the ledger (33 -> 36)
    optimizer = 3 * 200 / 100.0                                      # S/os = 200 elements per unit
    base = toy_hardware(efficiency=1.0)
    device = Device("toy", 1000.0, 100.0, 1e9, 1.0, 1e12, {"intra_node": 0.5})
    hw = Hardware(base.links, device, "nccl")
    st = step_time(spec, hw, StepWork(TOKENS, FLOPS_PER_TOKEN, prefetch_gathers=True, overlap_comm=True))
    assert st.total_s == pytest.approx(forward + backward + 3 * cross + 3 * cross + control + optimizer)


def _allreduce(nbytes: int) -> float:
    """A world all-reduce on (2, 2): 6 steps at the node link's latency, each node sends 2 x 3/4 B."""
    return 6 * INTER_LAT + 1.5 * nbytes / INTER_BW


def test_quantization_kernels_are_never_hidden():
    # The same INT8 gathers as below, on a device that hides transfers fully: the wire time of
    # unit u+1's gather hides behind unit u's forward, its kernel time does not.
    block = 100
    quant = QuantSpec.from_settings(quantized_weights=True, block_size=block)
    spec = CommSpec((1600, 1600, 1600), ShardLayout.resolve((2, 2), preset="stage3"), quant=quant)
    rate = 1000.0
    kernel = 1600 * (1 + 1 / 4) / 2 / rate                            # 1 s per gather
    hw = toy_hardware(efficiency=1.0, quantize_rate=rate)
    long_forward = StepWork(TOKENS, (1e6, 1e6, 1e6), prefetch_gathers=True, overlap_comm=True)
    st = step_time(spec, hw, long_forward)
    wire = 3 * INTER_LAT + 0.75 * (1600 + 4 * 1600 // block) / INTER_BW
    # forward gathers: unit 0's exposed (wire + kernel), units 1 and 2 behind compute (kernel only)
    assert st.exposed_s["fwd_gather"] == pytest.approx(wire + kernel + 2 * kernel)


def test_accumulation_repeats_the_micro_step_and_not_the_boundary():
    work = StepWork(TOKENS, FLOPS_PER_TOKEN, prefetch_gathers=False, overlap_comm=False)
    one = step_time(zero3_spec(micro_batches=1), toy_hardware(), work).total_s
    four = step_time(zero3_spec(micro_batches=4), toy_hardware(), work).total_s
    per_micro = sum(FWD) * 3 + 8 * RING
    assert four - one == pytest.approx(3 * per_micro)


def test_zero_topo_pays_the_cross_node_hops_once_per_step():
    # zero_topo (2, 2, 4) on (2, 2): the weight group is a node, so micro-steps never leave it;
    # at the boundary the cross groups {0, 2} {1, 3} reduce-scatter S/2 and gather it back.
    units = (800, 800, 800)                                  # multiples of 4
    spec = CommSpec(units, ShardLayout.resolve((2, 2), preset="zero_topo"), micro_batches=2)
    work = StepWork(TOKENS, (0.0, 0.0, 0.0), prefetch_gathers=False, overlap_comm=False)
    st = step_time(spec, toy_hardware(), work)
    half = 800 * 4 // 2                                      # S/g bytes, the cross hop's buffer
    # two concurrent 2-rank rings per node pair: each node sends 2 x 1/2 of the buffer, one step
    cross = 1 * INTER_LAT + 1.0 * half / INTER_BW
    node_pair = 1 * INTRA_LAT + 0.5 * 800 * 4 / INTRA_BW     # weight group {0, 1}: a 2-rank ring
    assert st.exposed_s["cross_grad_reduce"] == pytest.approx(3 * cross)
    assert st.exposed_s["refresh"] == pytest.approx(3 * cross)
    assert st.exposed_s["fwd_gather"] == pytest.approx(2 * 3 * node_pair)
    assert st.inter_node_comm_s["cross_grad_reduce"] == pytest.approx(3 * cross)
    assert "fwd_gather" not in st.inter_node_comm_s


def test_quantized_collectives_pay_their_kernels():
    # INT8 gathers: the packed buffer is smaller and each gather adds its kernels: its own chunk
    # quantized (S/k elements) and all k chunks dequantized (S), at a rate counted per quantize +
    # dequantize pair, so (S/k + S)/2 elements' worth.
    block = 100
    quant = QuantSpec.from_settings(quantized_weights=True, block_size=block)
    units = (1600, 1600, 1600)                               # multiples of N x b = 400
    spec = CommSpec(units, ShardLayout.resolve((2, 2), preset="stage3"), quant=quant)
    rate = 1000.0
    work = StepWork(TOKENS, (0.0, 0.0, 0.0), prefetch_gathers=False, overlap_comm=False)
    st = step_time(spec, toy_hardware(quantize_rate=rate), work)
    packed = 1600 * 1 + 4 * 1600 // block                    # codes + fp32 scales
    gather = 3 * INTER_LAT + 0.75 * packed / INTER_BW + 1600 * (1 + 1 / 4) / 2 / rate
    assert st.exposed_s["fwd_gather"] == pytest.approx(3 * gather)


def test_a_layout_the_hardware_does_not_describe_is_a_clear_error():
    hw = Hardware({"inter_node": TierLink(1.0, 0.0)}, toy_hardware().device)
    with pytest.raises(CommModelError, match="no figures for tiers"):
        step_time(zero3_spec(), hw, StepWork(TOKENS, FLOPS_PER_TOKEN))
    with pytest.raises(CommModelError, match="unit FLOP counts"):
        step_time(zero3_spec(), toy_hardware(), StepWork(TOKENS, (1.0,)))


def test_scaling_efficiency_is_against_the_smallest_node_count():
    assert scaling_efficiency({16: 45.0, 8: 50.0, 48: 40.0}) == {8: 1.0, 16: 0.9, 48: 0.8}


# -- bytes per tier: the planner's shortcut equals the ledger model --------------------------

@pytest.mark.parametrize("layout,preset,micro", [((2, 2, 2), "zero_topo", 1), ((2, 2, 2), "stage3", 3),
                                                 ((2, 4), "hsdp", 2), ((2, 2, 2), "zeropp", 2),
                                                 ((4, 2, 2), "stage2", 1)])
def test_bytes_by_tier_equal_the_rank_by_rank_ledger_model(layout, preset, micro):
    spec = CommSpec((1000, 3000, 2000), ShardLayout.resolve(layout, preset=preset), micro_batches=micro)
    fast = ledger_bytes_by_tier(spec)
    slow = bytes_by_tier(predict_ledger(spec))
    assert set(fast) == set(slow)
    for tier, nbytes in slow.items():
        assert fast[tier] == pytest.approx(nbytes)


def test_more_accumulation_never_raises_zero_topo_inter_node_bytes_but_grows_zero3_linearly():
    units = (4096, 8192, 8192, 4096)
    inter = {}
    for preset in ("zero_topo", "stage3"):
        inter[preset] = [ledger_bytes_by_tier(CommSpec(units, ShardLayout.resolve((2, 2, 2), preset=preset), micro_batches=a))["inter_node"]
                         for a in range(1, 9)]
    topo, zero3 = inter["zero_topo"], inter["stage3"]
    assert all(b <= a for a, b in zip(topo, topo[1:]))
    steps = [b - a for a, b in zip(zero3, zero3[1:])]
    assert steps[0] > 0 and all(s == pytest.approx(steps[0]) for s in steps)
    # zero3's growth is its micro-step traffic: gathers and reductions of every unit, every micro-step.
    assert zero3[0] > topo[0]


# -- the probe feeds the model ----------------------------------------------------------------

def probe_dict(**overrides) -> dict:
    data = {"format": PROBE_FORMAT, "backend": "gloo",
            "tiers": {"inter_node": {"bandwidth_gbs": 1e-7, "latency_us": 2e6},
                      "intra_node": {"bandwidth_gbs": 1e-6, "latency_us": 1e5}},
            "algorithms": {"ring_reduce_scatter": {"inter_node": {"bandwidth_gbs": 5e-8, "latency_us": 4e6}}},
            "device": {"achieved_flops": 500.0, "overlap_efficiency": 0.5, "overlap_by_tier": {"intra_node": 0.1}}}
    data.update(overrides)
    return data


def test_probe_figures_replace_the_presets_per_tier_and_per_algorithm(tmp_path):
    path = tmp_path / "probe.json"
    path.write_text(json.dumps(probe_dict()))
    hw = toy_hardware().with_probe(str(path), str(path))
    assert hw.backend == "gloo" and hw.source == f"probe {path} on nominal"
    assert hw.link(RING_ALLGATHER, "inter_node") == TierLink(100.0, 2.0)          # the probe's tier figures
    assert hw.link(RING_REDUCE_SCATTER, "inter_node") == TierLink(50.0, 4.0)      # measured per algorithm
    assert hw.link("ring_allreduce", "inter_node") == TierLink(100.0, 2.0)        # falls back to the ring gather
    assert hw.link(RING_ALLGATHER, "intra_gpu") == TierLink(GCD_BW, GCD_LAT)      # not probed: the preset's
    assert hw.device.achieved_flops == 500.0 and hw.device.overlap_efficiency == 0.5
    assert hw.device.overlap("intra_node") == 0.1 and hw.device.overlap("inter_node") == 0.5
    assert hw.device.optimizer_elements_per_s == 100.0
    # ... and the step reads them: nothing overlapped, world ring gathers at the probe's inter-node rate.
    work = StepWork(TOKENS, FLOPS_PER_TOKEN, prefetch_gathers=False, overlap_comm=False)
    st = step_time(zero3_spec(), hw, work)
    assert st.exposed_s["fwd_gather"] == pytest.approx(3 * (3 * 2.0 + max(0.75 * B / 100.0, 0.75 * B / 1000.0)))
    assert st.exposed_s[COMPUTE] == pytest.approx(3 * sum(FLOPS_PER_TOKEN) * TOKENS / 500.0)
    # gloo's world reduce-scatter spans two tiers: the ring of sends, at its own measured figures
    assert st.exposed_s["grad_reduce"] == pytest.approx(3 * (3 * 4.0 + max(0.75 * B / 50.0, 0.75 * B / 1000.0)))


@pytest.mark.parametrize("bad,match", [({"format": "x"}, "not a link probe"),
                                       ({"algorithms": {"tree": {}}}, "unknown algorithm"),
                                       ({"tiers": {"inter_node": {"bandwidth_gbs": 0, "latency_us": 1}}}, "must be > 0"),
                                       ({"tiers": {"inter_node": {"latency_us": 1}}}, "needs numbers"),
                                       ({"device": {"overlap_by_tier": {"inter_node": 1.5}}}, "in \\[0, 1\\]")])
def test_a_bad_probe_is_a_one_line_error(bad, match):
    with pytest.raises(CommModelError, match=match):
        toy_hardware().with_probe(probe_dict(**bad), "p.json")


def test_an_unreadable_probe_file_names_the_file(tmp_path):
    path = tmp_path / "nope.json"
    with pytest.raises(CommModelError, match="cannot read the link probe .*nope.json"):
        toy_hardware().with_probe(str(path), str(path))


def test_unit_flops_by_hand():
    """The per-unit split the time model reads, computed by hand (the training log's TFLOPS read the
    same function: tests/test_model.py's golden total)."""
    from megatron.config.schema import ModelConfig
    from megatron.model.sizes import unit_flops_per_token
    cfg = ModelConfig(num_layers=3, hidden_size=64, num_attention_heads=4, seq_length=32,
                      max_position_embeddings=32)
    per_unit = unit_flops_per_token(cfg, 1000)
    # block: 2 * (3*64^2 + 64^2 + 2*64*256) + 2 * 2 * 32 * 64 = 98304 + 8192; head: 2 * 64 * 1000
    assert per_unit == (0.0, 106496.0, 106496.0, 106496.0, 128000.0)
