"""Analytic communication model of the ZeRO-topo engine: bytes per (phase, tier) (step time: time_model.py).

This module restates the algorithm of ``docs/engine.md`` from scratch and imports nothing from the
engine (nor its flat units, collectives or quantizer): the tests compare the engine's byte ledger
with this prediction entry by entry, so the two must be independent statements of the same
algorithm. What both sides take as given is the shard layout (``megatron.topology.layout``: a
preset's factors, the padding quantum); the groups' members, the collectives and their bytes are
restated here.

Vocabulary shared with the ledger: a *collective* (op) runs in every *group* of one kind (weight,
stride, cross, replica, node, rail, world: ``megatron.topology.names``); in a ring collective each member sends to the next
member of its group's sorted ring, in an all-to-all to every other member, and every send is charged
to the *tier* between the two ranks and to a *phase*.

Quantized collectives (engine.md, "Quantized collectives") are described by ``CommSpec.quant``, a
``QuantSpec`` of effective bits per phase: a quantized gather moves packed messages (codes + fp32
block scales in one uint8 buffer), a quantized reduction hop is an all-to-all of packed messages.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Optional

from megatron.config.errors import ConfigError
from megatron.config.quant_spec import QuantSpec
from megatron.topology.layout import ShardLayout
from megatron.topology.names import ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, REDUCE_SCATTER, STEP_PHASES, TIERS_BY_DEPTH

PHASES = STEP_PHASES  # what one optimizer step sends (the ledger's "checkpoint" phase is outside it)

FP32_BYTES, FP64_BYTES = 4, 8
CROSS_NODE_REDUCTIONS = ("reduce_scatter", "all_reduce")  # zero_optimization.cross_node_reduction

Ledger = dict  # dict[(phase, tier), int]: bytes sent per optimizer step


class CommModelError(ConfigError, ValueError):
    """A CommSpec the model cannot describe (bad layout, factors, preset...): a one-line user error."""


def packed_message_bytes(numel: int, bits: int, block_size: int) -> int:
    """Bytes of one quantized message of ``numel`` elements: codes (numel x bits/8), then numel/b
    fp32 scales. The model's chunks are whole blocks by construction; anything else is a model bug."""
    if numel % block_size or numel * bits % 8:
        raise CommModelError(f"a {bits}-bit message of {numel} elements is not whole blocks of {block_size}")
    return numel * bits // 8 + FP32_BYTES * numel // block_size


