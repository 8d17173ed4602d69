"""Topology (tiers, rank coordinates) and the process groups the engine communicates in."""
from megatron.topology.groups import (
    GROUP_KINDS,
    PRESETS,
    ProcessGroups,
    RankGroup,
    ShardChunks,
    ShardFactors,
    chunk_range,
    chunks_of,
    group_ranks,
    preset_factors,
    resolve_factors,
    shard_map,
    validate_factors,
)
from megatron.topology.topology import TIER_NAMES, RankCoords, Tier, Topology, TopologyError

__all__ = [
    "GROUP_KINDS", "PRESETS", "ProcessGroups", "RankGroup", "ShardChunks", "ShardFactors", "chunk_range",
    "chunks_of", "group_ranks", "preset_factors", "resolve_factors", "shard_map", "validate_factors",
    "TIER_NAMES", "RankCoords", "Tier", "Topology", "TopologyError",
]
