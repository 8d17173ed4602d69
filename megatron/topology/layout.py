"""The shard layout of a run, made and validated once: tiers, factors (w, g, os), preset name, the
chunks each rank holds, the rank lists of its groups, and the padding quantum.

Everything that needs one of these facts (config validation, the engine and its process groups,
the comm and memory models, the dry run, checkpoints, benchmarks) reads it from a ``ShardLayout``,
so the preset table, the stage table and the divisibility check exist once, here. Pure: no torch,
no process groups (those are megatron/topology/groups.py, built from a layout's factors).

Ranks are numbered so that neighbours are closest (docs/engine.md, "Groups"); every group is "the
ranks that differ only in one band of the rank number", listed in sorted order, so shards nest by
construction.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from megatron.topology.errors import TopologyError
from megatron.topology.topology import Topology

# zero_optimization.stage k is the preset STAGE_PRESETS[k].
STAGE_PRESETS = ("stage0", "stage1", "stage2", "stage3")
# The stage presets under the names users give them (configs/ddp.yml, zero1.yml, ...): what tables,
# logs and benchmarks print. The named presets display as themselves (``display_name``).
STAGE_DISPLAY_NAMES = {"stage0": "ddp", "stage1": "zero1", "stage2": "zero2", "stage3": "zero3"}
# The presets `zero_optimization.preset` accepts (the stages have their own key).
NAMED_PRESETS = ("hsdp", "zeropp", "zero_topo")
PRESETS = STAGE_PRESETS + NAMED_PRESETS
CUSTOM = "custom"  # explicit `shard_factors`, whatever they happen to equal
ZEROPP = "zeropp"  # ZeRO++ hpZ: (N, N, N) plus a node-sharded secondary weight copy
SINGLE_PROCESS = (1, 1)  # the tiers of a run without a layout: one node of one rank



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
    """The factors, or a TopologyError saying which divisibility of ``w | g | os | N`` fails."""
    values = (w, g, os)
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
        raise TopologyError(f"expected [w, g, os] of positive integers, got {list(values)}")
    for small, big, a, b in (("w", "g", w, g), ("g", "os", g, os), ("os", "N", os, world_size)):
        if b % a:
            raise TopologyError(f"(w, g, os) = ({w}, {g}, {os}) must satisfy w | g | os | N = {world_size}: "
                                f"{small}={a} does not divide {big}={b}")
    return ShardFactors(w, g, os)


def display_name(preset: str) -> str:
    """``zero3`` for ``stage3`` (STAGE_DISPLAY_NAMES); any other preset name unchanged."""
    return STAGE_DISPLAY_NAMES.get(preset, preset)


def preset_of_display_name(name: str) -> str:
    """The inverse of ``display_name``: ``stage3`` for ``zero3``; any other name unchanged."""
    return {label: preset for preset, label in STAGE_DISPLAY_NAMES.items()}.get(name, name)


def chunk_range(size: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of chunk ``index`` when ``size`` elements are cut into ``parts`` equal chunks."""
    if size % parts:
        raise TopologyError(f"a buffer of {size} elements cannot be cut into {parts} equal chunks")
    step = size // parts
    return index * step, (index + 1) * step


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


def _check_tiers(tiers: Sequence[int]) -> tuple[int, ...]:
    tiers = tuple(tiers)
    if len(tiers) not in (2, 3) or any(isinstance(t, bool) or not isinstance(t, int) or t < 1 for t in tiers):
        raise TopologyError(f"a layout is 2 or 3 positive tier sizes, slowest first (nodes, GPUs[, GCDs]); got {tiers}")
    return tiers


def _preset_factors(preset: str, tiers: tuple[int, ...]) -> tuple[int, int, int]:
    """(w, g, os) of a named preset (docs/engine.md "Presets"); zeropp's primary sharding is (N, N, N)."""
    n, r, fastest = math.prod(tiers), math.prod(tiers[1:]), tiers[-1]
    table = {"stage0": (1, 1, 1), "stage1": (1, 1, n), "stage2": (1, n, n), "stage3": (n, n, n),
             "hsdp": (r, r, r), "zero_topo": (fastest, r, n), "zeropp": (n, n, n)}
    if preset not in table:
        raise TopologyError(f"unknown ZeRO preset {preset!r}; choose one of {', '.join(PRESETS)}")
    return table[preset]


def tiers_of(topology: Topology) -> tuple[int, ...]:
    """A topology's tier sizes slowest first (Topology lists its tiers fastest first)."""
    return tuple(t.size for t in reversed(topology.tiers))