@dataclass(frozen=True)
class CommSpec:
    """Everything the model needs about one optimizer step of one run."""
    unit_numels: tuple
    """Parameter count P_u of each unit in forward order: embedding, blocks..., final norm + head."""
    layout: ShardLayout
    """The run's shard layout (megatron/topology/layout.py): tiers, (w, g, os) and the preset's name."""
    micro_batches: int = 1
    """Gradient-accumulation micro-batches A per optimizer step."""
    compute_bytes: int = 4
    """Compute dtype size c: 4 (fp32) or 2 (bf16/fp16)."""
    fp32_allreduce: bool = False
    """Gradient hops across nodes in fp32 instead of the compute dtype: the step-boundary hops (cross,
    replica) and an unquantized micro-step hop whose groups span nodes (stage 2/3, zeropp, wide w or g)."""
    reduce_bytes: Optional[int] = None
    """communication_data_type's element size (4 or 2): every unquantized gradient hop, inside a node
    too, sends it; None: the compute dtype inside a node, fp32_allreduce's rule across nodes."""
    checkpointed_units: frozenset = frozenset()
    """Indices of units run under activation checkpointing (see ``transformer_block_units``)."""
    eval_forward_passes: int = 0
    """Evaluation micro-batches in this step's window (with their one eval-loss allreduce)."""
    loss_vector_len: int = 3
    """Elements of the trainer's float64 step vector (loss sum, micro-batch count, stop flag)."""
    eval_loss_vector_len: int = 2
    """Elements of the evaluation's float64 loss vector (loss sum, count), one per eval window."""
    ledger_vector_len: int = (len(PHASES) + 1) * 3
    """The ledger's float64 counters, which ride in the step vector's all-reduce: (phases + the
    off-step `checkpoint` phase) x 3 tiers — the ledger keeps all three tiers even on 2-tier layouts."""
    reductions_in_flight: int = 0
    """Gradient-reduction pieces in flight behind the backward (overlap_comm: reduce_buckets_in_flight);
    0 = each reduction waited for at once. Memory only: the bytes sent do not depend on it."""
    reduce_bucket_elements: int = 500_000_000
    """Most elements of one gradient-reduction piece (reduce_bucket_size). Memory only."""
    quant: QuantSpec = field(default_factory=QuantSpec)
    """Quantized collectives: effective bits per phase, block size, error feedback (default: none)."""
    full_refresh: bool = False
    """With weight deltas (quant.weight_delta_bits): this step's refresh sends the weights themselves
    (every weight_delta_full_refresh_interval steps), not their change."""
    cross_node_reduction: str = "reduce_scatter"
    """The ladder's step-boundary cross hop: reduce_scatter of the S/g accumulator (ours; quantized when
    quant.cross_node_grad_bits > 0), or all_reduce of it, unquantized, each member keeping its S/os
    (the paper's: twice the reduce-scatter's bytes)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "unit_numels", tuple(int(p) for p in self.unit_numels))
        object.__setattr__(self, "checkpointed_units", frozenset(self.checkpointed_units))
        _validate(self)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def ranks_per_node(self) -> int:
        return self.layout.ranks_per_node

    @property
    def tiers(self) -> tuple:
        """Tier names, slowest first."""
        return TIERS_BY_DEPTH[len(self.layout.tiers)]

    @property
    def factors(self) -> tuple:
        """(w, g, os); zeropp reports (N, N, N), its primary sharding."""
        return self.layout.factors.as_tuple()


def transformer_block_units(num_units: int) -> frozenset:
    """The units activation checkpointing covers: every unit but the embedding and the final one."""
    return frozenset(range(1, num_units - 1))


def _validate(spec: CommSpec) -> None:
    if not spec.unit_numels or min(spec.unit_numels) < 1:
        raise CommModelError("unit_numels must be a non-empty list of positive parameter counts")
    if not isinstance(spec.layout, ShardLayout):
        raise CommModelError(f"layout must be a ShardLayout (ShardLayout.resolve(tiers, preset=...)); "
                             f"got {type(spec.layout).__name__}")
    if spec.micro_batches < 1 or spec.eval_forward_passes < 0:
        raise CommModelError("micro_batches must be >= 1 and eval_forward_passes >= 0")
    if spec.compute_bytes not in (2, 4) or spec.reduce_bytes not in (None, 2, 4):
        raise CommModelError(f"compute_bytes and reduce_bytes must be 2 or 4; got {spec.compute_bytes}, "
                             f"{spec.reduce_bytes}")
    if not spec.checkpointed_units <= set(range(len(spec.unit_numels))):
        raise CommModelError(f"checkpointed_units {sorted(spec.checkpointed_units)} name units that do not exist")
    if min(spec.loss_vector_len, spec.eval_loss_vector_len, spec.ledger_vector_len) < 1:
        raise CommModelError("loss_vector_len, eval_loss_vector_len and ledger_vector_len must be >= 1")
    if not isinstance(spec.quant, QuantSpec):
        raise CommModelError(f"quant must be a QuantSpec; got {type(spec.quant).__name__}")
    if spec.quant.weight_delta_bits and spec.layout.hpz:
        raise CommModelError("weight deltas need a ladder layout (a refresh across the cross group); zeropp has none")
    if spec.cross_node_reduction not in CROSS_NODE_REDUCTIONS:
        raise CommModelError(f"cross_node_reduction must be one of {', '.join(CROSS_NODE_REDUCTIONS)}; "
                             f"got {spec.cross_node_reduction!r}")
    if spec.cross_node_reduction == "all_reduce" and (spec.quant.cross_node_grad_bits or spec.layout.hpz):
        raise CommModelError("cross_node_reduction all_reduce is an unquantized hop over the cross group: it needs "
                             f"cross_node_grad_bits 0 (got {spec.quant.cross_node_grad_bits}) and a ladder layout, "
                             "not zeropp")


# -- padding -------------------------------------------------------------------------------------

def padded_unit_numels(spec: CommSpec) -> tuple:
    """S_u = ceil(P_u / q) * q for every unit, q the layout's padding quantum: N, or N x b with any
    phase quantized (``ShardLayout.padding_quantum`` says why)."""
    return _padded(spec.layout, tuple(spec.unit_numels), spec.quant.block_size if spec.quant.enabled else None)


@lru_cache(maxsize=1024)
def _padded(layout: ShardLayout, unit_numels: tuple, block: Optional[int]) -> tuple:
    """Cached: one planner search asks for the same layout's sizes several times per candidate."""
    return tuple(layout.padded_size(p, block) for p in unit_numels)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# -- ranks, tiers, groups ------------------------------------------------------------------------

