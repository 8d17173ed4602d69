"""Published figure sets for the step-time model (docs/frontier-model.md, "The figures").

``nominal`` is not here: it is the topology's per-tier link figures and the device table
(``Hardware.from_topology``). ``frontier-measured`` replaces them, for RCCL on MI250X nodes with
Slingshot-11, with what was measured and published, each number with its source in ``SOURCES``
and in the doc. Nothing here is fitted to arXiv 2501.04266's result, which stays the held-out
check. Where no measurement was found the entry says what stands in for it and why.

The curves are keyed by (algorithm, group shape) and give the rate through the busiest domain of
the slowest tier the group spans (a node when it spans nodes, else a rank) against the bytes one
algorithm step moves (B / k: one ring step's chunk, one all-to-all message). Indexing by the step's
bytes is what carries a measurement at 16 or 32 ranks to 384: a ring of k ranks makes k - 1 steps
of B / k bytes, so its time grows with k at a fixed B as the steps shrink into the slow regime.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from megatron.logging.throughput import MI250X_GCD
from megatron.topology.algorithms import PAIRWISE_ALL_TO_ALL, RING_ALLGATHER, RING_ALLREDUCE, RING_REDUCE_SCATTER
from megatron.analytic.link_curve import LinkCurve

GB = 1e9
KIB, MIB = 1024, 1024 * 1024

SOURCES = {
    "rccl-1490": "ROCm/rccl issue #1490 (2025-01-17): all_gather_perf -b 64K -e 4G -f 2 -g 1 on 4 nodes x 8 "
                 "GCDs (32 ranks), HPE Cray EX with MI250X and Slingshot-11, aws-ofi-rccl with libfabric 1.23; "
                 "out-of-place busbw 0.59 / 0.60 / 1.20 / 0.73 / 0.70 / 0.03 GB/s at 64 KiB / 128 KiB / 256 KiB / "
                 "512 KiB / 1 MiB / 2 MiB, 107.5 us at 64 KiB; 'low until 16777216' (the rows above 2 MiB were "
                 "not readable). The issue does not name the machine; the node is Frontier's.",
    "lumi-rccl-tests": "Lumi-supercomputer/lumi-reframe-tests checks/microbenchmarks/gpu/rccl_test.py: "
                       "all_reduce_perf on 2 nodes x 8 GCDs (16 ranks), -d half, aws-ofi-rccl, NCCL_SOCKET_IFNAME="
                       "hsn0..3, NCCL_NET_GDR_LEVEL=3: reference busbw 85.00 GB/s at 134217728 B (an older revision: "
                       "84.76 busbw, 45.21 algbw). LUMI-G has Frontier's node (4 MI250X, 4 x Slingshot-11).",
    "lumi-ds-comm": "lumi-reframe-tests checks/microbenchmarks/torch/torch_comm_coll.py: DeepSpeedExamples "
                    "communication/all_gather.py on 16 ranks, reference 775 Gbps at the 512.0 MB row, where "
                    "DeepSpeedExamples' get_bw defines all-gather throughput as n x size / time (the gathered "
                    "output): algbw 96.9 GB/s, busbw x 15/16 = 90.8 GB/s.",
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

RANKS_1490 = 32
# (message bytes, busbw GB/s) of rccl#1490's all-gather. The 2 MiB row (70 ms, 48x the 1 MiB row's
# time, in a thread that says performance is 'low until 16777216') is left out of the curve: one
# run's collapse, not a rate; docs/frontier-model.md shows what keeping it would do.
ALLGATHER_1490 = ((64 * KIB, 0.59), (128 * KIB, 0.60), (256 * KIB, 1.20), (512 * KIB, 0.73), (1 * MIB, 0.70))
ALLGATHER_1490_LEFT_OUT = (2 * MIB, 0.03)
LUMI_ALLREDUCE = (134217728 // 16, 85.00)      # 128 MiB on 16 ranks: 8 MiB per step
LUMI_ALLGATHER = (512 * MIB // 16, 90.8)       # the 512 MB row on 16 ranks: at least 32 MiB per step
STEP_LATENCY_S = 107.5e-6 / (RANKS_1490 - 1)   # rccl#1490's 64 KiB all-gather: 31 steps of 2 KiB in 107.5 us
NIC_GBS, NICS_PER_NODE, RANKS_PER_NODE = 23.82, 4, 8
PAIR_GBS, SINGLE_LINK_GBS = 148.0, 38.0
ALL_TO_ALL_SLOWDOWN = 2.5                      # rccl#1206: 2-3x MPI's all-to-all; MPI taken at the NIC rate
ACHIEVED_SHARE = 0.3838                        # Dash et al.'s 22B on Frontier


@dataclass(frozen=True)
class Assumptions:
    """What stands in where nothing was measured, each a knob of the sensitivity chart
    (bench/frontier_model.py); the defaults are the shipped ``frontier-measured`` set."""
    middle: str = "interpolate"
    """Ring steps between rccl#1490's largest (32 KiB) and LUMI's smallest (8 MiB), never measured:
    "interpolate" (log-log between the two), "latency-bandwidth" (the 2 KiB step's latency plus the
    8 MiB rate: the optimistic reading), "low-until-16MiB" (the issue's words: its 1 MiB rate held up
    to 16 MiB on 32 ranks, 512 KiB steps) or "keep-2MiB" (rccl#1490's 2 MiB collapse kept as a point)."""
    in_node_gbs: float = LUMI_ALLREDUCE[1]
    """An in-node ring's rate per rank (85: the 2-node ring's; 38: one single Infinity Fabric link)."""
    step_latency_s: float = STEP_LATENCY_S
    """Per-step latency of in-node rings (rccl#1490's small steps, an upper bound)."""
    all_to_all_slowdown: float = ALL_TO_ALL_SLOWDOWN
    """RCCL's all-to-all across nodes against the ring's rate (rccl#1206: 2-3x)."""
    nic_gbs: float = NIC_GBS


def world_ring_points(assume: Assumptions = Assumptions()) -> tuple:
    """A ring through every node (several ranks per node): rccl#1490's small steps, LUMI's large ones."""
    small = [(nbytes // RANKS_1490, gbs * GB) for nbytes, gbs in ALLGATHER_1490]
    large = [(LUMI_ALLREDUCE[0], LUMI_ALLREDUCE[1] * GB), (LUMI_ALLGATHER[0], LUMI_ALLGATHER[1] * GB)]
    if assume.middle == "keep-2MiB":
        small.append((ALLGATHER_1490_LEFT_OUT[0] // RANKS_1490, ALLGATHER_1490_LEFT_OUT[1] * GB))
    elif assume.middle == "latency-bandwidth":  # steps above 32 KiB at latency + bytes / the 8 MiB rate
        latency, rate = STEP_LATENCY_S, large[0][1]
        small += [(step, step / (latency + step / rate)) for step in (2 ** e for e in range(16, 23))]
    elif assume.middle == "low-until-16MiB":
        small.append((16 * MIB // RANKS_1490, ALLGATHER_1490[-1][1] * GB))
    elif assume.middle != "interpolate":
        raise ValueError(f"unknown assumption middle={assume.middle!r}")
    return tuple(small + large)


def cross_ring_points(assume: Assumptions = Assumptions()) -> tuple:
    """One rank per node, the node's 8 ranks side by side: a step is an inter-node hop, no faster than
    the world ring's inter-node hop at the same step bytes, and the node's 4 NICs carry its 8 rings at
    once (osu_bw's per-NIC rate, x 4). Rates per node."""
    nic = assume.nic_gbs * NICS_PER_NODE * GB
    return tuple((step, min(RANKS_PER_NODE * rate, nic)) for step, rate in world_ring_points(assume))


def frontier_curves(assume: Assumptions = Assumptions()) -> dict:
    """{(algorithm, shape): LinkCurve} of the ``frontier-measured`` set under ``assume``."""
    world = LinkCurve(world_ring_points(assume), 0.0, "rccl-1490 (steps <= 32 KiB), lumi-rccl-tests, lumi-ds-comm")
    cross = LinkCurve(cross_ring_points(assume), 0.0, "world ring per inter-node hop, capped by lumi-osu x 4 NICs")
    # In the node: no RCCL in-node ring was found measured. A 2-node world ring passes in-node hops at
    # 85 GB/s (lumi-rccl-tests), which bounds an in-node ring from below; RCCL's step latency is
    # rccl#1490's (its small steps include an inter-node hop, so this bounds the in-node one from above).
    node = LinkCurve(((1.0, assume.in_node_gbs * GB),), assume.step_latency_s,
                     "lumi-rccl-tests (85 GB/s), rccl-1490 latency")
    pair = LinkCurve(((1.0, PAIR_GBS * GB),), assume.step_latency_s, "pearson-2302.14827 (148 GB/s), rccl-1490 latency")
    out = {}
    for algorithm in (RING_ALLGATHER, RING_REDUCE_SCATTER, RING_ALLREDUCE):
        out.update({(algorithm, "world"): world, (algorithm, "cross"): cross, (algorithm, "node"): node,
                    (algorithm, "pair"): pair})
    # Across nodes RCCL's all-to-all runs at 1 / 2.5 of the ring's rate (rccl-1206's 2-3x MPI, with MPI
    # taken at the ring's rate); in the node no all-to-all figure was found: the ring's.
    for shape, ring in (("world", world), ("cross", cross)):
        out[(PAIRWISE_ALL_TO_ALL, shape)] = LinkCurve(
            tuple((c, r / assume.all_to_all_slowdown) for c, r in ring.points), 0.0,
            ring.source + f"; rccl-1206 (/ {assume.all_to_all_slowdown:g})")
    out.update({(PAIRWISE_ALL_TO_ALL, "node"): node, (PAIRWISE_ALL_TO_ALL, "pair"): pair})
    return out


@dataclass(frozen=True)
class FigureSet:
    summary: str
    """One phrase for the logs."""
    curves: Mapping
    """{(algorithm, shape): LinkCurve}."""
    device_rates: Mapping = field(default_factory=dict)
    """Device fields replaced (``hardware.Device``)."""


FIGURE_SETS = {
    "frontier-measured": FigureSet(
        "published RCCL on MI250X + Slingshot-11 measurements, docs/frontier-model.md",
        frontier_curves(), {"achieved_flops": ACHIEVED_SHARE * MI250X_GCD["bfloat16"]}),
}
FIGURE_SET_NAMES = ("nominal", *FIGURE_SETS)
