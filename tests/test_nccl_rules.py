"""The communicator's strict mode (megatron/engine/nccl_rules.py): calls NCCL/RCCL would refuse or run
differently fail on CPU before they are issued; the engine's own calls pass it (the whole suite runs
with it on: tests/conftest.py); nothing in the package calls torch's object collectives."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from dist_harness import run_ranks
from megatron.engine.nccl_rules import NCCL_DTYPES, NcclRuleError, NcclRules, strict_from_env
from megatron.topology import ProcessGroups, ShardFactors, Topology
from megatron.topology.layout import ShardLayout

REPO = Path(__file__).resolve().parents[1]


def test_strict_mode_is_on_in_the_tests():
    assert strict_from_env() and strict_from_env({"NEOX_TOPO_STRICT_COLLECTIVES": "1"})
    assert not strict_from_env({})


def test_rules_by_hand():
    meta = NcclRules(torch.device("meta"))
    meta.tensors("all_gather", torch.empty(4, device="meta"))
    with pytest.raises(NcclRuleError, match="a tensor on cpu, but the communicator's device is meta"):
        meta.tensors("all_reduce", torch.zeros(4))  # made on the host, mixed into device work
    host = NcclRules(torch.device("cpu"))
    with pytest.raises(NcclRuleError, match="NCCL has no bool: .* makes SUM a MAX"):
        host.tensors("all_reduce", torch.zeros(4, dtype=torch.bool))
    with pytest.raises(NcclRuleError, match="no such type"):
        host.tensors("all_gather", torch.zeros(4, dtype=torch.complex64))
    with pytest.raises(NcclRuleError, match="non-contiguous"):
        host.tensors("all_gather", torch.zeros(4, 4).t())
    with pytest.raises(NcclRuleError, match="equal splits"):
        host.all_to_all(torch.zeros(6), torch.zeros(6), 4)
    with pytest.raises(NcclRuleError, match="equal splits"):
        host.all_to_all(torch.zeros(8), torch.zeros(4), 4)
    host.reduce_scatter_path("all_to_all_sum")  # gloo's paths are for CPU tensors
    meta.reduce_scatter_path("nccl")
    with pytest.raises(NcclRuleError, match="gloo-only path 'ring'"):
        meta.reduce_scatter_path("ring")
    with pytest.raises(NcclRuleError, match="barrier without device_ids"):
        NcclRules(torch.device("cuda", 0)).barrier(None)
    NcclRules(torch.device("cuda", 0)).barrier([0])
    host.barrier(None)
    assert torch.bool not in NCCL_DTYPES and torch.bfloat16 in NCCL_DTYPES


def _wrong_calls(rank: int, world_size: int) -> dict:
    """Each deliberately wrong call is refused before it is issued (so both ranks refuse it and gloo
    is never left half way through a collective); a right call works afterwards."""
    from megatron.engine import Communicator
    topology = Topology.simulated([1, 2])
    groups = ProcessGroups.build(topology, ShardLayout.from_topology(topology, ShardFactors(2, 2, 2)))
    comm = Communicator(groups)  # strict from the environment (conftest)
    refused = {}
    calls = {
        "bool reduce": lambda: comm.all_reduce(torch.zeros(2, dtype=torch.bool), groups.world, "control"),
        "strided gather": lambda: comm.all_gather(torch.zeros(4), torch.zeros(2, 2).t()[0], groups.world, "control"),
        "host tensor on a device communicator": lambda: Communicator(groups, device="meta").all_reduce(
            torch.zeros(2), groups.world, "control"),
    }
    for name, call in calls.items():
        try:
            call()
        except NcclRuleError as err:
            refused[name] = str(err)
    total = torch.ones(2)
    comm.all_reduce(total, groups.world, "control")
    return {"refused": refused, "total": total.tolist()}


def test_wrong_calls_fail_on_gloo_before_they_are_issued(tmp_path):
    results = run_ranks("test_nccl_rules:_wrong_calls", 2, tmp_path)
    for out in results:
        assert set(out["refused"]) == {"bool reduce", "strided gather", "host tensor on a device communicator"}
        assert "makes SUM a MAX" in out["refused"]["bool reduce"]
        assert out["total"] == [2.0, 2.0]


OBJECT_COLLECTIVES = {"all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
                      "send_object_list", "recv_object_list"}


def test_nothing_calls_torch_object_collectives():
    """torch's object collectives pickle through host tensors (under NCCL: the current device,
    guessed); the package's go through Communicator.all_gather_object / broadcast_object."""
    offenders = []
    for path in sorted((REPO / "megatron").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in OBJECT_COLLECTIVES:
                if isinstance(node.value, ast.Name) and node.value.id in ("dist", "torch"):
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno} {node.attr}")
    assert not offenders, offenders
