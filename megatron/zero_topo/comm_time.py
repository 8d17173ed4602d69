"""A simulated step time from the analytic communication model: per-tier link loads (not rank
order — real libraries reorder rings to the hardware) plus compute time from FLOPs. For the
planner and `bench/comm_volume.py`; the byte counts it starts from are `comm_model.predict_ledger`'s.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from megatron.zero_topo.comm_model import (ALL_TO_ALL, ALLGATHER, ALLREDUCE, PHASES, Collective, CommModelError,
                                          CommSpec, groups_of_kind, rank_coords, step_collectives)


@dataclass(frozen=True)
class TierLink:
    """Links of one tier, seen from one *domain* of that tier: a node (inter_node), a GPU package
    (intra_node on a 3-tier layout; a rank on a 2-tier one) or a rank (intra_gpu)."""
    bandwidth: float
    """Bytes per second that can enter one domain through this tier's links."""
    latency_s: float
    """Seconds per ring step over this tier."""


@dataclass(frozen=True)
class Hardware:
    links: Mapping
    """{tier: TierLink} for every tier of the layouts it is used with."""
    peak_flops: float
    """Dense peak FLOP/s of one rank in the compute dtype."""
    mfu: float
    """Model FLOPs utilisation assumed for the compute time (recomputation included in it)."""


# Frontier (OLCF): GCD pair 200 GB/s; a package's in-node links 50-100 GB/s per GCD (we take the
# 50 GB/s a ring can count on, 100 GB/s per two-GCD package); 4 Slingshot NICs x 25 GB/s per node;
# 191.5 TFLOP/s bf16 per GCD. Latencies are rough per-step figures.
FRONTIER = Hardware(
    links={"intra_gpu": TierLink(200e9, 2e-6), "intra_node": TierLink(100e9, 5e-6),
           "inter_node": TierLink(4 * 25e9, 10e-6)},
    peak_flops=191.5e12, mfu=0.4)


# The phases whose collectives prefetching overlaps with compute (docs/engine.md, "Prefetch").
GATHER_PHASES = ("fwd_gather", "bwd_gather", "recompute_gather", "eval_gather")


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    comm_s: dict
    """{phase: seconds}, collectives run one after another."""

    @property
    def comm_total_s(self) -> float:
        return sum(self.comm_s.values())

    @property
    def no_overlap_s(self) -> float:
        """Upper bound: nothing overlaps."""
        return self.compute_s + self.comm_total_s

    @property
    def full_overlap_s(self) -> float:
        """Lower bound: communication hides entirely behind compute, or the reverse."""
        return max(self.compute_s, self.comm_total_s)

    @property
    def prefetch_s(self) -> float:
        """The engine with prefetch_gathers: the weight gathers run behind compute (each is issued
        one unit early); the gradient reductions, the step boundary and control do not overlap."""
        gathers = sum(self.comm_s.get(p, 0.0) for p in GATHER_PHASES)
        return max(self.compute_s, gathers) + self.comm_total_s - gathers


def domain_load_fractions(kind: str, spec: CommSpec, op: str = ALLGATHER) -> dict:
    """{tier: largest fraction of B entering one domain of that tier}, all groups of a kind at once.

    Per link load, not ring order: a topology-aware algorithm brings each outside chunk into a
    domain once, so the bytes entering a domain through tier t are B x (members of the group in the
    parent domain - members in this domain) / k, summed over the kind's concurrent groups. In an
    all-to-all every member of the domain needs its own piece from each outside member: m times that.
    """
    depth = len(spec.layout)
    loads = [dict() for _ in range(depth)]
    for grp in groups_of_kind(kind, spec):
        k = len(grp)
        if k == 1:
            continue
        coords = [rank_coords(r, spec.layout) for r in grp]
        for t in range(depth):
            in_domain, in_parent = {}, {}
            for cd in coords:
                in_domain[cd[:t + 1]] = in_domain.get(cd[:t + 1], 0) + 1
                in_parent[cd[:t]] = in_parent.get(cd[:t], 0) + 1
            for dom, m in in_domain.items():
                pieces = m if op == ALL_TO_ALL else 1
                loads[t][dom] = loads[t].get(dom, 0.0) + pieces * (in_parent[dom[:t]] - m) / k
    return {tier: max(loads[t].values(), default=0.0) for t, tier in enumerate(spec.tiers)}


def collective_time_s(col: Collective, fractions: dict, k: int, hw: Hardware) -> float:
    """Bandwidth term of the most loaded tier plus ring steps at the slowest spanned tier's latency."""
    used = [t for t, f in fractions.items() if f > 0]
    if k == 1 or not used:
        return 0.0
    factor = 2 if col.op == ALLREDUCE else 1
    bandwidth_s = max(factor * col.nbytes * fractions[t] / hw.links[t].bandwidth for t in used)
    latency_s = factor * (k - 1) * max(hw.links[t].latency_s for t in used)
    return col.count * (bandwidth_s + latency_s)


def simulate_step_time(spec: CommSpec, hw: Hardware, tokens_per_micro_batch: int) -> StepTime:
    """Compute (6 x params x tokens, plus 2 x params x tokens per eval pass) and communication time.

    ``tokens_per_micro_batch`` is per rank (micro batch size x sequence length).
    """
    missing = set(spec.tiers) - set(hw.links)
    if missing:
        raise CommModelError(f"hardware has no link figures for tiers {sorted(missing)}")
    params = sum(spec.unit_numels)
    flops = params * tokens_per_micro_batch * (6 * spec.micro_batches + 2 * spec.eval_forward_passes)
    compute_s = flops / (hw.peak_flops * hw.mfu)
    collectives = step_collectives(spec)
    kinds = {(col.group, col.op): (len(groups_of_kind(col.group, spec)[0]),
                                   domain_load_fractions(col.group, spec, col.op))
             for col in collectives}
    comm_s = {phase: 0.0 for phase in PHASES}
    for col in collectives:
        k, fractions = kinds[(col.group, col.op)]
        comm_s[col.phase] += collective_time_s(col, fractions, k, hw)
    return StepTime(compute_s=compute_s, comm_s={p: s for p, s in comm_s.items() if s > 0})