def rank_coords(rank: int, layout: tuple) -> tuple:
    """Mixed-radix digits of a rank, slowest tier first: (node, gpu, gcd) or (node, local)."""
    digits = []
    for size in reversed(layout):
        digits.append(rank % size)
        rank //= size
    return tuple(reversed(digits))


def tier_between(a: int, b: int, layout: tuple) -> str:
    """The slowest tier in which the coordinates of two distinct ranks differ."""
    ca, cb = rank_coords(a, layout), rank_coords(b, layout)
    for tier, da, db in zip(TIERS_BY_DEPTH[len(layout)], ca, cb):
        if da != db:
            return tier
    raise CommModelError(f"no tier between rank {a} and itself")


def ring_hops(group: list, layout: tuple) -> list:
    """(sender, receiver, tier) for each member of a sorted ring, the last wrapping to the first."""
    ranks = sorted(group)
    return [(src, dst, tier_between(src, dst, layout))
            for src, dst in zip(ranks, ranks[1:] + ranks[:1])] if len(ranks) > 1 else []


def groups_of_kind(kind: str, spec: CommSpec) -> list:
    """All groups of one kind, each a sorted rank list (engine.md, "Groups")."""
    n, r = spec.world_size, spec.ranks_per_node
    w, g, os_ = spec.factors
    if kind == "weight":
        return [list(range(b * w, b * w + w)) for b in range(n // w)]
    if kind == "stride":
        return [[gb + i * w + pos for i in range(g // w)] for gb in range(0, n, g) for pos in range(w)]
    if kind == "cross":
        return [[ob + j * g + pos for j in range(os_ // g)] for ob in range(0, n, os_) for pos in range(g)]
    if kind == "replica":
        return [[k * os_ + pos for k in range(n // os_)] for pos in range(os_)]
    if kind == "node":
        return [list(range(node * r, node * r + r)) for node in range(n // r)]
    if kind == "rail":  # zeropp qgZ's second hop: the same local rank on every node
        return [[node * r + local for node in range(n // r)] for local in range(r)]
    if kind == "world":
        return [list(range(n))]
    raise CommModelError(f"unknown group kind {kind!r}")


# -- the algorithm as a list of collectives ------------------------------------------------------

@dataclass(frozen=True)
class Collective:
    """One collective issued in every group of a kind, `count` times per optimizer step."""
    phase: str
    op: str
    group: str
    numel: int
    """Elements of the full buffer B (allgather output, reduce-scatter input, allreduce buffer,
    all-to-all input); a quantized collective's buffer is packed uint8 (numel = bytes)."""
    elem_bytes: int
    count: int = 1
    unit: Optional[int] = None
    """The unit it moves (None: the control vectors); the time model schedules by unit."""
    bits: int = 0
    """Quantized payload bits (0: the buffer is in its dtype); the time model adds the kernels' cost."""
    kernel_elements: Optional[float] = None
    """Time model only: elements through one quantize + dequantize per run (None: from ``bits``, the
    packed bytes and the block, ``time_model.quantized_elements``)."""
    copy_bytes: int = 0
    """Time model only: bytes this rank copies locally per run (a swizzle, a secondary copy)."""

    @property
    def nbytes(self) -> int:
        return self.numel * self.elem_bytes


def step_collectives(spec: CommSpec) -> list:
    """Every collective of one optimizer step window (groups of size 1 included; they send nothing)."""
    body = _zeropp_collectives(spec) if spec.layout.hpz else _ladder_collectives(spec)
    return body + control_collectives(spec)


def _gather(phase: str, group: str, numel: int, k: int, elem_bytes: int, bits: int, block: int,
            count: int = 1, unit: Optional[int] = None) -> Collective:
    """Allgather of k chunks into ``numel`` elements; quantized, of k packed messages of numel/k."""
    if bits:
        return Collective(phase, ALL_GATHER, group, k * packed_message_bytes(numel // k, bits, block), 1, count,
                          unit, bits)
    return Collective(phase, ALL_GATHER, group, numel, elem_bytes, count, unit)


def _reduce(phase: str, group: str, numel: int, k: int, elem_bytes: int, bits: int, block: int,
            count: int = 1, unit: Optional[int] = None) -> Collective:
    """One reduction hop of a ``numel``-element input over k ranks: a reduce-scatter in dtype, or an
    all-to-all of k packed messages of numel/k elements (piece j to member j)."""
    if bits:
        return Collective(phase, ALL_TO_ALL, group, k * packed_message_bytes(numel // k, bits, block), 1, count,
                          unit, bits)
    return Collective(phase, REDUCE_SCATTER, group, numel, elem_bytes, count, unit)


ROTATION_PASS_BYTES = 2 * FP32_BYTES  # a Hadamard pass reads and writes each fp32 element once


def _with_rotation(chain: list, sizes: list, numel_in: int, numel_out: int, spec: CommSpec) -> list:
    """A quantized gradient reduction's hops, the first that runs (a group of more than one rank)
    also charged the Hadamard rotation's two local passes (the chain's input before its first
    quantization, its fp32 sum after the last hop) as ``copy_bytes`` when the rotation is on."""
    if spec.quant.gradient_rotation != "hadamard" or not chain[0].bits:
        return chain
    for i, k in enumerate(sizes):
        if k > 1:
            chain = list(chain)  # per run, as copy_bytes is
            chain[i] = dataclasses.replace(chain[i], copy_bytes=chain[i].copy_bytes
                                           + ROTATION_PASS_BYTES * (numel_in + numel_out))
            return chain
    return chain


def _spans_nodes(kind: str, spec: CommSpec) -> bool:
    """Whether the groups of a kind (all alike) hold ranks of more than one node."""
    first = groups_of_kind(kind, spec)[0]
    return any(tier_between(first[0], r, spec.layout.tiers) == "inter_node" for r in first[1:])


def gradient_hop_bytes(kind: str, spec: CommSpec) -> int:
    """Element size of an unquantized gradient hop over ``kind``: reduce_bytes when set; else fp32
    when its groups span nodes and fp32_allreduce is on (the step-boundary hops always span them, or
    have one rank), else c."""
    if spec.reduce_bytes is not None:
        return spec.reduce_bytes
    return FP32_BYTES if spec.fp32_allreduce and _spans_nodes(kind, spec) else spec.compute_bytes


def boundary_bytes(spec: CommSpec) -> int:
    """Element size of the step boundary's unquantized hops (cross, replica): reduce_bytes, else fp32
    with fp32_allreduce, else c."""
    if spec.reduce_bytes is not None:
        return spec.reduce_bytes
    return FP32_BYTES if spec.fp32_allreduce else spec.compute_bytes


def _ladder_collectives(spec: CommSpec) -> list:
    w, g, os_ = spec.factors
    c, a, e = spec.compute_bytes, spec.micro_batches, spec.eval_forward_passes
    boundary = boundary_bytes(spec)
    weight_hop, stride_hop = gradient_hop_bytes("weight", spec), gradient_hop_bytes("stride", spec)
    qs, b = spec.quant, spec.quant.block_size
    # the refresh's cross hop: the weights' change with weight deltas (but at a full refresh)
    refresh_bits = qs.weight_delta_bits if qs.weight_delta_bits and not spec.full_refresh else qs.refresh_bits
    out = []
    sizes = padded_unit_numels(spec)
    for u, s in enumerate(sizes):
        backward_gather = "recompute_gather" if u in spec.checkpointed_units else "bwd_gather"
        passes = ([("eval_gather", e)] if e else []) + [("fwd_gather", a)]
        if u != len(sizes) - 1:  # the last unit stays gathered from its forward to its backward
            passes.append((backward_gather, a))
        out += [_gather(phase, "weight", s, w, c, qs.weight_gather_bits, b, n, u) for phase, n in passes]
        # the step boundary's cross hop on the S/g accumulator: the paper's all-reduce, or our reduce-scatter
        cross_hop = (Collective("cross_grad_reduce", ALL_REDUCE, "cross", s // g, boundary, 1, u)
                     if spec.cross_node_reduction == "all_reduce" else
                     _reduce("cross_grad_reduce", "cross", s // g, os_ // g, boundary, qs.cross_node_grad_bits, b, 1, u))
        micro = [_reduce("grad_reduce", "weight", s, w, weight_hop, qs.grad_reduce_bits, b, a, u),
                 _reduce("grad_reduce", "stride", s // w, g // w, stride_hop, qs.grad_reduce_bits, b, a, u)]
        out += _with_rotation(micro, [w, g // w], s, s // g, spec) + _with_rotation([cross_hop], [os_ // g], s // g, s // os_, spec) + [
                Collective("replica_allreduce", ALL_REDUCE, "replica", s // os_, boundary, 1, u),
                _gather("refresh", "cross", s // g, os_ // g, c, refresh_bits, b, 1, u),
                _gather("refresh", "stride", s // w, g // w, c, 0, b, 1, u)]
    return out


def _zeropp_collectives(spec: CommSpec) -> list:
    """hpZ: the first gather of a unit after the update spans the world, later ones the node.

    The trainer evaluates after the ledger sync of a step, so a window holding evaluation passes
    runs them before its training micro-batches: the world gather then falls in ``eval_gather``.

    With quantized weights every gather moves packed messages (the node gathers: the secondary
    copies, each the packed message of S/R elements). With quantized gradients (qgZ) the world
    reduce-scatter becomes two all-to-alls: node group (input S), then rail group (input S/R).

    Local work the time model charges (``Collective.copy_bytes``): the world gather keeps the node's
    secondary copy (a clone of S/R elements; quantized, its messages unpacked and packed again), and
    qgZ's node hop first swizzles the gradient (a copy of S elements) so that the hop leaves each
    local rank its chunk of every node.
    """
    c, a, e = spec.compute_bytes, spec.micro_batches, spec.eval_forward_passes
    n, r = spec.world_size, spec.ranks_per_node
    wbits, gbits, b = spec.quant.weight_gather_bits, spec.quant.grad_reduce_bits, spec.quant.block_size
    out = []
    sizes = padded_unit_numels(spec)
    for u, s in enumerate(sizes):
        backward_gather = "recompute_gather" if u in spec.checkpointed_units else "bwd_gather"
        first = "eval_gather" if e else "fwd_gather"
        # the last unit stays gathered from its forward to its backward: no backward gather
        later = {"eval_gather": e, "fwd_gather": a, backward_gather: a if u != len(sizes) - 1 else 0}
        later[first] -= 1
        secondary = 2 * packed_message_bytes(s // r, wbits, b) if wbits else s // r * c
        out.append(dataclasses.replace(_gather(first, "world", s, n, c, wbits, b, 1, u), copy_bytes=secondary))
        out += [_gather(phase, "node", s, r, c, wbits, b, count, u) for phase, count in later.items() if count]
        if gbits:
            rail_bits = spec.quant.cross_node_grad_bits or gbits  # a qgZ hop cannot run unquantized
            qgz = [dataclasses.replace(_reduce("grad_reduce", "node", s, r, c, gbits, b, a, u), copy_bytes=s * c),
                   _reduce("grad_reduce", "rail", s // r, n // r, c, rail_bits, b, a, u)]
            out += _with_rotation(qgz, [r, n // r], s, s // n, spec)
        else:
            out.append(_reduce("grad_reduce", "world", s, n, gradient_hop_bytes("world", spec), 0, b, a, u))
    return out


def control_collectives(spec: CommSpec) -> list:
    n = spec.world_size
    # the squared grad-norm partials; the step vector, with the ledger's counters riding in it
    out = [Collective("control", ALL_REDUCE, "world", n, FP32_BYTES),
           Collective("control", ALL_REDUCE, "world", _round_up(spec.loss_vector_len + spec.ledger_vector_len, n),
                      FP64_BYTES)]
    if spec.eval_forward_passes:  # the evaluation's own loss allreduce
        out.append(Collective("control", ALL_REDUCE, "world", _round_up(spec.eval_loss_vector_len, n), FP64_BYTES))
    return out


# -- charging bytes (engine.md, "Bytes charged") -------------------------------------------------

def _sent_bytes(op: str, k: int, nbytes: int) -> int:
    """Bytes one member sends in a ring collective over k ranks on a B-byte buffer.

    Padding every unit to a multiple of N (and the control vectors too) makes B a multiple of k for
    every collective; a B that is not means the model itself is wrong, so it refuses to round.
    """
    if nbytes % k:
        raise CommModelError(f"{op} of {nbytes} bytes over {k} ranks: the model's buffers must be multiples of k")
    if op in (ALL_GATHER, REDUCE_SCATTER):
        return (k - 1) * nbytes // k
    if op == ALL_REDUCE:
        return 2 * (k - 1) * nbytes // k
    if op == ALL_TO_ALL:
        return nbytes // k  # to each other member
    raise CommModelError(f"unknown collective op {op!r}")


def _sends_by_kind(spec: CommSpec, kinds: set) -> dict:
    """{kind: (k, [(sender, receiver, tier), ...])} for the kinds whose groups have k > 1."""
    out = {}
    for kind in kinds:
        groups = groups_of_kind(kind, spec)
        k = len(groups[0])
        if k > 1:
            out[kind] = (k, [hop for grp in groups for hop in ring_hops(grp, spec.layout.tiers)])
    return out


def predict_ledger_per_rank(spec: CommSpec) -> dict:
    """{rank: {(phase, tier): bytes that rank sends per optimizer step}} (non-zero entries only)."""
    collectives = step_collectives(spec)
    sends = _sends_by_kind(spec, {col.group for col in collectives})
    per_rank = {r: {} for r in range(spec.world_size)}
    for col in collectives:
        if col.group not in sends:
            continue
        k, hops = sends[col.group]
        if col.op == ALL_TO_ALL:
            members = groups_of_kind(col.group, spec)
            hops = [(src, dst, tier_between(src, dst, spec.layout.tiers))
                    for grp in members for src in grp for dst in grp if dst != src]
        nbytes = _sent_bytes(col.op, k, col.nbytes) * col.count
        for src, _dst, tier in hops:
            entry = per_rank[src]
            entry[(col.phase, tier)] = entry.get((col.phase, tier), 0) + nbytes
    return per_rank


def predict_ledger(spec: CommSpec) -> Ledger:
    """{(phase, tier): bytes sent per optimizer step, summed over all ranks} (non-zero entries)."""
    total: Ledger = {}
    for entries in predict_ledger_per_rank(spec).values():
        for key, nbytes in entries.items():
            total[key] = total.get(key, 0) + nbytes
    return dict(sorted(total.items(), key=lambda kv: (PHASES.index(kv[0][0]), kv[0][1])))


def bytes_by_tier(ledger: Ledger) -> dict:
    """{tier: bytes} summed over phases."""
    out: dict = {}
    for (_phase, tier), nbytes in ledger.items():
        out[tier] = out.get(tier, 0) + nbytes
    return out
