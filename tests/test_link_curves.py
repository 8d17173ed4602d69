"""Latency-bandwidth curves per (algorithm, group shape), the Frontier figure sets and the
DeepSpeed baselines' collectives, against values worked out by hand (each expected number is the
arithmetic a reader does from the definitions in hardware.py / deepspeed_model.py, never the
model's helpers)."""
from __future__ import annotations

import pytest

from megatron.topology.layout import ShardLayout
from megatron.topology import Topology
from megatron.analytic.comm_model import CommModelError, CommSpec
from megatron.config.quant_spec import QuantSpec
from megatron.topology.names import ALL_GATHER, ALL_TO_ALL, REDUCE_SCATTER
from megatron.analytic.deepspeed_model import DeepSpeedSettings, deepspeed_collectives
from megatron.analytic.figure_sets import FIGURE_SETS, SOURCES
from megatron.topology.algorithms import PAIRWISE_ALL_TO_ALL, RING_ALLGATHER, RING_ALLREDUCE, RING_REDUCE_SCATTER
from megatron.analytic.hardware import Device, Hardware, TierLink, group_shape
from megatron.analytic.link_curve import LinkCurve
from megatron.analytic.time_model import StepWork, footprint, footprint_time_s, step_time

SLOW = {"inter_node": TierLink(1.0, 100.0), "intra_node": TierLink(1.0, 100.0), "intra_gpu": TierLink(1.0, 100.0)}
DEVICE = Device("toy", 1000.0, 100.0, 1e9, 0.0, 1e12)


def curve_hardware(curves: dict) -> Hardware:
    """Tier figures so slow that any use of them would show: only the curves may decide."""
    return Hardware(SLOW, DEVICE, "nccl", curves=curves)


def test_shapes_say_what_decides_the_rate():
    layout = (2, 4, 2)  # 2 nodes x 4 GPUs x 2 GCDs: ranks 0-7 on node 0
    assert group_shape([0, 1], layout) == "pair"
    assert group_shape([0, 2, 4, 6], layout) == "node"
    assert group_shape([0, 8], layout) == "cross"
    assert group_shape(list(range(16)), layout) == "world"
    assert group_shape([0, 1, 8, 9], layout) == "world"
    assert group_shape([0, 1], (2, 2)) == "node"  # two tiers: no GCD pair


def test_a_curve_interpolates_on_log_log_axes_with_a_latency_floor_below():
    curve = LinkCurve(((1e3, 1e9), (1e5, 1e11)))
    assert curve.bandwidth(1e4) == pytest.approx(1e10)    # halfway in log step bytes: halfway in log rate
    assert curve.bandwidth(1e9) == 1e11                    # above: the last rate
    # below: a step of 10 bytes takes as long as the 1,000-byte step did (1 us), so 10 bytes/us
    assert curve.bandwidth(10.0) == pytest.approx(1e7)
    with pytest.raises(CommModelError, match="ascending"):
        LinkCurve(((1e5, 1.0), (1e3, 1.0)))


def test_a_latency_bound_small_collective():
    # A world all-gather of 8 bytes on 2 nodes x 2 (k = 4): 3 steps of 2 bytes. The curve's latency
    # is 1 ms a step and its rate 1 GB/s: 3 ms + 8 x 3/4 / 1e9 s (each node sends 3/4 of B once).
    hw = curve_hardware({(RING_ALLGATHER, "world"): LinkCurve(((1.0, 1e9),), 1e-3)})
    fp = footprint([[0, 1, 2, 3]], (2, 2), RING_ALLGATHER)
    assert fp.shape == "world"
    assert footprint_time_s(fp, 8, hw) == pytest.approx(3e-3 + 6 / 1e9)
    # the all-reduce falls back to the all-gather's curve, with its own 2(k - 1) steps and 2x the bytes
    fp = footprint([[0, 1, 2, 3]], (2, 2), RING_ALLREDUCE)
    assert footprint_time_s(fp, 8, hw) == pytest.approx(6e-3 + 12 / 1e9)


