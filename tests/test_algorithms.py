"""The engine's Communicator and the step-time model choose the same algorithm for every group kind
(megatron/topology/algorithms.py is the one choice; here the Communicator's real dispatch is
observed, by recording which torch.distributed call each collective makes)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron.topology.layout import ShardLayout
from megatron.topology import ProcessGroups, ShardFactors, Topology
from megatron.topology import compat
from megatron.topology.algorithms import (ALL_TO_ALL_SUM, PAIRWISE_ALL_TO_ALL, RING_ALLGATHER, RING_ALLREDUCE,
                                           RING_REDUCE_SCATTER, AlgorithmError, collective_algorithm)
from megatron.engine.comm import Communicator
from megatron.analytic.time_model import algorithm_of


class _Done:
    def wait(self):
        return None


@pytest.fixture
def recorded(monkeypatch):
    """Every torch.distributed entry point the Communicator can use, replaced by a recorder."""
    calls = []

    def record(name):
        def fn(*args, **kwargs):
            calls.append(name)
            return _Done()
        return fn
    monkeypatch.setattr(compat, "reduce_scatter_tensor", record("native_reduce_scatter"))
    monkeypatch.setattr(compat, "all_gather_tensor", record("native_all_gather"))
    monkeypatch.setattr(dist, "all_to_all_single", record("all_to_all_single"))
    monkeypatch.setattr(dist, "all_reduce", record("all_reduce"))
    monkeypatch.setattr(dist, "isend", record("isend"))
    monkeypatch.setattr(dist, "irecv", record("irecv"))
    return calls


# What the recorded calls mean: the algorithm the Communicator ran.
def _algorithm(op: str, calls: list) -> str:
    if op == "reduce_scatter":
        if calls == ["native_reduce_scatter"]:
            return RING_REDUCE_SCATTER
        if calls == ["all_to_all_single"]:
            return ALL_TO_ALL_SUM
        assert set(calls) == {"isend", "irecv"}, calls  # ours: k - 1 send/receive steps
        return RING_REDUCE_SCATTER
    return {"all_gather": {("native_all_gather",): RING_ALLGATHER}, "all_reduce": {("all_reduce",): RING_ALLREDUCE},
            "all_to_all": {("all_to_all_single",): PAIRWISE_ALL_TO_ALL}}[op][tuple(calls)]


def _run(comm: Communicator, op: str, group, device: str) -> None:
    k, n = group.size, 4 * group.size
    full, part = torch.zeros(n, device=device), torch.zeros(n // k, device=device)
    if op == "all_gather":
        comm.all_gather(full, part, group, "control")
    elif op == "reduce_scatter":
        comm.reduce_scatter(part, full, group, "control")
    elif op == "all_reduce":
        comm.all_reduce(full, group, "control")
    else:
        comm.all_to_all(torch.zeros_like(full), full, group, "control")


LAYOUTS = [((2, 2, 2), (2, 4, 8)), ((2, 2, 2), (8, 8, 8)), ((2, 4), (2, 4, 8)), ((4, 2, 2), (2, 4, 8)),
           ((2, 2, 2), (1, 2, 4)), ((2, 2, 2), (4, 8, 8))]


@pytest.mark.parametrize("layout,factors", LAYOUTS)
@pytest.mark.parametrize("device,backend", [("cpu", "gloo"), ("meta", "nccl")])
def test_the_engine_and_the_time_model_choose_the_same_algorithm(recorded, layout, factors, device, backend):
    topology = Topology.simulated(layout)
    seen = set()
    for rank in range(topology.world_size):
        groups = ProcessGroups(topology, ShardLayout.from_topology(topology, ShardFactors(*factors)), rank, create=False)
        comm = Communicator(groups, device=device)  # its device (no process group here) names the backend
        for kind in ("weight", "stride", "cross", "replica", "node", "rail", "world"):
            group = getattr(groups, kind)
            if group.size == 1:
                continue
            for op in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all"):
                recorded.clear()
                _run(comm, op, group, device)
                ran = _algorithm(op, list(recorded))
                assert ran == algorithm_of(op, list(group.ranks), layout, backend), (kind, op, group.ranks)
                seen.add((op, ran))
    # the layouts above make gloo take all three of its reduce-scatter paths between them
    if backend == "gloo" and layout == (2, 2, 2) and factors == (8, 8, 8):
        assert ("reduce_scatter", RING_REDUCE_SCATTER) in seen  # a world group spans tiers: our ring
    if backend == "gloo" and factors == (2, 4, 8):
        assert ("reduce_scatter", ALL_TO_ALL_SUM) in seen


def test_an_unknown_op_or_backend_is_refused():
    with pytest.raises(AlgorithmError, match="unknown collective op"):
        collective_algorithm("broadcast", "nccl", True)
    with pytest.raises(AlgorithmError, match="backend must be one of"):
        collective_algorithm("all_gather", "mpi", True)
