"""Step time of one optimizer step, predicted from the comm model's collectives (docs/time_model.md).

Three parts, each a statement of what the engine does, not of a textbook algorithm:

- Collectives. Each collective of ``comm_model.step_collectives`` runs, in every group of its kind at
  once, the algorithm the backend really uses (``algorithm_of``): a ring all-gather (k - 1 steps),
  a ring all-reduce (2(k - 1)), an all-to-all (k - 1 messages per rank); a reduce-scatter is the
  native ring on NCCL/RCCL, and on gloo one all-to-all plus a local sum when every pair of members
  is separated by the same tier, else a ring of k - 1 isend/irecv steps that completes before the
  call returns, so it overlaps nothing (megatron/engine/comm.py).
  Its time is ``steps x latency`` of the slowest tier it spans plus, for the most loaded tier, the
  bytes crossing the busiest *domain* of that tier over the domain's bandwidth. The domain of
  ``inter_node`` is a node (its NICs are shared by all its ranks); of the in-node tiers, a rank.
  Where the figures hold a curve for the collective's (algorithm, group shape) (``hardware``:
  measured or published rates against the bytes of one step), the time is instead the curve's
  ``steps x latency`` plus the bytes through the busiest domain of the slowest tier spanned over
  the curve's rate at B / k bytes per step.
  Quantized collectives add their kernels' time (quantize + dequantize) at the device's rate.
- Compute. Model FLOPs of each unit (forward; backward twice that; a recompute under full activation
  checkpointing once more, none under selective, which repeats no matmul) over the device's
  *achieved* FLOP/s, and the AdamW update of this rank's 1/os slice at the device's optimizer rate.
- Overlap, as the engine schedules it (docs/engine.md "Prefetch", "Overlapped gradient reduction"):
  with ``prefetch_gathers`` the gather of the next unit runs behind the current unit's compute; with
  ``overlap_comm`` a unit's gradient reduction runs behind the backward of the unit before it and the
  last one is waited for at the end of the backward; every pass starts with its first gather
  exposed; the step boundary (cross-node gradient reduction, replica all-reduce, optimizer, weight
  refresh) and the control all-reduces overlap nothing. In a window of compute C and communication
  M the hardware hides ``e x min(C, M)``, e the overlap efficiency of the tier each transfer runs
  on (``Device.overlap``): about 1 on a GPU (separate engines); on a CPU high for a slow NIC (the
  transfer waits in the kernel) and low for loopback copies on the cores that compute (measured by
  tools/probe_links.py per tier). Quantization kernels are the device's own work: never hidden.

The figures (links per tier and per algorithm, the device) are ``megatron.analytic.hardware``'s:
the topology's and the device table's, or a probe file's (tools/probe_links.py).
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Mapping, Optional, Sequence

from megatron.analytic.comm_model import (Collective, CommModelError, CommSpec, groups_of_kind, padded_unit_numels,
                                           step_collectives)
from megatron.topology.names import ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, REDUCE_SCATTER, TIERS_BY_DEPTH
from megatron.topology.algorithms import (ALL_TO_ALL_SUM, PAIRWISE_ALL_TO_ALL, RING_ALLGATHER, RING_ALLREDUCE,
                                           RING_REDUCE_SCATTER, AlgorithmError, collective_algorithm)
from megatron.analytic.hardware import Device, Hardware, group_shape

GATHER_PHASES = ("fwd_gather", "bwd_gather", "recompute_gather")
BOUNDARY_PHASES = ("cross_grad_reduce", "replica_allreduce", "refresh", "control")
# Time categories that are not communication phases.
COMPUTE, RECOMPUTE, OPTIMIZER = "compute", "recompute", "optimizer"


# -- one collective ------------------------------------------------------------------------------

def spans_one_tier(ranks: Sequence[int], layout: tuple) -> bool:
    """Every pair of members is separated by the same tier (gloo's reduce-scatter then is an all-to-all).

    Counted rather than paired (a world group at 384 ranks is 74k pairs, and the planner asks for
    thousands of groups): a pair is separated by the slowest tier whose digit differs
    (``comm_model.tier_between``), so tier d separates some pair exactly when two members share the
    digits slower than d and differ in d's."""
    present = 0
    for depth in range(len(layout)):
        inner = math.prod(layout[depth + 1:])  # rank // inner: the digits down to tier d
        outer = inner * layout[depth]  # rank // outer: the digits slower than tier d
        digits: dict = {}
        for r in ranks:
            digits.setdefault(r // outer, set()).add(r // inner)
        present += any(len(d) > 1 for d in digits.values())
    return present <= 1


def algorithm_of(op: str, ranks: Sequence[int], layout: tuple, backend: str) -> str:
    """The algorithm the engine's Communicator runs for ``op`` in this group (algorithms.py: one choice)."""
    try:
        return collective_algorithm(op, backend, spans_one_tier(ranks, layout))
    except AlgorithmError as err:
        raise CommModelError(str(err)) from None


@dataclass(frozen=True)
class Footprint:
    """What one byte of buffer B costs an algorithm run in a set of concurrent groups of size k."""
    algorithm: str
    k: int
    steps: int
    domain_load: dict
    """{tier: bytes per byte of B through the busiest domain of the tier (in or out, whichever is more)}."""
    slowest_tier: Optional[str]
    shape: str = "node"
    """The groups' shape (``hardware.group_shape``): which curve of the figures applies."""


def footprint(groups: Sequence[Sequence[int]], layout: tuple, algorithm: str) -> Footprint:
    """Steps and per-domain loads of ``algorithm`` run at once in every group of ``groups`` (equal sizes)."""
    k = len(groups[0])
    tiers = TIERS_BY_DEPTH[len(layout)]
    if k == 1:
        return Footprint(algorithm, 1, 0, {t: 0.0 for t in tiers}, None)
    out, into = _sends(groups, layout, algorithm)
    load = {t: max(max(out[t].values(), default=0.0), max(into[t].values(), default=0.0)) for t in tiers}
    spanned = [t for t in tiers if load[t] > 0]
    steps = (2 if algorithm == RING_ALLREDUCE else 1) * (k - 1)
    return Footprint(algorithm, k, steps, load, spanned[0] if spanned else None, group_shape(groups[0], layout))


def _sends(groups: Sequence[Sequence[int]], layout: tuple, algorithm: str) -> tuple[dict, dict]:
    """({tier: {domain: bytes out}}, {tier: {domain: bytes in}}) per byte of B; the domain of
    inter_node is the node, of the other tiers the rank. An all-to-all's member sends 1/k to each
    other member, so its bytes per tier follow from how many members share its node and GPU."""
    tiers = TIERS_BY_DEPTH[len(layout)]
    out: dict = {t: {} for t in tiers}
    into: dict = {t: {} for t in tiers}
    per_node = math.prod(layout[1:])
    per_gpu = layout[-1] if len(layout) == 3 else per_node
    three = len(layout) == 3

    def add(tier: str, src: int, dst: int, share: float) -> None:
        a, b = (src // per_node, dst // per_node) if tier == "inter_node" else (src, dst)
        out[tier][a] = out[tier].get(a, 0.0) + share
        into[tier][b] = into[tier].get(b, 0.0) + share

    for grp in groups:
        k = len(grp)
        if algorithm in (PAIRWISE_ALL_TO_ALL, ALL_TO_ALL_SUM):
            nodes = Counter(r // per_node for r in grp)
            gpus = Counter(r // per_gpu for r in grp)
            for r in grp:
                same_node, same_gpu = nodes[r // per_node], gpus[r // per_gpu]
                counts = {"inter_node": k - same_node, "intra_node": same_node - same_gpu, "intra_gpu": same_gpu - 1}
                if len(layout) == 2:
                    counts = {"inter_node": k - same_node, "intra_node": same_node - 1}
                for tier, n in counts.items():
                    if n:
                        add(tier, r, r, n / k)  # symmetric: as much in as out, for the rank and its node
        else:
            share = (2.0 if algorithm == RING_ALLREDUCE else 1.0) * (k - 1) / k
            ring = sorted(grp)
            # comm_model.tier_between by division, inline: this loop runs N times per group kind
            for src, dst in zip(ring, ring[1:] + ring[:1]):
                a, b = src // per_node, dst // per_node
                if a != b:
                    tier_out, tier_in = out["inter_node"], into["inter_node"]
                else:
                    a, b = src, dst
                    tier = "intra_gpu" if three and src // per_gpu == dst // per_gpu else "intra_node"
                    tier_out, tier_in = out[tier], into[tier]
                tier_out[a] = tier_out.get(a, 0.0) + share
                tier_in[b] = tier_in.get(b, 0.0) + share
    return out, into


def _kind_factors(kind: str, factors: tuple) -> tuple:
    """The nested factors that make the same groups of ``kind`` as ``factors`` with the factors the
    kind does not read collapsed (``comm_model.groups_of_kind``: weight reads w, stride w and g,
    cross g and os, replica os, the others none), so the many layouts of a planner search that share
    a kind's groups share their footprint."""
    w, g, os_ = factors
    return {"weight": (w, w, w), "stride": (w, g, g), "cross": (g, g, os_),
            "replica": (os_, os_, os_)}.get(kind, (1, 1, 1))


def _kind_footprint(layout: tuple, factors: tuple, kind: str, op: str, backend: str) -> Footprint:
    return _groups_footprint(layout, _kind_factors(kind, factors), kind, op, backend)


@lru_cache(maxsize=4096)
def _groups_footprint(layout: tuple, factors: tuple, kind: str, op: str, backend: str) -> Footprint:
    spec = _GroupSpec(layout, factors)
    groups = groups_of_kind(kind, spec)
    return footprint(groups, layout, algorithm_of(op, groups[0], layout, backend))


@dataclass(frozen=True)
class _GroupSpec:
    """The two facts ``groups_of_kind`` reads from a CommSpec, hashable for the cache."""
    layout: tuple
    factors: tuple

    @property
    def world_size(self) -> int:
        n = 1
        for size in self.layout:
            n *= size
        return n

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.layout[0]

    def resolved_factors(self) -> tuple:
        return self.factors


_LEDGER_ALGORITHM = {ALL_GATHER: RING_ALLGATHER, REDUCE_SCATTER: RING_REDUCE_SCATTER, ALL_REDUCE: RING_ALLREDUCE,
                     ALL_TO_ALL: PAIRWISE_ALL_TO_ALL}


def _kind_sent_by_tier(layout: tuple, factors: tuple, kind: str, op: str) -> dict:
    """{tier: bytes all ranks send per byte of B} under the ledger's rule (comm_model._sent_bytes)."""
    return _groups_sent_by_tier(layout, _kind_factors(kind, factors), kind, op)


@lru_cache(maxsize=4096)
def _groups_sent_by_tier(layout: tuple, factors: tuple, kind: str, op: str) -> dict:
    groups = groups_of_kind(kind, _GroupSpec(layout, factors))
    if len(groups[0]) == 1:
        return {}
    out, _ = _sends(groups, layout, _LEDGER_ALGORITHM[op])
    return {tier: sum(per_domain.values()) for tier, per_domain in out.items() if per_domain}


def ledger_bytes_by_tier(spec: CommSpec) -> dict:
    """{tier: bytes all ranks send per step}: ``bytes_by_tier(predict_ledger(spec))`` without the
    rank-by-rank walk (a world all-to-all at 384 ranks is 147k pairs per collective), for the planner."""
    return collectives_bytes_by_tier(spec)


def collectives_bytes_by_tier(spec: CommSpec, collectives: Optional[list] = None) -> dict:
    """{tier: bytes all ranks send per step} of ``collectives`` (default: the engine's for ``spec``;
    another library's list, deepspeed_model.py, on the spec's groups) under the ledger's rule."""
    out: dict = {}
    tiers, factors, shares = spec.layout.tiers, spec.factors, {}
    for col in step_collectives(spec) if collectives is None else collectives:
        key = (col.group, col.op)
        if key not in shares:  # a step has a few kinds of collective and hundreds of collectives
            shares[key] = _kind_sent_by_tier(tiers, factors, col.group, col.op).items()
        for tier, share in shares[key]:
            out[tier] = out.get(tier, 0.0) + share * col.nbytes * col.count
    return out


def footprint_time_s(fp: Footprint, nbytes: float, hw: Hardware) -> float:
    """One run of the algorithm on a B-byte buffer: steps x the slowest tier's latency + the most
    loaded tier's bytes over its bandwidth; or, with a curve for its (algorithm, shape), steps x the
    curve's latency + the slowest tier's bytes over the curve's rate at B / k bytes per step."""
    if fp.k == 1 or fp.slowest_tier is None:
        return 0.0
    curve = hw.curve(fp.algorithm, fp.shape)
    if curve is not None:
        return (fp.steps * curve.latency_s
                + nbytes * fp.domain_load[fp.slowest_tier] / curve.bandwidth(nbytes / fp.k))
    bandwidth_s = max(nbytes * load / hw.link(fp.algorithm, tier).bandwidth
                      for tier, load in fp.domain_load.items() if load > 0)
    return fp.steps * hw.link(fp.algorithm, fp.slowest_tier).latency_s + bandwidth_s


@dataclass(frozen=True)
class Transfer:
    """One run of a collective as the schedule sees it: time on the links (hidable behind compute
    with the tier's overlap efficiency) and time in quantization kernels (the device's own work,
    never hidden)."""
    phase: str
    wire_s: float
    kernel_s: float
    tier: Optional[str]
    """The slowest tier it spans (its overlap efficiency applies)."""


def transfer_of(col: Collective, spec: CommSpec, hw: Hardware) -> Transfer:
    """One run of ``col`` (of its ``count``)."""
    fp = _kind_footprint(spec.layout.tiers, spec.factors, col.group, col.op, hw.backend)
    if fp.k == 1:
        return Transfer(col.phase, 0.0, 0.0, None)
    return Transfer(col.phase, footprint_time_s(fp, col.nbytes, hw), local_work_s(col, spec, fp.k, hw),
                    fp.slowest_tier)


def local_work_s(col: Collective, spec: CommSpec, k: int, hw: Hardware) -> float:
    """The device's own work for one run of ``col``: its quantization kernels and its local copies."""
    elements = col.kernel_elements
    if elements is None:
        elements = quantized_elements(col, spec, k) if col.bits else 0.0
    seconds = elements / hw.device.quantize_elements_per_s if elements else 0.0
    if col.copy_bytes and hw.device.copy_bytes_per_s:
        seconds += col.copy_bytes / hw.device.copy_bytes_per_s
    return seconds


def collective_time_s(col: Collective, spec: CommSpec, hw: Hardware) -> float:
    """All ``col.count`` runs of one collective, with its quantization kernels."""
    t = transfer_of(col, spec, hw)
    return col.count * (t.wire_s + t.kernel_s)


def quantized_elements(col: Collective, spec: CommSpec, k: int) -> float:
    """Elements through one quantize + dequantize: a gather quantizes its own chunk and dequantizes
    all k; a reduction hop quantizes its input and dequantizes (and sums) it."""
    bits, block = col.bits, spec.quant.block_size
    elements = col.numel / (bits / 8 + 4 / block)  # the packed bytes back to elements
    return elements * (1 + 1 / k) / 2 if col.op == ALL_GATHER else elements


# -- the step ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StepWork:
    """The compute of one step, per rank: what the comm spec does not know."""
    tokens_per_micro_batch: int
    """Tokens one rank processes per micro-batch (micro batch size x sequence length)."""
    unit_flops_per_token: tuple
    """Forward model FLOPs per token of each unit (backward = 2x; ``megatron.analytic.model_inputs``)."""
    prefetch_gathers: bool = True
    overlap_comm: Optional[bool] = None
    """None: from the spec (reductions_in_flight > 0)."""
    recompute_matmuls: bool = True
    """A checkpointed unit's recompute repeats its forward FLOPs (``recompute_granularity: full``).
    False under ``selective``, which repeats no matmul and no attention: what it recomputes (LayerNorms,
    rotary, GELU) is outside the FLOP formula, as in the forward."""


@dataclass(frozen=True)
class StepTime:
    """One optimizer step: seconds by phase (what the step waits for), totals and throughput."""
    exposed_s: dict
    """{phase or compute/recompute/optimizer: seconds on the step's critical path}."""
    comm_s: dict
    """{phase: seconds of communication before overlap}."""
    model_flops: float
    """Model FLOPs one rank does per step (no recompute), for TFLOPS."""
    inter_node_comm_s: dict = field(default_factory=dict)
    """{phase: seconds of the collectives that cross nodes}, before overlap."""

    @property
    def total_s(self) -> float:
        return sum(self.exposed_s.values())

    @property
    def hidden_s(self) -> float:
        return sum(self.comm_s.values()) - sum(v for k, v in self.exposed_s.items() if k in self.comm_s)

    @property
    def tflops_per_device(self) -> float:
        return self.model_flops / self.total_s / 1e12 if self.total_s else 0.0


class _Timeline:
    """Adds windows of compute and communication to the critical path, attributing by phase."""

    def __init__(self, device: Device):
        self.device, self.exposed = device, {}

    def add(self, name: str, seconds: float) -> None:
        if seconds:
            self.exposed[name] = self.exposed.get(name, 0.0) + seconds

    def exposed_transfers(self, transfers: list) -> None:
        for t in transfers:
            self.add(t.phase, t.wire_s + t.kernel_s)

    def window(self, compute: dict, transfers: list) -> None:
        """Compute {name: s} with ``transfers`` behind it. Transfer i can hide e_i x its wire time
        (e_i its tier's overlap efficiency), and all of them together at most e x C, e the
        wire-weighted efficiency: with one efficiency e this is e x min(C, M). Kernels stay exposed."""
        c = sum(compute.values())
        for name, s in compute.items():
            self.add(name, s)
        hidable = [self.device.overlap(t.tier) * t.wire_s for t in transfers]
        wire, can = sum(t.wire_s for t in transfers), sum(hidable)
        hidden = min(can, can / wire * c) if wire else 0.0
        for t, h in zip(transfers, hidable):
            self.add(t.phase, t.wire_s - (hidden * h / can if can else 0.0) + t.kernel_s)


def step_time(spec: CommSpec, hw: Hardware, work: StepWork, collectives: Optional[list] = None) -> StepTime:
    """The predicted step (module docstring): per micro-batch, forward then backward unit by unit
    with the engine's overlap, then the step boundary. ``collectives``: another library's list for
    the same spec (deepspeed_model.py), scheduled the same way; default the engine's (comm_model)."""
    missing = set(spec.tiers) - set(hw.links)
    if missing:
        raise CommModelError(f"hardware ({hw.source}) has no figures for tiers {sorted(missing)}")
    units, a = len(spec.unit_numels), spec.micro_batches
    if len(work.unit_flops_per_token) != units:
        raise CommModelError(f"{len(work.unit_flops_per_token)} unit FLOP counts for {units} units")
    per_micro, boundary, comm_s, inter = _comm_by_slot(spec, hw, collectives)
    rate = hw.device.achieved_flops
    fwd = [f * work.tokens_per_micro_batch / rate for f in work.unit_flops_per_token]
    prefetch = work.prefetch_gathers
    overlap = spec.reductions_in_flight > 0 if work.overlap_comm is None else work.overlap_comm
    line = _Timeline(hw.device)

    def comm(slot: str, u: int, m: int) -> list:
        return per_micro.get((slot, u, m), [])

    for m in range(a):
        line.exposed_transfers(comm("gather_f", 0, m))
        for u in range(units):
            ahead = comm("gather_f", u + 1, m) if u + 1 < units else []
            line.window({COMPUTE: fwd[u]}, ahead if prefetch else [])
            if not prefetch:
                line.exposed_transfers(ahead)
        for u in reversed(range(units)):
            behind = comm("gather_b", u - 1, m) if prefetch and u > 0 else []
            if not prefetch:
                line.exposed_transfers(comm("gather_b", u, m))
            if overlap and u + 1 < units:
                behind = behind + comm("reduce", u + 1, m)
            recompute = fwd[u] if u in spec.checkpointed_units and work.recompute_matmuls else 0.0
            line.window({COMPUTE: 2 * fwd[u], RECOMPUTE: recompute}, behind)
            if not overlap:
                line.exposed_transfers(comm("reduce", u, m))
            line.exposed_transfers(comm("reduce_sync", u, m))  # issued after the unit's backward, done at once
        if overlap:
            line.exposed_transfers(comm("reduce", 0, m))
    line.exposed_transfers(boundary)
    os_ = spec.factors[2]
    line.add(OPTIMIZER, sum(s // os_ for s in padded_unit_numels(spec)) / hw.device.optimizer_elements_per_s)
    flops = 3 * sum(work.unit_flops_per_token) * work.tokens_per_micro_batch * a
    return StepTime(line.exposed, comm_s, flops, inter)


def _comm_by_slot(spec: CommSpec, hw: Hardware, collectives: Optional[list] = None):
    """Transfers by (slot, unit, micro-batch) for the per-micro-batch phases (slot gather_f,
    gather_b, reduce), the step boundary's transfers, seconds by phase and the cross-node seconds."""
    per_micro: dict = {}
    boundary, totals, inter = [], {}, {}
    a = spec.micro_batches
    tiers, factors, seen = spec.layout.tiers, spec.factors, {}
    for col in step_collectives(spec) if collectives is None else collectives:
        # The blocks of a model are alike: one step's hundreds of collectives are a few dozen distinct
        # ones, each timed once (the unit and the count are not the transfer's).
        key = (col.phase, col.op, col.group, col.numel, col.elem_bytes, col.bits, col.kernel_elements, col.copy_bytes)
        if key not in seen:
            seen[key] = (transfer_of(col, spec, hw), _kind_footprint(tiers, factors, col.group, col.op, hw.backend))
        once, fp = seen[key]
        seconds = col.count * (once.wire_s + once.kernel_s)
        if not seconds:
            continue
        totals[col.phase] = totals.get(col.phase, 0.0) + seconds
        if fp.domain_load.get("inter_node", 0.0) > 0:
            inter[col.phase] = inter.get(col.phase, 0.0) + seconds
        if col.phase in BOUNDARY_PHASES or col.phase == "eval_gather" or col.unit is None:
            boundary += [once] * col.count
            continue
        slot = {"fwd_gather": "gather_f", "bwd_gather": "gather_b", "recompute_gather": "gather_b",
                "grad_reduce": "reduce"}[col.phase]
        if slot == "reduce" and hw.backend == "gloo" and fp.algorithm == RING_REDUCE_SCATTER:
            slot = "reduce_sync"  # comm.py runs gloo's ring of sends itself, before returning
        # A collective run every micro-batch (count a) lands in each; zeropp's world gather (count 1)
        # in the first micro-batch, its node gathers (count a - 1) in the others.
        first = 0 if col.count == a else (1 if col.phase == "fwd_gather" and _has_world_gather(spec, col) else 0)
        for m in range(first, first + col.count):
            per_micro.setdefault((slot, col.unit, min(m, a - 1)), []).append(once)
    return per_micro, boundary, totals, inter


def _has_world_gather(spec: CommSpec, col: Collective) -> bool:
    """zeropp's node gathers of a unit follow its world gather in micro-batch 0."""
    return spec.layout.hpz and col.group == "node"


def scaling_efficiency(tflops_by_nodes: Mapping) -> dict:
    """{nodes: TFLOPS per device / TFLOPS per device at the smallest node count} (weak scaling)."""
    if not tflops_by_nodes:
        return {}
    base = tflops_by_nodes[min(tflops_by_nodes)]
    return {n: (t / base if base else 0.0) for n, t in sorted(tflops_by_nodes.items())}

