"""What a Slurm allocation provides, read from the variables sbatch/salloc set in the job's shell.

Inside a job the node and task counts come from the allocation, never from the GPUs of the machine
running deepy.py (a batch node sees its own devices; a login node none): GPT-NeoX's habit of
counting local GPUs gives the wrong world size on every node but one.

    SLURM_JOB_ID            set in every allocation (sbatch, salloc, srun): "we are inside a job"
    SLURM_JOB_NUM_NODES     nodes of the allocation (older Slurm: SLURM_NNODES)
    SLURM_NTASKS_PER_NODE   only with --ntasks-per-node; "8" or, per node, "8(x48)"
    SLURM_GPUS_ON_NODE      GPUs allocated on this node (with --gpus*, or whole-node GPU partitions)
    SLURM_JOB_GPUS          the indices of the job's GPUs on this node, "0,1,2,3" (read when the count is absent)
    SLURM_GPUS_PER_NODE     what --gpus-per-node asked: "8", "a100:8"; "0" from `sbatch --gpus-per-node=0`
    SLURM_JOB_NODELIST      compressed host list, expanded by `scontrol show hostnames`
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

from megatron.topology.errors import TopologyError

NODE_VARS = ("SLURM_JOB_NUM_NODES", "SLURM_NNODES")
_TASKS_PER_NODE = re.compile(r"^(\d+)(\(x\d+\))?$")


def parse_tasks_per_node(text: str, var: str = "SLURM_NTASKS_PER_NODE") -> int:
    """'8' or '8(x48)' -> 8. A heterogeneous list ('8,4' or '8(x2),4') is refused: every node of a
    layout holds the same number of ranks."""
    match = _TASKS_PER_NODE.match(text.strip())
    if not match:
        raise TopologyError(f"{var}={text!r}: every node must run the same number of tasks")
    return int(match.group(1))


def _positive(env: Mapping[str, str], var: str, minimum: int = 1) -> Optional[int]:
    raw = env.get(var)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise TopologyError(f"environment variable {var}={raw!r} is not a count") from None
    if value < minimum:
        raise TopologyError(f"environment variable {var}={raw!r} must be at least {minimum}")
    return value


def _gpus_on_node(env: Mapping[str, str]) -> Optional[int]:
    """The GPUs the allocation gives each node, 0 when it says none, None when it does not say: a
    CPU-only cluster (no GPU GRES) sets none of these variables."""
    count = _positive(env, "SLURM_GPUS_ON_NODE", minimum=0)
    if count is not None:
        return count
    indices = env.get("SLURM_JOB_GPUS", "").strip()
    if indices:
        return len([i for i in indices.split(",") if i.strip()])
    asked = env.get("SLURM_GPUS_PER_NODE", "").strip()
    last = asked.rsplit(":", 1)[-1]  # "8", "a100:8"; a list of types is left unread
    return int(last) if last.isdigit() else None


@dataclass(frozen=True)
class SlurmAllocation:
    """The counts of the allocation this process runs in; None where the allocation does not say."""
    job_id: str
    nodes: Optional[int]
    tasks_per_node: Optional[int]
    gpus_per_node: Optional[int]  # 0: the job asked for none (`sbatch --gpus-per-node=0`)
    nodelist: Optional[str]

    def ranks_per_node(self, uses_gpus: bool) -> Optional[int]:
        """The ranks one node can hold: the tasks per node when the job fixed them, else (for a GPU
        run, one rank per GPU) the GPUs allocated on the node, else unknown."""
        if self.tasks_per_node is not None:
            return self.tasks_per_node
        return (self.gpus_per_node or None) if uses_gpus else None

    def describe(self, uses_gpus: bool) -> str:
        """'2 nodes x 8 tasks per node (SLURM_JOB_NUM_NODES=2, SLURM_NTASKS_PER_NODE=8)'."""
        said = []
        if self.nodes is not None:
            said.append(f"SLURM_JOB_NUM_NODES={self.nodes}")
        if self.tasks_per_node is not None:
            said.append(f"SLURM_NTASKS_PER_NODE={self.tasks_per_node}")
        elif uses_gpus and self.gpus_per_node:
            said.append(f"SLURM_GPUS_ON_NODE={self.gpus_per_node}")
        per_node = self.ranks_per_node(uses_gpus)
        nodes = "? nodes" if self.nodes is None else f"{self.nodes} node{'s' if self.nodes != 1 else ''}"
        shape = nodes + ("" if per_node is None else f" x {per_node} ranks per node")
        return f"{shape} ({', '.join(said) or 'no counts in the environment'})"


def allocation_from_env(env: Mapping[str, str]) -> Optional[SlurmAllocation]:
    """The allocation this process runs in, or None outside Slurm (no SLURM_JOB_ID)."""
    job_id = env.get("SLURM_JOB_ID")
    if not job_id:
        return None
    nodes = None
    for var in NODE_VARS:
        nodes = _positive(env, var)
        if nodes is not None:
            break
    raw_tasks = env.get("SLURM_NTASKS_PER_NODE")
    tasks = parse_tasks_per_node(raw_tasks) if raw_tasks and raw_tasks.strip() else None
    return SlurmAllocation(job_id=job_id, nodes=nodes, tasks_per_node=tasks,
                           gpus_per_node=_gpus_on_node(env),
                           nodelist=env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST"))


GPU_PRESETS = ("frontier", "dgx")  # topology presets of GPU machines


def run_uses_gpus(device: str, preset: Optional[str], alloc: Optional[SlurmAllocation],
                  visible_gpus: Callable[[], int]) -> bool:
    """Whether the run puts one rank on each GPU (and srun binds them): `device: cpu`/`cuda` say so;
    `auto` asks the allocation first (GPUs given, or explicitly none), then the preset (Frontier and
    DGX nodes are GPU nodes), then the GPUs this process sees (``visible_gpus()``). Without the
    allocation's word a CPU-only Slurm got `--gpus-per-task=1`, which it refuses."""
    if device != "auto":
        return device == "cuda"
    if alloc is not None and alloc.gpus_per_node is not None:
        return alloc.gpus_per_node > 0
    if preset in GPU_PRESETS:
        return True
    return visible_gpus() > 0


def visible_gpu_count() -> int:
    """The GPUs torch sees here (0 without a GPU build); torch is imported only when asked."""
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def layout_mismatch(layout: Optional[list], alloc: SlurmAllocation, uses_gpus: bool) -> Optional[str]:
    """None when `layout` (ranks per tier, slowest first) fits the allocation exactly; else what
    differs. Exactly, not 'at most': a layout smaller than its allocation leaves nodes or GPUs idle
    for the whole job, which is a mistake more often than a choice."""
    nodes = layout[0] if layout else 1
    per_node = 1
    for size in (layout or [1])[1:]:
        per_node *= size
    if alloc.nodes is not None and alloc.nodes != nodes:
        return f"{nodes} node{'s' if nodes != 1 else ''}"
    have = alloc.ranks_per_node(uses_gpus)
    if have is not None and have != per_node:
        return f"{per_node} ranks per node"
    return None
