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


# -- NCCL's arithmetic on CPU ---------------------------------------------------------------------

RING_K, RING_CHUNK = 4, 257


def _ring_worker(rank: int, world_size: int) -> dict:
    """One node of 4: the node group's reduce-scatter in bf16, by gloo's path (all-to-all, one fp32
    sum) and by NCCL's (the ring, ``ring_reduce_scatter``), on the same inputs."""
    topology = Topology.simulated([1, RING_K])
    groups = ProcessGroups.build(topology, ShardLayout.from_topology(topology, ShardFactors(RING_K, RING_K, RING_K)))
    gen = torch.Generator().manual_seed(31 + rank)
    size = RING_K * RING_CHUNK
    x = (torch.randn(size, generator=gen) * torch.logspace(-2, 3, size)[torch.randperm(size, generator=gen)])
    x = x.to(torch.bfloat16)
    out = {"input": x.clone()}
    for name, ring in (("exchange", False), ("ring", True)):
        comm = Communicator(groups, ring_reduce_scatter=ring)
        got = torch.empty(RING_CHUNK, dtype=torch.bfloat16)
        comm.reduce_scatter(got, x, groups.node, "grad_reduce")
        out[name] = got
    return out


def test_the_ring_rounds_at_every_hop_as_nccl_does(tmp_path):
    """With ``ring_reduce_scatter`` the CPU runs NCCL's arithmetic: member c's chunk is summed around
    the ring from member c+1 to member c, each partial sum rounded to bf16; against that order worked
    out here, bit for bit. gloo's own path (an all-to-all, one fp32 sum, one rounding) is closer to the
    exact sum: CPU results are at least as accurate as a GPU run's (docs/numerics.md)."""
    per_rank = run_ranks("test_reduce_scatter:_ring_worker", RING_K, tmp_path)
    inputs = [r["input"].view(RING_K, RING_CHUNK) for r in per_rank]
    ring_error = exchange_error = 0.0
    for c, result in enumerate(per_rank):
        acc = inputs[(c + 1) % RING_K][c]
        for j in range(2, RING_K + 1):  # members c+2, ..., c+k-1, then c itself
            acc = (acc.float() + inputs[(c + j) % RING_K][c].float()).to(torch.bfloat16)
        assert torch.equal(result["ring"], acc), c
        exact = sum(inputs[r][c].double() for r in range(RING_K))
        assert torch.equal(result["exchange"], exact.float().to(torch.bfloat16)), c  # one rounding
        ring_error += (result["ring"].double() - exact).abs().sum().item()
        exchange_error += (result["exchange"].double() - exact).abs().sum().item()
    assert ring_error > exchange_error
