"""Sharding factors (w, g, os), the chunk each rank holds, and the process groups, built once.

Every group is "the ranks that differ only in one band of the rank number", listed in sorted order,
so shards nest by construction (docs/engine.md, "Groups"). ``ProcessGroups`` is created once per run
and passed explicitly; there are no module-level groups.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional

from megatron.topology.topology import Topology, TopologyError

STAGE_NAMES = {0: "stage0", 1: "stage1", 2: "stage2", 3: "stage3"}
PRESETS = ("stage0", "stage1", "stage2", "stage3", "hsdp", "zero_topo", "zeropp")


@dataclass(frozen=True)
class ShardFactors:
    """Weights in 1/w, gradients in 1/g, optimizer states in 1/os; ``w | g | os | N``."""
    w: int
    g: int
    os: int

    def as_tuple(self) -> tuple[int, int, int]:
        return (self.w, self.g, self.os)


@dataclass(frozen=True)
class ShardChunks:
    """Chunk indices (0-based) a rank holds: of S/w, of S/g and of S/os elements."""
    weight: int
    grad: int
    opt: int


def validate_factors(world_size: int, w: int, g: int, os: int) -> ShardFactors:
    """Return the factors, or raise naming the first divisibility that fails."""
    for name, value in (("w", w), ("g", g), ("os", os)):
        if not isinstance(value, int) or value < 1:
            raise TopologyError(f"shard factor {name} must be a positive integer, got {value!r}")
    for small, big, a, b in (("w", "g", w, g), ("g", "os", g, os), ("os", "N", os, world_size)):
        if b % a:
            raise TopologyError(f"shard factors (w={w}, g={g}, os={os}) with N={world_size}: "
                                f"{small}={a} does not divide {big}={b}")
    return ShardFactors(w, g, os)


def chunks_of(rank: int, factors: ShardFactors) -> ShardChunks:
    w, g, os = factors.as_tuple()
    weight = rank % w
    grad = weight * (g // w) + (rank % g) // w
    opt = grad * (os // g) + (rank % os) // g
    return ShardChunks(weight, grad, opt)


def shard_map(world_size: int, w: int, g: int, os: int) -> list[ShardChunks]:
    """Chunk indices of every rank (index = rank); a pure function of (N, w, g, os)."""
    factors = validate_factors(world_size, w, g, os)
    return [chunks_of(r, factors) for r in range(world_size)]


def chunk_range(size: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of chunk ``index`` when ``size`` elements are cut into ``parts`` equal chunks."""
    if size % parts:
        raise TopologyError(f"a buffer of {size} elements cannot be cut into {parts} equal chunks")
    step = size // parts
    return index * step, (index + 1) * step


def preset_factors(preset: str, topology: Topology) -> ShardFactors:
    """The (w, g, os) of a named preset (docs/engine.md "Presets"); zeropp shards everything N ways."""
    n, r = topology.world_size, topology.ranks_per_node
    table = {
        "stage0": (1, 1, 1), "stage1": (1, 1, n), "stage2": (1, n, n), "stage3": (n, n, n),
        "hsdp": (r, r, r), "zero_topo": (topology.fastest_tier_size, r, n), "zeropp": (n, n, n),
    }
    if preset not in table:
        raise TopologyError(f"unknown ZeRO preset {preset!r}; choose one of {', '.join(PRESETS)}")
    return validate_factors(n, *table[preset])


def resolve_factors(zero_cfg, topology: Topology) -> tuple[ShardFactors, Optional[str]]:
    """(factors, preset name) from a ``ZeroConfig``: shard_factors > preset > stage."""
    n = topology.world_size
    if zero_cfg.shard_factors:
        if len(zero_cfg.shard_factors) != 3:
            raise TopologyError(f"zero_optimization.shard_factors must be [w, g, os], got {zero_cfg.shard_factors}")
        return validate_factors(n, *[int(x) for x in zero_cfg.shard_factors]), None
    if zero_cfg.preset:
        return preset_factors(zero_cfg.preset, topology), zero_cfg.preset
    if zero_cfg.stage not in STAGE_NAMES:
        raise TopologyError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {zero_cfg.stage}")
    name = STAGE_NAMES[zero_cfg.stage]
    return preset_factors(name, topology), name


# ---------------------------------------------------------------------------------------------------
# Rank lists of the groups (pure) and the process groups (collective creation)
# ---------------------------------------------------------------------------------------------------

