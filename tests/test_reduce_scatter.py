"""The Communicator's own reduce-scatter on gloo (megatron/engine/comm.py): the sum against one
computed here in float64 from every rank's input, for every kind of group of a 2 x 2 x 2 cluster —
one-tier groups (a GCD pair, a stride group, the cross-node group: all-to-all + local sum) and groups spanning
tiers (a node, the world: the ring) — in fp32 and bf16, started asynchronously with other
collectives in flight, and charged as the ring (per tier) in the ledger.
"""
from __future__ import annotations

import torch

from dist_harness import run_ranks
from megatron.topology.layout import ShardLayout
from megatron.topology import ProcessGroups, ShardFactors, Topology
from megatron.engine import Communicator

LAYOUT = (2, 2, 2)
FACTORS = (2, 4, 8)  # weight = a GCD pair, stride = the pairs of a node, cross = one per node
CHUNK = 37  # odd, so a chunk is not a multiple of any vector width
KINDS = ("weight", "stride", "cross", "node", "world")


def _input(rank: int, k: int, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * salt + rank)
    return torch.randn(k * CHUNK, generator=g, dtype=torch.float64) * (1 + rank)


def _worker(rank: int, world_size: int) -> dict:
    groups = ProcessGroups.build(Topology.simulated(list(LAYOUT)), ShardLayout.from_topology(Topology.simulated(list(LAYOUT)), ShardFactors(*FACTORS)))
    comm = Communicator(groups)
    out = {"one_tier": {}, "kinds": {}}
    results = {}
    for salt, name in enumerate(KINDS):
        group = getattr(groups, name)
        out["one_tier"][name] = comm.one_tier(group)
        out["kinds"][name] = group.ranks
        for dtype in (torch.float32, torch.bfloat16):
            inp = _input(rank, group.size, salt).to(dtype)
            got = torch.empty(CHUNK, dtype=dtype)
            # A gather on the same group in flight around it: the two must not mix.
            gathered = torch.empty(group.size * 3)
            _c, gather = comm.start_all_gather(gathered, torch.full((3,), float(rank)), group, "fwd_gather")
            _c, pending = comm.start_reduce_scatter(got, inp, group, "grad_reduce")
            pending.wait()
            gather.wait()
            results[name, str(dtype)] = (got.double(), gathered.clone())
    out["results"] = results
    return out


def test_reduce_scatter_sums_every_group_kind_on_gloo(tmp_path):
    per_rank = run_ranks("test_reduce_scatter:_worker", 8, tmp_path)
    first = per_rank[0]
    # A GCD pair, the stride group (one GCD per GPU) and the cross-node group talk over one tier; a
    # node (intra-GPU and intra-node pairs) and the world (all three tiers) do not.
    assert first["one_tier"] == {"weight": True, "stride": True, "cross": True, "node": False, "world": False}
    for rank, out in enumerate(per_rank):
        for salt, name in enumerate(KINDS):
            members = out["kinds"][name]
            k, me = len(members), members.index(rank)
            for dtype in (torch.float32, torch.bfloat16):
                inputs = [_input(r, k, salt).to(dtype).double() for r in members]
                want = torch.stack(inputs).sum(0)[me * CHUNK:(me + 1) * CHUNK]
                got, gathered = out["results"][name, str(dtype)]
                tol = 1e-5 if dtype is torch.float32 else 0.02 * k
                assert torch.allclose(got, want, rtol=tol, atol=tol * want.abs().max().item()), (rank, name, dtype)
                assert gathered.tolist() == [float(r) for r in members for _ in range(3)]


def test_ring_and_exchange_are_charged_as_the_ring_per_tier():
    """The ledger's rule is the ring's (test_ledger.py); the exchange path must charge the same per
    tier on a one-tier group, and the ring path the ring itself."""
    groups = ProcessGroups(Topology.simulated(list(LAYOUT)), ShardLayout.from_topology(Topology.simulated(list(LAYOUT)), ShardFactors(*FACTORS)), 0, create=False)
    comm = Communicator(groups)
    for group in (groups.weight, groups.stride, groups.cross):
        assert comm.one_tier(group)
        nbytes = 4 * CHUNK * group.size
        assert comm.charge("all_to_all", nbytes, group, "grad_reduce") == \
            comm.charge("reduce_scatter", nbytes, group, "grad_reduce")
