"""Global gradient-norm clipping over sharded slices, as torch's ``clip_grad_norm_`` on one process.

The norm is the square root of the sum of squares over every rank's 1/os slices, replicas counted
once: each rank puts its own sum (float64, sent as fp32) in its slot of an N-vector and one world
all-reduce (the ledger's ``control`` phase) gives every rank every slot; the sum is then taken in
the same order everywhere, so all ranks see the same norm and skip a step together. The rank's sum
stays on the device until that vector has been reduced: reading the norm back is the step's one
host sync, not one per gradient.
"""
from __future__ import annotations

import math

import torch

from megatron.engine.comm import Communicator
from megatron.topology.groups import ProcessGroups

FP32_MAX = torch.finfo(torch.float32).max


def global_grad_norm(grads: list[torch.Tensor], groups: ProcessGroups, comm: Communicator) -> float:
    """sqrt of the sum of squares of ``grads`` over every rank (the first replica's); infinite on
    every rank when any rank's own sum is beyond fp32 (torch's norm would be inf), NaN when any
    gradient holds a NaN (or an inf: inf - inf on the way)."""
    world = groups.world
    vec = torch.zeros(world.size, dtype=torch.float32, device=comm.device)
    if groups.replica.index(groups.rank) == 0 and grads:
        local = torch.stack([g.double().square().sum() for g in grads]).sum()
        vec[world.index(groups.rank)] = torch.where(local > FP32_MAX, math.inf, local)
    comm.all_reduce(vec, world, "control")
    return math.sqrt(float(vec.double().sum()))


def clip_coefficient(total_norm: float, max_norm: float) -> torch.Tensor:
    """torch's ``clip_grad_norm_`` factor, computed in fp32 as torch does: min(max/(norm+1e-6), 1)."""
    norm = torch.tensor(total_norm, dtype=torch.float32)
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


def clip_(grads: list[torch.Tensor], total_norm: float, max_norm: float) -> None:
    """Scale ``grads`` in place so their global norm is at most ``max_norm`` (0 = no clipping)."""
    if max_norm > 0:
        coef = clip_coefficient(total_norm, max_norm)
        for g in grads:
            g.mul_(coef)
