"""The process groups of one rank, built once from the run's shard layout (megatron/topology/layout.py
says which ranks each group holds; this module only creates the torch groups).

``ProcessGroups`` is created once per run and passed explicitly; there are no module-level groups.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional

from megatron.topology.layout import ShardFactors, ShardLayout, tiers_of
from megatron.topology.names import GROUP_KINDS
from megatron.topology.errors import TopologyError
from megatron.topology.topology import Topology


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
    """The weight, stride, cross, replica, node, rail and world groups of this rank, on ``layout``.

    Every rank calls ``dist.new_group`` for every distinct multi-rank group, in the same order
    (all groups of each kind, kinds in ``GROUP_KINDS`` order), and keeps the ones it belongs to.
    With ``create=False`` (or one rank) no torch group is made: the rank lists alone, for planning.
    """

    def __init__(self, topology: Topology, layout: ShardLayout, rank: int, *, create: bool = True,
                 timeout_s: Optional[float] = None):
        if tiers_of(topology) != layout.tiers:
            raise TopologyError(f"topology {topology.name} has tiers {list(tiers_of(topology))} (slowest first) but "
                                f"the shard layout is on {list(layout.tiers)}")
        n = topology.world_size
        if not 0 <= rank < n:
            raise TopologyError(f"rank {rank} is outside a world of {n}")
        self.topology, self.layout, self.rank, self.world_size = topology, layout, rank, n
        handles = self._create_all(timeout_s) if create and n > 1 else {}
        for kind in GROUP_KINDS:
            setattr(self, kind, RankGroup(kind, layout.group(kind, rank), handles.get(layout.group(kind, rank))))
        self.weight: RankGroup
        self.stride: RankGroup
        self.cross: RankGroup
        self.replica: RankGroup
        self.node: RankGroup
        self.rail: RankGroup
        self.world: RankGroup

    @property
    def factors(self) -> ShardFactors:
        return self.layout.factors

    @classmethod
    def build(cls, topology: Topology, layout: ShardLayout, timeout_s: Optional[float] = None) -> "ProcessGroups":
        """Groups for the current process of an initialised default process group (or one process)."""
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            if dist.get_world_size() != topology.world_size:
                raise TopologyError(f"topology {topology.name} has {topology.world_size} ranks but "
                                    f"the process group has {dist.get_world_size()}")
            return cls(topology, layout, dist.get_rank(), timeout_s=timeout_s)
        if topology.world_size != 1:
            raise TopologyError(f"topology {topology.name} has {topology.world_size} ranks but torch.distributed is not initialised")
        return cls(topology, layout, 0)

    def _create_all(self, timeout_s: Optional[float]) -> dict:
        import torch.distributed as dist
        n = self.world_size
        handles: dict[tuple[int, ...], Any] = {tuple(range(n)): dist.group.WORLD}
        timeout = timedelta(seconds=timeout_s) if timeout_s else None
        for kind in GROUP_KINDS[:-1]:
            for member in range(n):
                ranks = self.layout.group(kind, member)
                if len(ranks) == 1 or ranks in handles:
                    continue
                group = dist.new_group(list(ranks), timeout=timeout)
                handles[ranks] = group if self.rank in ranks else None
        return handles

    def sizes(self) -> dict[str, int]:
        return {kind: getattr(self, kind).size for kind in GROUP_KINDS}
