"""Topology (tiers, rank coordinates), the shard layout (factors, chunks, group ranks, padding) and
the process groups the engine communicates in."""
from megatron.topology.groups import ProcessGroups, RankGroup
from megatron.topology.layout import (
    CUSTOM,
    GROUP_KINDS,
    PRESETS,
    STAGE_PRESETS,
    ShardChunks,
    ShardFactors,
    ShardLayout,
    chunk_range,
    group_ranks,
    preset_factors,
    validate_factors,
)
from megatron.topology.topology import TIER_NAMES, RankCoords, Tier, Topology, TopologyError

__all__ = [
    "CUSTOM", "GROUP_KINDS", "PRESETS", "STAGE_PRESETS", "ProcessGroups", "RankGroup", "ShardChunks",
    "ShardFactors", "ShardLayout", "chunk_range", "group_ranks", "preset_factors", "validate_factors",
    "TIER_NAMES", "RankCoords", "Tier", "Topology", "TopologyError",
]
