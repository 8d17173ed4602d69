"""Are ranks 2k and 2k+1 of each node the two GCDs of one MI250X?

The engine's fastest tier (``w``, weights) assumes so, but it only holds when Slurm binds each task
to the GPU closest to its cores with block distribution (``srun --gpu-bind=closest -m block``,
one GPU per task): then local ranks 0..7 land on GCDs 4,5,2,3,6,7,0,1, pairs intact. Any other
binding (``map_gpu:``, none at all, cyclic tasks) can split the pairs so that the "intra-GPU"
traffic crosses the slower GPU-GPU links; training stays correct, only slower, so a start-up
warning (not an error) is the right response.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Mapping, Optional, TextIO

import torch
import torch.distributed as dist

KFD_NODES = "/sys/class/kfd/kfd/topology/nodes"
FIX = ("launch one GPU per task with `srun --gpus-per-task=1 --gpu-bind=closest "
       "--distribution=block` so that ranks 2k, 2k+1 share one MI250X")
# Enough to see the pattern without burying the log when every node of a large job is wrong.
MAX_NODE_LINES = 8


def _entry(value: str, position: int) -> Optional[int]:
    """Entry ``position`` of a comma list of device indices; None for UUIDs, junk or too short."""
    entries = [e.strip() for e in value.split(",")]
    if not 0 <= position < len(entries) or not entries[position].isdigit():
        return None
    return int(entries[position])


def physical_device_index(env: Mapping[str, str], current_device: int) -> Optional[int]:
    """This process's physical GPU index (its position in the KFD/ROCr enumeration).

    ROCr applies ROCR_VISIBLE_DEVICES first, then HIP selects from what is left by
    HIP_VISIBLE_DEVICES (or CUDA_VISIBLE_DEVICES, its alias), so the lists are composed in that
    order. Under Slurm only ROCR_VISIBLE_DEVICES is set, and this is just its entry
    [current_device]. None when an entry is a UUID or unparsable; current_device when none is set.
    """
    index: Optional[int] = current_device
    hip = env.get("HIP_VISIBLE_DEVICES") or env.get("CUDA_VISIBLE_DEVICES")
    if hip:
        index = _entry(hip, index)
    rocr = env.get("ROCR_VISIBLE_DEVICES")
    if rocr and index is not None:
        index = _entry(rocr, index)
    return index


def _properties(path: Path) -> dict[str, int]:
    """A KFD ``properties`` file: one ``name value`` pair per line, integer values."""
    out = {}
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("-").isdigit():
            out[parts[0]] = int(parts[1])
    return out


def package_mates_from_kfd(root: str = KFD_NODES) -> dict[int, int]:
    """{gpu_index: mate_index} from the kernel's KFD topology; {} when it cannot be read.

    GPU nodes (simd_count > 0) in node-number order are ROCr's device order, so a GPU's index is
    its position among them. Its package mate is the GPU peer behind its strictly lightest
    io_link (on MI250X the in-package XGMI link); GPUs whose lightest peer is tied or not mutual
    are left out rather than guessed.
    """
    nodes_dir = Path(root)
    try:
        node_dirs = sorted((d for d in nodes_dir.iterdir() if d.name.isdigit()),
                           key=lambda d: int(d.name))
        gpu_nodes = [int(d.name) for d in node_dirs
                     if _properties(d / "properties").get("simd_count", 0) > 0]
        gpu_index = {node: i for i, node in enumerate(gpu_nodes)}
        closest: dict[int, int] = {}
        for node in gpu_nodes:
            weights: dict[int, int] = {}  # peer GPU index -> lightest link weight to it
            for link in (nodes_dir / str(node) / "io_links").glob("*/properties"):
                props = _properties(link)
                peer = gpu_index.get(props.get("node_to", -1))
                if peer is None or peer == gpu_index[node] or "weight" not in props:
                    continue
                weights[peer] = min(props["weight"], weights.get(peer, props["weight"]))
            if not weights:
                continue
            lightest = min(weights.values())
            nearest = [peer for peer, w in weights.items() if w == lightest]
            if len(nearest) == 1:
                closest[gpu_index[node]] = nearest[0]
    except (OSError, ValueError):
        return {}  # no KFD here (CUDA, a container without /sys) or a file we cannot parse
    return {gpu: mate for gpu, mate in closest.items() if closest.get(mate) == gpu}


def frontier_mates(indices) -> dict[int, int]:
    """The documented Frontier rule, used when KFD cannot tell: GCDs 2k and 2k+1 share a package."""
    return {i: i ^ 1 for i in indices if i is not None}


def check_gcd_pairs(physical_by_rank: list[Optional[int]], ranks_per_node: int,
                    mates: Mapping[int, int]) -> list[str]:
    """Warning lines for every node whose ranks (2k, 2k+1) are not package mates; [] when fine.

    Ranks are numbered node-major (rank = node * ranks_per_node + local), as the topology
    assumes. Pairs whose devices are unknown (None, or absent from ``mates``) are summed up in one
    "could not be checked" line instead of being reported as broken.
    """
    if ranks_per_node < 2 or ranks_per_node % 2 or len(physical_by_rank) % ranks_per_node:
        raise ValueError(f"{len(physical_by_rank)} ranks do not form nodes of {ranks_per_node} "
                         "ranks in GCD pairs")
    broken_by_node: dict[int, list[str]] = {}
    unknown = 0
    for first in range(0, len(physical_by_rank), 2):
        a, b = physical_by_rank[first], physical_by_rank[first + 1]
        if a is None or b is None or a not in mates:
            unknown += 1
            continue
        if mates[a] != b:
            node = first // ranks_per_node
            broken_by_node.setdefault(node, []).append(
                f"ranks {first},{first + 1} on GPUs {a},{b}")
    lines = []
    nodes = sorted(broken_by_node)
    for node in nodes[:MAX_NODE_LINES]:
        lines.append(f"node {node}: " + "; ".join(broken_by_node[node]) +
                     " - not the two GCDs of one MI250X")
    if len(nodes) > MAX_NODE_LINES:
        lines.append(f"... and {len(nodes) - MAX_NODE_LINES} more node(s) with split GCD pairs")
    if lines:
        lines.insert(0, "the fastest tier (w = 2 GCDs) spans two packages, so its traffic takes "
                        "the slower GPU-GPU links:")
        lines.append(f"fix: {FIX}")
    if unknown:
        lines.append(f"GCD pairing of {unknown} of {len(physical_by_rank) // 2} rank pair(s) "
                     "could not be checked (device index unknown: UUIDs in *_VISIBLE_DEVICES, "
                     "or no package mate found)")
    return lines


def gcd_pair_warnings(physical_by_rank: list[Optional[int]], layout: list[int],
                      kfd_root: str = KFD_NODES) -> list[str]:
    """check_gcd_pairs for a [nodes, gpus, 2] layout, mates from KFD or else the Frontier rule."""
    mates = package_mates_from_kfd(kfd_root) or frontier_mates(physical_by_rank)
    return check_gcd_pairs(physical_by_rank, int(layout[1]) * int(layout[2]), mates)


def _two_gcd_layout(cfg) -> bool:
    layout = getattr(cfg.topology, "layout", None)
    return bool(layout) and len(layout) == 3 and int(layout[-1]) == 2


def warn_if_gcd_pairs_broken(cfg, runtime, env: Optional[Mapping[str, str]] = None,
                             kfd_root: str = KFD_NODES, stream: Optional[TextIO] = None) -> None:
    """Start-up hook: on ROCm with a 2-GCD fastest tier, rank 0 warns about split GCD pairs.

    Costs one all-gather of one int64 per rank, and nothing at all on CPU or CUDA (the checks
    below run cheapest first and return before any collective).
    """
    if not getattr(torch.version, "hip", None) or runtime.device.type != "cuda":
        return
    if not runtime.distributed or not _two_gcd_layout(cfg):
        return
    if not dist.is_initialized():
        return
    env = os.environ if env is None else env
    mine = physical_device_index(env, runtime.device.index or 0)
    # gloo gathers host tensors, NCCL/RCCL only device tensors.
    wire = torch.device("cpu") if dist.get_backend() == "gloo" else runtime.device
    # -1 stands for "unknown" on the wire; it is mapped back to None below.
    local = torch.tensor([-1 if mine is None else mine], dtype=torch.int64, device=wire)
    gathered = [torch.empty_like(local) for _ in range(runtime.world_size)]
    dist.all_gather(gathered, local)
    if not runtime.is_main:
        return
    physical = [None if int(v) < 0 else int(v) for v in torch.cat(gathered).tolist()]
    out = stream if stream is not None else sys.stderr
    for line in gcd_pair_warnings(physical, cfg.topology.layout, kfd_root):
        print(f"warning: {line}", file=out, flush=True)
