"""Published figure sets for the step-time model (docs/frontier-model.md, "The figures").

``nominal`` is not here: it is the topology's per-tier link figures and the device table
(``Hardware.from_topology``). The two Frontier sets replace them with RCCL as it was measured on
Frontier (MI250X nodes, Slingshot-11) by the PCCL authors: ``frontier-measured`` from their runs
with libfabric's rendezvous settings (FI_CXI_RDZV_THRESHOLD=0 and friends, the "clean" runs),
``frontier-eager`` from the same runs with libfabric's default eager protocol (the "collapse"
runs). Every curve point is a median of rows of ../shared/external/pccl-frontier's CSV, derived by
``megatron.analytic.pccl_frontier`` (which says how) and checked against it by
tests/test_pccl_frontier.py; the rest names its source in ``SOURCES``. Nothing here is fitted to
arXiv 2501.04266's result, which stays the held-out check.

The curves are keyed by (algorithm, group shape) and give the rate through the busiest domain of
the slowest tier the group spans (a node when it spans nodes, else a rank) against the bytes one
algorithm step moves (B / k: one ring step's chunk, one all-to-all message). Indexing by the step's
bytes is what carries a measurement at 16 to 1024 ranks to 384: a ring of k ranks makes k - 1 steps
of B / k bytes, so its time grows with k at a fixed B as the steps shrink into the slow regime. The
points are bus bandwidths measured end to end, so they hold RCCL's per-step latency (the doc's
table lists the time per step each point implies) and the curves add none.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

from megatron.logging.throughput import MI250X_GCD
from megatron.topology.algorithms import PAIRWISE_ALL_TO_ALL, RING_ALLGATHER, RING_ALLREDUCE, RING_REDUCE_SCATTER
from megatron.analytic.link_curve import LinkCurve

GB = 1e9

SOURCES = {
    "pccl-frontier": "axonn-ai/sc2025-pccl-reproducer (branch experimental, data/ at 5a6353f, 2025-02-03): the "
                     "PCCL authors' RCCL all_gather_into_tensor / reduce_scatter_tensor through torch.distributed on "
                     "1-128 Frontier nodes x 8 GCDs, bf16, 1-1024 MiB; as ../shared/external/pccl-frontier's CSV. "
                     "Clean runs all_gather_3 / reduce_scatter_3 (FI_CXI_RDZV_* = 0), eager runs all_gather_2 / "
                     "reduce_scatter_2 (the same srun line, the eager protocol on).",
    "lumi-osu": "lumi-reframe-tests checks/microbenchmarks/mpi/osu_check.py: osu_bw with GPU buffers, one rank "
                "per node: reference 23,820 MB/s (one Slingshot-11 NIC); osu_latency 2.5 us.",
    "pearson-2302.14827": "C. Pearson, 'Interconnect Bandwidth Heterogeneity on AMD MI250x and Infinity "
                          "Fabric', arXiv 2302.14827, as the reference values of lumi-reframe-tests "
                          "checks/microbenchmarks/gpu/comm_scope.py (comm_scope Comm_implicit_managed_GPUWrGPU_fine,"
                          " 2^30 B): GCD 0 -> 1 (same package) 148 GB/s, 0 -> 6 (dual link) 76, 0 -> 2 (single) 38.",
    "rccl-1206": "ROCm/rccl issue #1206 (2024): RCCL all-to-all on Frontier 'almost 2x to 3x of normal MPI' "
                 "on 4 to 8 nodes with aws-ofi-rccl (no sizes given); RCCL's all-to-all is a fan-out.",
    "dash-2312.12705": "Dash et al., 'Optimizing Distributed Training on Frontier for Large Language Models', "
                       "arXiv 2312.12705, abstract: 38.38% of peak GPU throughput for a 22B model on Frontier.",
}

# -- the measured points -----------------------------------------------------------------------------
# Printed by `.venv/bin/python -m megatron.analytic.pccl_frontier` (do not edit by hand; the test
# derives them again from the CSV): {(collective, span): ((ring step bytes, busbw GB/s, node counts
# of the jobs whose rows' median it is), ...)}. ``node``: the one-node job, the rate per rank;
# ``world``: jobs of 2-128 nodes, each node's egress.
CLEAN_POINTS = {
    ('all_gather', 'node'): (
        (262144, 11.495, (1,)), (524288, 21.373, (1,)),
        (1048576, 35.397, (1,)), (2097152, 55.254, (1,)),
        (4194304, 71.876, (1,)), (8388608, 81.686, (1,)),
        (16777216, 88.172, (1,)), (33554432, 90.778, (1,)),
        (67108864, 89.842, (1,)), (134217728, 89.195, (1,)),
    ),
    ('all_gather', 'world'): (
        (4096, 0.39, (64,)), (8192, 0.8075, (32, 64)),
        (16384, 1.188, (16, 32, 64)), (32768, 1.6135, (8, 16, 32, 64)),
        (65536, 3.118, (4, 8, 16, 32, 64)), (131072, 4.2005, (2, 4, 8, 16, 32, 64)),
        (262144, 8.5455, (2, 4, 8, 16, 32, 64)), (524288, 16.7355, (2, 4, 8, 16, 32, 64)),
        (1048576, 29.865, (2, 4, 8, 16, 32, 64)), (2097152, 52.3065, (2, 4, 8, 16, 32, 64)),
        (4194304, 70.898, (2, 4, 8, 16, 32)), (8388608, 71.5465, (2, 4, 8, 16)),
        (16777216, 71.159, (2, 4, 8)), (33554432, 71.5085, (2, 4)),
        (67108864, 71.671, (2,)),
    ),
    ('reduce_scatter', 'node'): (
        (262144, 14.375, (1,)), (524288, 24.332, (1,)),
        (1048576, 35.397, (1,)), (2097152, 48.317, (1,)),
        (4194304, 59.446, (1,)), (8388608, 67.239, (1,)),
        (16777216, 71.894, (1,)), (33554432, 73.98, (1,)),
        (67108864, 75.066, (1,)), (134217728, 75.744, (1,)),
    ),
    ('reduce_scatter', 'world'): (
        (2048, 0.637, (128,)), (4096, 0.7785, (64, 128)),
        (8192, 1.221, (32, 64, 128)), (16384, 1.6435, (16, 32, 64, 128)),
        (32768, 1.746, (8, 16, 32, 64, 128)), (65536, 2.9945, (4, 8, 16, 32, 64, 128)),
        (131072, 4.724, (2, 4, 8, 16, 32, 64, 128)), (262144, 9.421, (2, 4, 8, 16, 32, 64, 128)),
        (524288, 17.666, (2, 4, 8, 16, 32, 64, 128)), (1048576, 32.847, (2, 4, 8, 16, 32, 64, 128)),
        (2097152, 59.654, (2, 4, 8, 16, 32, 64)), (4194304, 72.118, (2, 4, 8, 16, 32)),
        (8388608, 75.7325, (2, 4, 8, 16)), (16777216, 78.027, (2, 4, 8)),
        (33554432, 78.5995, (2, 4)), (67108864, 78.31, (2,)),
    ),
}
EAGER_POINTS = {
    ('all_gather', 'node'): (
        (262144, 11.427, (1,)), (524288, 21.154, (1,)),
        (1048576, 35.584, (1,)), (2097152, 55.415, (1,)),
        (4194304, 72.244, (1,)), (8388608, 83.391, (1,)),
        (16777216, 88.968, (1,)), (33554432, 90.795, (1,)),
        (67108864, 90.462, (1,)), (134217728, 89.867, (1,)),
    ),
    ('all_gather', 'world'): (
        (2048, 0.241, (128,)), (4096, 0.1545, (64, 128)),
        (8192, 0.472, (32, 64, 128)), (16384, 0.5825, (16, 32, 64, 128)),
        (32768, 0.927, (8, 16, 32, 64, 128)), (65536, 0.261, (4, 8, 16, 32, 64, 128)),
        (131072, 0.336, (2, 4, 8, 16, 32, 64, 128)), (262144, 0.799, (2, 4, 8, 16, 32, 64, 128)),
        (524288, 14.795, (2, 4, 8, 16, 32, 64, 128)), (1048576, 21.46, (2, 4, 8, 16, 32, 64, 128)),
        (2097152, 45.631, (2, 4, 8, 16, 32, 64)), (4194304, 71.26, (2, 4, 8, 16, 32)),
        (8388608, 71.493, (2, 4, 8, 16)), (16777216, 71.885, (2, 4, 8)),
        (33554432, 71.326, (2,)), (67108864, 71.835, (2,)),
    ),
    ('reduce_scatter', 'node'): (
        (262144, 14.806, (1,)), (524288, 24.819, (1,)),
        (1048576, 36.342, (1,)), (2097152, 49.293, (1,)),
        (4194304, 60.172, (1,)), (8388608, 67.339, (1,)),
        (16777216, 71.801, (1,)), (33554432, 74.086, (1,)),
        (67108864, 74.748, (1,)), (134217728, 75.595, (1,)),
    ),
    ('reduce_scatter', 'world'): (
        (2048, 0.505, (128,)), (4096, 0.5255, (64, 128)),
        (8192, 1.0, (32, 64, 128)), (16384, 1.138, (16, 32, 64, 128)),
        (32768, 1.101, (8, 16, 32, 64, 128)), (65536, 0.3025, (4, 8, 16, 32, 64, 128)),
        (131072, 0.363, (2, 4, 8, 16, 32, 64, 128)), (262144, 0.796, (2, 4, 8, 16, 32, 64, 128)),
        (524288, 16.486, (2, 4, 8, 16, 32, 64, 128)), (1048576, 27.902, (2, 4, 8, 16, 32, 64, 128)),
        (2097152, 52.7075, (2, 4, 8, 16, 32, 64)), (4194304, 72.206, (2, 4, 8, 16, 32)),
        (8388608, 75.811, (2, 4, 8, 16)), (16777216, 77.779, (2, 4, 8)),
        (33554432, 78.4385, (2, 4)), (67108864, 78.098, (2,)),
    ),
}

RANKS_PER_NODE = 8
NIC_GBS, NICS_PER_NODE = 23.82, 4
PAIR_GBS = 148.0
ALL_TO_ALL_SLOWDOWN = 2.5                      # rccl#1206: 2-3x MPI's all-to-all; MPI taken at the ring's rate
ACHIEVED_SHARE = 0.3838                        # Dash et al.'s 22B on Frontier


@dataclass(frozen=True)
class Assumptions:
    """What stands in where the runs measured nothing, each a knob of the sensitivity chart
    (bench/frontier_model.py); the defaults are the shipped sets."""
    all_to_all_slowdown: float = ALL_TO_ALL_SLOWDOWN
    """RCCL's all-to-all across nodes against the all-gather ring's rate (rccl#1206: 2-3x)."""
    cross_cap_gbs: Optional[float] = None
    """A node's egress when its 8 ranks run 8 cross rings side by side, GB/s. None: the plateau of
    the same runs' world ring (the most a node sent in any of them); lumi-osu x 4 NICs = 95.3."""
    world_scale: float = 1.0
    """Every world-ring rate multiplied by this (what the world curve's level is worth)."""
    node_scale: float = 1.0
    """Every in-node ring rate multiplied by this."""


def measured_curve(points, source: str, scale: float = 1.0) -> LinkCurve:
    """A curve of (step bytes, busbw GB/s, ...) points: end-to-end rates, so no added latency."""
    return LinkCurve(tuple((step, gbs * GB * scale) for step, gbs, *_ in points), 0.0, source)


def ring_allreduce_curve(rs: LinkCurve, ag: LinkCurve) -> LinkCurve:
    """A ring all-reduce is a reduce-scatter then an all-gather of the same steps: at step bytes s it
    takes s / r_rs + s / r_ag per step pair, so its one rate over twice the steps is their harmonic
    mean, at every step size either curve measured."""
    steps = sorted({s for s, _ in rs.points} | {s for s, _ in ag.points})
    return LinkCurve(tuple((s, 2.0 / (1.0 / rs.bandwidth(s) + 1.0 / ag.bandwidth(s))) for s in steps), 0.0,
                     f"{rs.source} then {ag.source}")


def cross_curve(world: LinkCurve, cap: float) -> LinkCurve:
    """One rank per node, the node's 8 ranks side by side in 8 rings: a step is an inter-node hop,
    no faster than the world ring's at the same step bytes, and the node's egress is capped (per node)."""
    return LinkCurve(tuple((s, min(RANKS_PER_NODE * r, cap)) for s, r in world.points), 0.0,
                     f"{world.source}, 8 rings per node, capped at {cap / GB:.1f} GB/s")


def frontier_curves(points: Mapping, assume: Assumptions = Assumptions(), label: str = "pccl-frontier") -> dict:
    """{(algorithm, shape): LinkCurve} of one regime's ``points`` (CLEAN_POINTS, EAGER_POINTS, or a
    reading of the CSV from ``pccl_frontier.derive``) under ``assume``."""
    ag = measured_curve(points[("all_gather", "world")], f"{label} all-gather", assume.world_scale)
    rs = measured_curve(points[("reduce_scatter", "world")], f"{label} reduce-scatter", assume.world_scale)
    node_ag = measured_curve(points[("all_gather", "node")], f"{label} all-gather, 1 node", assume.node_scale)
    node_rs = measured_curve(points[("reduce_scatter", "node")], f"{label} reduce-scatter, 1 node", assume.node_scale)
    world = {RING_ALLGATHER: ag, RING_REDUCE_SCATTER: rs}
    cross = {a: cross_curve(c, assume.cross_cap_gbs * GB if assume.cross_cap_gbs else max(r for _, r in c.points))
             for a, c in world.items()}
    node = {RING_ALLGATHER: node_ag, RING_REDUCE_SCATTER: node_rs}
    for table in (world, cross, node):
        table[RING_ALLREDUCE] = ring_allreduce_curve(table[RING_REDUCE_SCATTER], table[RING_ALLGATHER])
    # The GCD pair: no RCCL pair ring in the runs. Pearson's 148 GB/s, with the one-node all-gather's
    # smallest step's time as its per-step latency (an upper bound: that time includes the bytes).
    first_step, first_rate = node_ag.points[0]
    pair = LinkCurve(((1.0, PAIR_GBS * GB),), first_step / first_rate,
                     f"pearson-2302.14827 (148 GB/s), {label} 1-node latency")
    out = {}
    for algorithm in (RING_ALLGATHER, RING_REDUCE_SCATTER, RING_ALLREDUCE):
        out.update({(algorithm, "world"): world[algorithm], (algorithm, "cross"): cross[algorithm],
                    (algorithm, "node"): node[algorithm], (algorithm, "pair"): pair})
    # Across nodes RCCL's all-to-all runs at 1 / 2.5 of the all-gather ring's rate (rccl-1206's 2-3x
    # MPI, with MPI taken at the ring's rate); in the node no all-to-all figure was found: the ring's.
    for shape, ring in (("world", world[RING_ALLGATHER]), ("cross", cross[RING_ALLGATHER])):
        out[(PAIRWISE_ALL_TO_ALL, shape)] = LinkCurve(
            tuple((c, r / assume.all_to_all_slowdown) for c, r in ring.points), 0.0,
            ring.source + f"; rccl-1206 (/ {assume.all_to_all_slowdown:g})")
    out.update({(PAIRWISE_ALL_TO_ALL, "node"): node_ag, (PAIRWISE_ALL_TO_ALL, "pair"): pair})
    return out


@dataclass(frozen=True)
class FigureSet:
    summary: str
    """One phrase for the logs."""
    curves: Mapping
    """{(algorithm, shape): LinkCurve}."""
    device_rates: Mapping = field(default_factory=dict)
    """Device fields replaced (``hardware.Device``)."""


_DEVICE_RATES = {"achieved_flops": ACHIEVED_SHARE * MI250X_GCD["bfloat16"]}
FIGURE_SETS = {
    "frontier-measured": FigureSet(
        "published RCCL timings on Frontier with libfabric's rendezvous settings, docs/frontier-model.md",
        frontier_curves(CLEAN_POINTS), _DEVICE_RATES),
    "frontier-eager": FigureSet(
        "published RCCL timings on Frontier with libfabric's default eager protocol, docs/frontier-model.md",
        frontier_curves(EAGER_POINTS), _DEVICE_RATES),
}
FIGURE_SET_NAMES = ("nominal", *FIGURE_SETS)
POINTS_OF = {"frontier-measured": CLEAN_POINTS, "frontier-eager": EAGER_POINTS}
"""The measured points each Frontier set is built from (the sensitivity runs rebuild it)."""