@dataclass(frozen=True)
class ShardLayout:
    """Tiers (ranks per tier, slowest first), the factors and what they are called.

    ``preset`` is one of PRESETS, or ``custom`` for explicit factors; a named preset's factors are
    checked against the preset table, so a layout cannot carry a name that means other factors.
    """
    tiers: tuple[int, ...]
    factors: ShardFactors
    preset: str = CUSTOM

    def __post_init__(self) -> None:
        tiers = _check_tiers(self.tiers)
        object.__setattr__(self, "tiers", tiers)
        validate_factors(math.prod(tiers), *self.factors.as_tuple())
        if self.preset != CUSTOM and _preset_factors(self.preset, tiers) != self.factors.as_tuple():
            raise TopologyError(f"preset {self.preset} on layout {list(tiers)} means (w, g, os) = "
                                f"{_preset_factors(self.preset, tiers)}, not {self.factors.as_tuple()}")

    # -- constructors -------------------------------------------------------------------------------
    @classmethod
    def resolve(cls, tiers: Sequence[int], stage: int = 0, preset: Optional[str] = None,
                shard_factors: Optional[Sequence[int]] = None) -> "ShardLayout":
        """From the parts a config gives: ``shard_factors`` > ``preset`` > ``stage``."""
        tiers = _check_tiers(tiers)
        if shard_factors is not None:
            if isinstance(shard_factors, (str, bytes)) or len(shard_factors) != 3:
                raise TopologyError(f"expected [w, g, os] of positive integers, got {shard_factors}")
            return cls(tiers, validate_factors(math.prod(tiers), *shard_factors), CUSTOM)
        if preset is None:
            if stage not in range(len(STAGE_PRESETS)):
                raise TopologyError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage}")
            preset = STAGE_PRESETS[stage]
        return cls(tiers, ShardFactors(*_preset_factors(preset, tiers)), preset)

    @classmethod
    def from_config(cls, cfg) -> "ShardLayout":
        """The layout of a validated ``NeoXConfig`` (``topology.layout`` None: one process): the
        factors and name validation resolved once (``zero_optimization.resolved_factors`` and
        ``resolved_preset``, or the plan's under ``plan: auto``). A config that was never validated
        (built in code) is resolved from its stage / preset / shard_factors here."""
        zero, tiers = cfg.zero, tuple(cfg.topology.layout or SINGLE_PROCESS)
        if zero.resolved_factors is not None and zero.resolved_preset is not None:
            return cls(tiers, ShardFactors(*zero.resolved_factors), zero.resolved_preset)
        if getattr(zero, "plan", None) == "auto" and zero.shard_factors is None and zero.preset is None:
            raise TopologyError("zero_optimization.plan auto: the layout is chosen at start-up; read it from the "
                                "config megatron.analytic.planner.planned_config returns")
        return cls.resolve(tiers, zero.stage, zero.preset, zero.shard_factors)

    @classmethod
    def from_topology(cls, topology: Topology, factors: Optional[ShardFactors] = None,
                      preset: Optional[str] = None) -> "ShardLayout":
        """On ``topology``'s tiers: a preset's factors, or given factors (named ``preset``, else custom)."""
        if factors is None:
            return cls.resolve(tiers_of(topology), preset=preset)
        return cls(tiers_of(topology), factors, preset or CUSTOM)

    # -- queries ------------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return math.prod(self.tiers)

    @property
    def ranks_per_node(self) -> int:
        return math.prod(self.tiers[1:])

    @property
    def num_nodes(self) -> int:
        return self.tiers[0]

    @property
    def fastest_tier_size(self) -> int:
        """Ranks sharing the fastest link: the GCD pair on Frontier, the node on a two-tier layout."""
        return self.tiers[-1]

    @property
    def hpz(self) -> bool:
        """ZeRO++ hpZ (preset zeropp): the one layout outside the (w, g, os) ladder."""
        return self.preset == ZEROPP

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise TopologyError(f"rank {rank} is outside a layout of {self.world_size} ranks")

    def chunks(self, rank: int) -> ShardChunks:
        """Which chunk of S/w, S/g and S/os ``rank`` holds (docs/engine.md "Groups"): the weight
        chunk is its place in the weight group; its gradient chunk the place in the stride group
        inside that; its optimizer chunk the place in the cross group inside that."""
        self._check_rank(rank)
        w, g, os = self.factors.as_tuple()
        weight = rank % w
        grad = weight * (g // w) + (rank % g) // w
        opt = grad * (os // g) + (rank % os) // g
        return ShardChunks(weight, grad, opt)

    def group(self, kind: str, rank: int) -> tuple[int, ...]:
        """Sorted ranks of ``rank``'s group of ``kind`` (one of GROUP_KINDS)."""
        self._check_rank(rank)
        return group_ranks(kind, rank, self.world_size, self.factors, self.ranks_per_node)

    def padding_quantum(self, quant_block: Optional[int] = None) -> int:
        """q, the multiple every unit buffer is padded to: N, so S is a multiple of os and the
        replica allreduce of an S/os slice splits evenly over its N/os members (zeropp cuts S N
        ways anyway); with any collective quantized (``quant_block`` = its block size b) N x b, so
        every chunk at every level is whole blocks and no block straddles a shard."""
        if quant_block is not None and quant_block < 1:
            raise TopologyError(f"quantization block must be >= 1, got {quant_block}")
        return self.world_size * quant_block if quant_block else self.world_size

    def padded_size(self, numel: int, quant_block: Optional[int] = None) -> int:
        """S: ``numel`` rounded up to a multiple of the padding quantum (at least one quantum)."""
        q = self.padding_quantum(quant_block)
        return max(-(-numel // q), 1) * q


def preset_factors(preset: str, topology: Topology) -> ShardFactors:
    """The (w, g, os) of a named preset on ``topology`` (shorthand for tests and tools)."""
    return ShardLayout.from_topology(topology, preset=preset).factors
