"""Which algorithm runs a collective on the wire: the one choice the engine's ``Communicator``
(megatron/engine/comm.py) makes and the step-time model (time_model.py) predicts.

It imports neither: both call ``collective_algorithm`` with what decides it, the backend and whether
every pair of the group's members talks over one tier.

- all-gather and all-reduce: the backend's ring (NCCL/RCCL and gloo both).
- all-to-all: k - 1 messages per rank.
- reduce-scatter: NCCL/RCCL's own ring. On gloo (CPU tensors) ours, since gloo's reduce-scatter
  all-reduces the whole buffer and keeps a slice (docs/engine.md, "Bytes charged"): inside one tier an all-to-all and a
  local fp32 sum (the ring's bytes per tier, one asynchronous collective); across tiers a ring of
  k - 1 send/receive steps that finishes before the call returns (only its two node-boundary hops
  cross nodes).
"""
from __future__ import annotations

from megatron.topology.names import ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, REDUCE_SCATTER

# Algorithms (what runs on the wire), and what the figures fall back to when one was not measured.
RING_ALLGATHER, RING_REDUCE_SCATTER, RING_ALLREDUCE = "ring_allgather", "ring_reduce_scatter", "ring_allreduce"
PAIRWISE_ALL_TO_ALL, ALL_TO_ALL_SUM = "all_to_all", "all_to_all_sum"
ALGORITHMS = (RING_ALLGATHER, RING_REDUCE_SCATTER, RING_ALLREDUCE, PAIRWISE_ALL_TO_ALL, ALL_TO_ALL_SUM)
FALLBACK = {RING_REDUCE_SCATTER: RING_ALLGATHER, RING_ALLREDUCE: RING_ALLGATHER, ALL_TO_ALL_SUM: PAIRWISE_ALL_TO_ALL}
BACKENDS = ("nccl", "gloo")
# The collectives whose algorithm is chosen here (megatron.topology.names).
OPS = (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE, ALL_TO_ALL)


class AlgorithmError(ValueError):
    """An op or backend this module does not know."""


def collective_algorithm(op: str, backend: str, one_tier: bool) -> str:
    """The algorithm ``op`` runs on ``backend`` in a group whose members all talk over one tier
    (``one_tier``) or not."""
    if backend not in BACKENDS:
        raise AlgorithmError(f"backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    if op == ALL_GATHER:
        return RING_ALLGATHER
    if op == ALL_REDUCE:
        return RING_ALLREDUCE
    if op == ALL_TO_ALL:
        return PAIRWISE_ALL_TO_ALL
    if op == REDUCE_SCATTER:
        return ALL_TO_ALL_SUM if backend == "gloo" and one_tier else RING_REDUCE_SCATTER
    raise AlgorithmError(f"unknown collective op {op!r}")


def backend_of_device(device_type: str) -> str:
    """The backend that moves tensors of a device type: gloo for CPU tensors, else NCCL/RCCL."""
    return "gloo" if device_type == "cpu" else "nccl"