def group_ranks(kind: str, rank: int, world_size: int, factors: ShardFactors, ranks_per_node: int) -> tuple[int, ...]:
    """Sorted ranks of the ``kind`` group that contains ``rank`` (docs/engine.md "Groups")."""
    w, g, os = factors.as_tuple()
    if kind == "weight":
        base = (rank // w) * w
        return tuple(range(base, base + w))
    if kind == "stride":
        base = (rank // g) * g
        return tuple(base + i * w + rank % w for i in range(g // w))
    if kind == "cross":
        base = (rank // os) * os
        return tuple(base + j * g + rank % g for j in range(os // g))
    if kind == "replica":
        return tuple(k * os + rank % os for k in range(world_size // os))
    if kind == "node":
        base = (rank // ranks_per_node) * ranks_per_node
        return tuple(range(base, base + ranks_per_node))
    if kind == "rail":  # the same local rank on every node: zeropp's qgZ second hop
        return tuple(node * ranks_per_node + rank % ranks_per_node for node in range(world_size // ranks_per_node))
    if kind == "world":
        return tuple(range(world_size))
    raise TopologyError(f"unknown group kind {kind!r}")


GROUP_KINDS = ("weight", "stride", "cross", "replica", "node", "rail", "world")  # world last (always exists)


@dataclass(frozen=True)
class RankGroup:
    """One group as this rank sees it: its sorted ranks and the torch handle (None when size 1)."""
    kind: str
    ranks: tuple[int, ...]
    handle: Any = field(default=None, compare=False, repr=False)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def index(self, rank: int) -> int:
        return self.ranks.index(rank)


class ProcessGroups:
    """The weight, stride, cross, replica, node, rail and world groups of this rank.

    Every rank calls ``dist.new_group`` for every distinct multi-rank group, in the same order
    (all groups of each kind, kinds in ``GROUP_KINDS`` order), and keeps the ones it belongs to.
    With ``create=False`` (or one rank) no torch group is made: the rank lists alone, for planning.
    """

    def __init__(self, topology: Topology, factors: ShardFactors, rank: int, *, create: bool = True,
                 timeout_s: Optional[float] = None):
        n = topology.world_size
        validate_factors(n, *factors.as_tuple())
        if not 0 <= rank < n:
            raise TopologyError(f"rank {rank} is outside a world of {n}")
        self.topology, self.factors, self.rank, self.world_size = topology, factors, rank, n
        handles = self._create_all(timeout_s) if create and n > 1 else {}
        for kind in GROUP_KINDS:
            ranks = group_ranks(kind, rank, n, factors, topology.ranks_per_node)
            setattr(self, kind, RankGroup(kind, ranks, handles.get(ranks)))
        self.weight: RankGroup
        self.stride: RankGroup
        self.cross: RankGroup
        self.replica: RankGroup
        self.node: RankGroup
        self.rail: RankGroup
        self.world: RankGroup

    @classmethod
    def build(cls, topology: Topology, factors: ShardFactors, timeout_s: Optional[float] = None) -> "ProcessGroups":
        """Groups for the current process of an initialised default process group (or one process)."""
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            if dist.get_world_size() != topology.world_size:
                raise TopologyError(f"topology {topology.name} has {topology.world_size} ranks but "
                                    f"the process group has {dist.get_world_size()}")
            return cls(topology, factors, dist.get_rank(), timeout_s=timeout_s)
        if topology.world_size != 1:
            raise TopologyError(f"topology {topology.name} has {topology.world_size} ranks but torch.distributed is not initialised")
        return cls(topology, factors, 0)

    def _create_all(self, timeout_s: Optional[float]) -> dict:
        import torch.distributed as dist
        n = self.world_size
        handles: dict[tuple[int, ...], Any] = {tuple(range(n)): dist.group.WORLD}
        timeout = timedelta(seconds=timeout_s) if timeout_s else None
        for kind in GROUP_KINDS[:-1]:
            for member in range(n):
                ranks = group_ranks(kind, member, n, self.factors, self.topology.ranks_per_node)
                if len(ranks) == 1 or ranks in handles:
                    continue
                group = dist.new_group(list(ranks), timeout=timeout)
                handles[ranks] = group if self.rank in ranks else None
        return handles

    def sizes(self) -> dict[str, int]:
        return {kind: getattr(self, kind).size for kind in GROUP_KINDS}
