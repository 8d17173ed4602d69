"""Where ranks sit: tiers of links from fastest to slowest, and the coordinates of every rank.

Ranks are numbered so that neighbours are closest: ``rank = node * R + local`` with R ranks per
node, and on a three-tier layout ``local = gpu * gcds + gcd``. The tier between two ranks is the
slowest band in which their coordinates differ. Bandwidths and latencies are per-link figures the
comm model and the planner read; nothing in the engine depends on them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from megatron.topology.allocation import parse_tasks_per_node
from megatron.topology.errors import TopologyError
from megatron.topology.names import TIERS


@dataclass(frozen=True)
class Tier:
    """One band of the layout.

    ``size`` is how many members of the next faster band (or ranks) one member of this band holds:
    GCDs per GPU, GPUs per node, nodes. ``bandwidth_gbs`` is one link's bandwidth in GB/s (one
    direction), ``links`` how many such links a member has towards the others (Frontier: 4 NICs).
    """
    name: str
    size: int
    bandwidth_gbs: float
    latency_us: float
    links: int = 1


@dataclass(frozen=True)
class RankCoords:
    node: int
    gpu: int
    gcd: int


# Per-link figures by tier name (public vendor numbers: OLCF's Frontier node diagram, Slingshot-11's
# 25 GB/s per NIC). Simulated layouts use the
# Frontier figures so the planner and the comm model give Frontier-like times on a laptop.
FRONTIER_LINKS = {
    "intra_gpu": dict(bandwidth_gbs=200.0, latency_us=1.0),   # the two GCDs of one MI250X package
    "intra_node": dict(bandwidth_gbs=50.0, latency_us=2.0),   # GPU-GPU Infinity Fabric (50-100 GB/s)
    "inter_node": dict(bandwidth_gbs=25.0, latency_us=5.0, links=4),  # 4 x Slingshot-11 per node
}
DGX_LINKS = {
    "intra_node": dict(bandwidth_gbs=300.0, latency_us=2.0),  # NVLink/NVSwitch, per direction
    "inter_node": dict(bandwidth_gbs=25.0, latency_us=5.0, links=8),  # 8 x 200 Gb/s InfiniBand
}


@dataclass(frozen=True)
class Topology:
    """Tiers fastest first. Two tiers: (intra_node, inter_node); three: (intra_gpu, intra_node, inter_node)."""
    tiers: tuple[Tier, ...]
    name: str = "custom"

    def __post_init__(self) -> None:
        names = tuple(t.name for t in self.tiers)
        if names not in (TIERS, TIERS[1:]):
            raise TopologyError(f"topology tiers must be {TIERS} or {TIERS[1:]} (fastest first), got {names}")
        for tier in self.tiers:
            if tier.size < 1:
                raise TopologyError(f"topology tier {tier.name} must have size >= 1, got {tier.size}")

    # -- constructors -------------------------------------------------------------------------------
    @classmethod
    def simulated(cls, layout: Sequence[int]) -> "Topology":
        """``[nodes, gpus, gcds]`` or ``[nodes, gpus]`` (slowest first), with Frontier's link figures."""
        layout = [int(x) for x in layout]
        if len(layout) not in (2, 3) or min(layout) < 1:
            raise TopologyError(f"topology.simulate must be [nodes, gpus] or [nodes, gpus, gcds] of positive ints, got {layout}")
        names = TIERS[3 - len(layout):]
        tiers = tuple(Tier(name, size, **FRONTIER_LINKS[name]) for name, size in zip(names, reversed(layout)))
        return cls(tiers, name="sim" + "x".join(map(str, layout)))

    @classmethod
    def preset(cls, name: str, num_nodes: int) -> "Topology":
        """``frontier`` (4 MI250X x 2 GCDs per node) or ``dgx`` (8 GPUs per node) over ``num_nodes``."""
        if num_nodes < 1:
            raise TopologyError(f"topology preset {name!r} needs num_nodes >= 1, got {num_nodes}")
        if name == "frontier":
            sizes = {"intra_gpu": 2, "intra_node": 4, "inter_node": num_nodes}
            links = FRONTIER_LINKS
        elif name == "dgx":
            sizes = {"intra_node": 8, "inter_node": num_nodes}
            links = DGX_LINKS
        else:
            raise TopologyError(f"unknown topology preset {name!r}; choose frontier, dgx or sim")
        return cls(tuple(Tier(t, sizes[t], **links[t]) for t in sizes), name=name)

    @classmethod
    def single_node(cls, ranks: int) -> "Topology":
        """One node holding ``ranks`` ranks (the default when no topology is configured)."""
        return cls((Tier("intra_node", ranks, **FRONTIER_LINKS["intra_node"]),
                    Tier("inter_node", 1, **FRONTIER_LINKS["inter_node"])), name="single_node")

    @classmethod
    def from_slurm(cls, env: Mapping[str, str], preset: Optional[str] = None) -> "Topology":
        """The layout of a Slurm job step: nodes x tasks per node (block distribution required).

        With ``preset="frontier"`` and 8 tasks per node the three-tier Frontier layout is used.
        """
        try:
            nnodes = int(env["SLURM_NNODES"])
            procid, localid = int(env["SLURM_PROCID"]), int(env["SLURM_LOCALID"])
        except KeyError as missing:
            raise TopologyError(f"Slurm environment lacks {missing.args[0]}: run under srun") from None
        if "SLURM_NTASKS_PER_NODE" in env:
            per_node = parse_tasks_per_node(env["SLURM_NTASKS_PER_NODE"])
        elif "SLURM_NTASKS" in env:
            ntasks = int(env["SLURM_NTASKS"])
            if ntasks % nnodes:
                raise TopologyError(f"SLURM_NTASKS={ntasks} is not a multiple of SLURM_NNODES={nnodes}")
            per_node = ntasks // nnodes
        else:
            raise TopologyError("Slurm environment lacks SLURM_NTASKS_PER_NODE and SLURM_NTASKS")
        if localid != procid % per_node:
            raise TopologyError(f"rank {procid} has local id {localid}, expected {procid % per_node}: "
                                "use block task distribution (srun -m block) so neighbours are close")
        if preset == "frontier" and per_node == 8:
            return cls.preset("frontier", nnodes)
        if preset == "dgx" and per_node == 8:
            return cls.preset("dgx", nnodes)
        links = DGX_LINKS if preset == "dgx" else FRONTIER_LINKS
        return cls((Tier("intra_node", per_node, **links["intra_node"]),
                    Tier("inter_node", nnodes, **links["inter_node"])), name=f"slurm{nnodes}x{per_node}")

    @classmethod
    def from_config(cls, cfg, world_size: int) -> "Topology":
        """From ``cfg.topology`` for a run of ``world_size`` ranks: ``simulate`` (takes precedence, with
        Frontier link figures), else ``preset`` frontier/dgx (8 ranks per node), else the two-tier
        layout validation took from a Slurm allocation, else one node."""
        topo_cfg = cfg.topology
        if topo_cfg.simulate:
            topo = cls.simulated(topo_cfg.simulate)
        elif topo_cfg.preset in ("frontier", "dgx"):
            per_node = 8
            if world_size % per_node:
                raise TopologyError(f"topology preset {topo_cfg.preset} needs a multiple of {per_node} ranks, got {world_size}")
            topo = cls.preset(topo_cfg.preset, world_size // per_node)
        elif topo_cfg.preset in (None, "none", "sim"):
            if topo_cfg.preset == "sim":
                raise TopologyError("topology.preset 'sim' needs topology.simulate, e.g. [2, 2, 2]")
            if topo_cfg.layout and len(topo_cfg.layout) == 2:  # nodes x ranks per node of a Slurm allocation
                nodes, per_node = (int(x) for x in topo_cfg.layout)
                topo = cls((Tier("intra_node", per_node, **FRONTIER_LINKS["intra_node"]),
                            Tier("inter_node", nodes, **FRONTIER_LINKS["inter_node"])), name=f"slurm{nodes}x{per_node}")
            else:
                topo = cls.single_node(world_size)
        else:
            raise TopologyError(f"unknown topology.preset {topo_cfg.preset!r}; choose frontier, dgx or sim")
        if topo.world_size != world_size:
            raise TopologyError(f"topology {topo.name} has {topo.world_size} ranks but the run has {world_size}")
        return topo

    # -- queries ------------------------------------------------------------------------------------
    def tier(self, name: str) -> Tier:
        for tier in self.tiers:
            if tier.name == name:
                return tier
        raise TopologyError(f"topology {self.name} has no tier {name!r}")

    @property
    def num_tiers(self) -> int:
        return len(self.tiers)

    @property
    def gcds_per_gpu(self) -> int:
        return self.tiers[0].size if self.num_tiers == 3 else 1

    @property
    def gpus_per_node(self) -> int:
        return self.tier("intra_node").size

    @property
    def ranks_per_node(self) -> int:
        return self.gpus_per_node * self.gcds_per_gpu

    @property
    def num_nodes(self) -> int:
        return self.tier("inter_node").size

    @property
    def world_size(self) -> int:
        return math.prod(t.size for t in self.tiers)

    @property
    def fastest_tier_size(self) -> int:
        """Ranks sharing the fastest link: the GCD pair on Frontier, the node on a two-tier layout."""
        return self.tiers[0].size

    def _check(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise TopologyError(f"rank {rank} is outside topology {self.name} of {self.world_size} ranks")

    def coordinates(self, rank: int) -> RankCoords:
        self._check(rank)
        node, local = divmod(rank, self.ranks_per_node)
        gpu, gcd = divmod(local, self.gcds_per_gpu)
        return RankCoords(node, gpu, gcd)

    def node_of(self, rank: int) -> int:
        return self.coordinates(rank).node

    def tiers_among(self, ranks: Sequence[int]) -> frozenset[str]:
        """The tiers the messages between any two of ``ranks`` travel, in O(len(ranks)) (a world group
        of 384 ranks has 73,000 pairs): across nodes when the ranks sit on more than one node; inside
        a node between two ranks of one node on different GPUs; inside a GPU between two of one GPU."""
        coords = [self.coordinates(r) for r in ranks]
        nodes = {c.node for c in coords}
        gpus = {(c.node, c.gpu) for c in coords}
        tiers = set()
        if len(nodes) > 1:
            tiers.add("inter_node")
        if len(gpus) < len(coords):  # two ranks share a GPU (three tiers only: else gpu is the local rank)
            tiers.add("intra_gpu")
        if len(gpus) - len(nodes) > 0:  # some node holds ranks of two GPUs
            tiers.add("intra_node")
        return frozenset(tiers)

    def tier_between(self, a: int, b: int) -> str:
        """The tier a message from rank a to rank b travels: the slowest band where they differ."""
        if a == b:
            raise TopologyError(f"tier_between({a}, {b}): a rank does not send to itself")
        ca, cb = self.coordinates(a), self.coordinates(b)
        if ca.node != cb.node:
            return "inter_node"
        if ca.gpu != cb.gpu or self.num_tiers == 2:
            return "intra_node"
        return "intra_gpu"
