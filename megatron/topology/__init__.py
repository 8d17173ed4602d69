"""Topology (tiers, rank coordinates), the shard layout (factors, chunks, group ranks, padding), the
process groups the engine communicates in, the names the engine and the analytic models share
(names.py) and the collective algorithm per group (algorithms.py)."""
from megatron.topology.groups import ProcessGroups, RankGroup
from megatron.topology.layout import (
    CUSTOM,
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
from megatron.topology.errors import TopologyError
from megatron.topology.topology import RankCoords, Tier, Topology

__all__ = [
    "CUSTOM", "PRESETS", "STAGE_PRESETS", "ProcessGroups", "RankGroup", "ShardChunks",
    "ShardFactors", "ShardLayout", "chunk_range", "group_ranks", "preset_factors", "validate_factors",
    "RankCoords", "Tier", "Topology", "TopologyError",
]