def test_a_world_ring_against_eight_side_by_side_cross_groups_at_the_same_node_rate():
    # 2 nodes x 8 ranks. Each rank holds B/16 of a buffer B. One world ring (k = 16) sends 15/16 of B
    # out of each node; eight cross groups (k = 2, one rank per node, B/8 each) send 8 x 1/2 x B/8 =
    # B/2 out of each node. Both steps move B/16 bytes, so one rate applies: R = 100 B/s per node.
    layout, nbytes, rate = (2, 4, 2), 1600, 100.0
    flat = LinkCurve(((1.0, rate),))
    hw = curve_hardware({(RING_ALLGATHER, "world"): flat, (RING_ALLGATHER, "cross"): flat})
    world = footprint([list(range(16))], layout, RING_ALLGATHER)
    cross = footprint([[r, r + 8] for r in range(8)], layout, RING_ALLGATHER)
    assert (world.shape, cross.shape) == ("world", "cross")
    assert footprint_time_s(world, nbytes, hw) == pytest.approx(nbytes * 15 / 16 / rate)   # 15 s
    assert footprint_time_s(cross, nbytes // 8, hw) == pytest.approx(nbytes / 2 / rate)    # 8 s


def test_the_step_bytes_pick_the_rate():
    # The same 1 MiB buffer: a 2-rank cross ring steps 512 KiB, a 32-rank world ring 32 KiB.
    curve = LinkCurve(((32 * 1024, 1e9), (512 * 1024, 16e9)))
    hw = curve_hardware({(RING_ALLGATHER, "world"): curve, (RING_ALLGATHER, "cross"): curve})
    world = footprint([list(range(32))], (4, 4, 2), RING_ALLGATHER)
    assert footprint_time_s(world, 2 ** 20, hw) == pytest.approx(2 ** 20 * 31 / 32 / 1e9)


def test_frontier_measured_reads_the_pccl_tables():
    # The clean runs' all-gather at 1 MiB ring steps: median busbw of the 2-64 node jobs, 29.865 GB/s
    # (figure_sets.CLEAN_POINTS, checked against the CSV in test_pccl_frontier.py). A world all-gather
    # of 32 MiB on 4 Frontier nodes (32 ranks) steps 1 MiB: each node sends 31/32 of it at that rate.
    hw = Hardware.from_topology(Topology.preset("frontier", 4), figures="frontier-measured")
    assert hw.figure_set == "frontier-measured" and hw.source.startswith("frontier-measured")
    fp = footprint([list(range(32))], (4, 4, 2), RING_ALLGATHER)
    assert footprint_time_s(fp, 32 * 2 ** 20, hw) == pytest.approx(32 * 2 ** 20 * 31 / 32 / 29.865e9)
    # the reduce-scatter has its own rows: 32.847 GB/s at 1 MiB steps
    fp = footprint([list(range(32))], (4, 4, 2), RING_REDUCE_SCATTER)
    assert footprint_time_s(fp, 32 * 2 ** 20, hw) == pytest.approx(32 * 2 ** 20 * 31 / 32 / 32.847e9)
    # one GCD per node, 8 side by side, 8 MiB steps: capped at the all-gather's plateau, 71.671 GB/s
    # per node (its highest point: the 2-node job's 64 MiB steps)
    cross = footprint([[r, r + 8, r + 16, r + 24] for r in range(8)], (4, 4, 2), RING_ALLGATHER)
    big = 8 * 2 ** 20 * 4
    assert footprint_time_s(cross, big, hw) == pytest.approx(8 * big * 3 / 4 / 71.671e9)
    # the eager runs at 128 KiB steps: 0.336 GB/s, the collapse
    eager = Hardware.from_topology(Topology.preset("frontier", 4), figures="frontier-eager")
    fp = footprint([list(range(32))], (4, 4, 2), RING_ALLGATHER)
    assert footprint_time_s(fp, 4 * 2 ** 20, eager) == pytest.approx(4 * 2 ** 20 * 31 / 32 / 0.336e9)
    assert hw.device.achieved_flops == pytest.approx(0.3838 * 191.5e12) == eager.device.achieved_flops


@pytest.mark.parametrize("name", ["frontier-measured", "frontier-eager"])
def test_every_frontier_curve_names_its_sources(name):
    curves = FIGURE_SETS[name].curves
    shapes = {shape for _, shape in curves}
    assert shapes == {"pair", "node", "cross", "world"}
    for (algorithm, shape), curve in curves.items():
        named = [key for key in SOURCES if key in curve.source]
        assert named, f"{algorithm}/{shape}: {curve.source!r} names no source"


def test_a_probe_curve_replaces_the_published_one(tmp_path):
    from megatron.analytic.hardware import PROBE_FORMAT
    probe = {"format": PROBE_FORMAT, "curves": {"ring_allgather": {"world": {"points": [[1024, 2.0], [2048, 4.0]]}}}}
    hw = Hardware.from_topology(Topology.preset("frontier", 2), figures="frontier-measured").with_probe(probe, "p")
    # between (1 KiB, 2 GB/s) and (2 KiB, 4 GB/s) the rate is proportional to the step bytes on log-log axes
    assert hw.curve(RING_ALLGATHER, "world").bandwidth(1536) == pytest.approx(3e9)
    # what the probe lacks stays the published set's
    assert hw.curve(RING_REDUCE_SCATTER, "world") == FIGURE_SETS["frontier-measured"].curves[(RING_REDUCE_SCATTER, "world")]
    assert hw.figure_set == "frontier-measured" and hw.source == "probe p on frontier-measured"
    with pytest.raises(CommModelError, match="unknown group shape"):
        hw.with_probe({"format": PROBE_FORMAT, "curves": {"ring_allgather": {"ring": {"points": [[1, 1]]}}}}, "p")


# -- DeepSpeed as it runs ---------------------------------------------------------------------

# Three units on 2 nodes x 2 ranks (N = 4): an embedding, a block of a 2-D weight and a 1-D bias,
# a head. Thresholds chosen so the counts are easy to follow.
SHAPES = [[("embed.weight", (40, 10))], [("w", (30, 10)), ("b", (30,))], [("head.weight", (40, 10))]]
NUMELS = (400, 330, 400)
SETTINGS = DeepSpeedSettings(reduce_bucket_size=650, prefetch_bucket_size=350, param_persistence_threshold=50,
                             max_reuse_distance=100)


def ds_spec(preset: str, **kw) -> CommSpec:
    return CommSpec(NUMELS, ShardLayout.resolve((2, 2), preset=preset), compute_bytes=2, **kw)


def test_zero3_gathers_per_fetch_and_reduces_per_bucket():
    cols = [c for c in deepspeed_collectives(ds_spec("stage3", micro_batches=2), SHAPES, SETTINGS)
            if c.phase != "control"]
    gathers = [(c.phase, c.unit, c.numel, c.count) for c in cols if c.op == ALL_GATHER]
    # The bias (30 <= 50) persists: unit 1 fetches only w (300); each unit one call. The head is used
    # again at once (0 elements after it < 100): no backward gather; the others are re-gathered.
    assert gathers == [("fwd_gather", 0, 400, 2), ("bwd_gather", 0, 400, 2), ("fwd_gather", 1, 300, 2),
                       ("bwd_gather", 1, 300, 2), ("fwd_gather", 2, 400, 2),
                       ("refresh", None, 32, 1)]  # the persistent bias, ceil(30 / 4) x 4, after the step
    # Backward order: head 400, bias 30, w 300 (400 + 30 + 300 > 650 flushes [head, bias] at unit 1),
    # embedding 400 (300 + 400 > 650 flushes [w] at unit 0), the rest at the end (unit 0).
    reductions = [(c.unit, c.numel, c.count) for c in cols if c.op == REDUCE_SCATTER]
    assert reductions == [(1, 400 + 32, 2), (0, 300, 2), (0, 400, 2)]
    assert all(c.group == "world" and c.elem_bytes == 2 for c in cols)


def test_zeropp_quantized_as_deepspeed_runs_it():
    quant = QuantSpec.from_settings(quantized_weights=True, quantized_gradients=True, block_size=10)
    cols = deepspeed_collectives(ds_spec("zeropp", quant=quant), SHAPES,
                                 DeepSpeedSettings(param_persistence_threshold=50, qwz_group_size=25,
                                                   max_reuse_distance=100))
    unit1 = [(c.phase, c.op, c.group, c.numel, c.elem_bytes, c.count) for c in cols if c.unit == 1]
    # forward: the world gather (the step's first) of w's 300 int8 codes, then its 300/4 / 25 = 3
    # scales per rank x 4 ranks in fp32; the backward's from the node secondary (k = 2): 300 codes,
    # 150 / 25 = 6 scales per rank x 2.
    assert unit1[:4] == [("fwd_gather", ALL_GATHER, "world", 300, 1, 1), ("fwd_gather", ALL_GATHER, "world", 12, 4, 1),
                         ("bwd_gather", ALL_GATHER, "node", 300, 1, 1), ("bwd_gather", ALL_GATHER, "node", 12, 4, 1)]
    first = [c for c in cols if c.unit == 1 and c.phase == "fwd_gather"][0]
    assert first.copy_bytes == 300 // 2 * 2   # the node secondary: 150 elements of 2 bytes kept
    # qgZ, per tensor: w (30 x 10) is four all-to-alls: 150 bytes of INT4 codes and max(30, 10, 4) = 30
    # fp32 scales in the node, then the node's share (150 elements: 75 bytes) and 30 / 2 scales on the
    # rail; the 1-D bias is its own world reduce-scatter (ceil(30 / 4) x 4 = 32 elements).
    grads = [(c.op, c.group, c.numel, c.elem_bytes) for c in cols if c.phase == "grad_reduce"]
    assert (ALL_TO_ALL, "node", 150, 1) in grads and (ALL_TO_ALL, "node", 120, 1) in grads
    assert (ALL_TO_ALL, "rail", 75, 1) in grads and (ALL_TO_ALL, "rail", 60, 1) in grads
    assert (REDUCE_SCATTER, "world", 32, 2) in grads


def test_a_bucketed_zero3_step_by_hand():
    # Nothing overlapped, a flat world curve of 1 byte/s per node and no latency: each collective's
    # time is its bytes through a node, (k - 1)/k = 3/4 of B for a world ring on 2 nodes x 2.
    hw = curve_hardware({(RING_ALLGATHER, "world"): LinkCurve(((1.0, 1.0),))})
    spec = ds_spec("stage3")
    work = StepWork(10, (0.0, 0.0, 0.0), prefetch_gathers=False, overlap_comm=False)
    st = step_time(spec, hw, work, deepspeed_collectives(spec, SHAPES, SETTINGS))
    gathers = (400 + 400 + 300 + 300 + 400) * 2 * 3 / 4      # five gathers of 2-byte elements
    reduces = (432 + 300 + 400) * 2 * 3 / 4
    refresh = 32 * 2 * 3 / 4
    assert st.exposed_s["fwd_gather"] + st.exposed_s["bwd_gather"] == pytest.approx(gathers)
    assert st.exposed_s["grad_reduce"] == pytest.approx(reduces)
    assert st.exposed_s["refresh"] == pytest.approx(refresh)


def test_the_deepspeed_model_describes_only_zero3_and_zeropp():
    with pytest.raises(CommModelError, match="ZeRO-3"):
        deepspeed_collectives(ds_spec("zero_topo"), SHAPES)


def test_zeropp_pays_its_secondary_copy_and_its_swizzle():
    # zeropp on 2 nodes x 2 (R = 2), three fp32 units of 400 elements, links infinitely fast, a local
    # copy at 100 bytes/s: the step's first (world) gather of each unit keeps a secondary copy of
    # S/R = 200 elements (800 bytes: 8 s); with qgZ the node hop first swizzles the S = 400-element
    # gradient (1,600 bytes: 16 s). Kernels at 1e9 elements/s add nothing visible.
    fast = LinkCurve(((1.0, 1e30),))
    hw = curve_hardware({(a, shape): fast for a in (RING_ALLGATHER, RING_REDUCE_SCATTER, RING_ALLREDUCE,
                                                    PAIRWISE_ALL_TO_ALL)
                         for shape in ("node", "cross", "world")})
    hw = Hardware(hw.links, Device("toy", 1000.0, 100.0, 1e12, 0.0, 1e12, copy_bytes_per_s=100.0), "nccl",
                  curves=hw.curves)
    work = StepWork(10, (0.0, 0.0, 0.0), prefetch_gathers=False, overlap_comm=False)
    plain = step_time(CommSpec((400, 400, 400), ShardLayout.resolve((2, 2), preset="zeropp")), hw, work)
    assert plain.exposed_s["fwd_gather"] == pytest.approx(3 * 8.0, rel=1e-6)
    quant = QuantSpec.from_settings(quantized_gradients=True, block_size=50)
    qgz = step_time(CommSpec((400, 400, 400), ShardLayout.resolve((2, 2), preset="zeropp"), quant=quant), hw, work)
    assert qgz.exposed_s["grad_reduce"] == pytest.approx(3 * 16.0, rel=1e-3)
