"""The byte-charging rule of the collective wrapper and the ledger's bookkeeping (no processes).

The multi-rank ledger tables (sync over the world, which cells are non-zero per preset) are judged
in test_engine_dist.py from the same launches as the parity tests.
"""
from __future__ import annotations

import pytest
import torch

from megatron.topology.layout import ShardLayout
from megatron.topology import ProcessGroups, RankGroup, ShardFactors, Topology
from megatron.engine import PHASES, TIERS, ByteLedger, CommError, Communicator, LedgerError


def comm_for(rank: int, layout=(2, 2, 2), factors=(2, 4, 8)) -> Communicator:
    groups = ProcessGroups(Topology.simulated(list(layout)), ShardLayout.from_topology(Topology.simulated(list(layout)), ShardFactors(*factors)), rank, create=False)
    return Communicator(groups)


def test_ring_collectives_charge_the_hop_to_the_next_member():
    world = RankGroup("world", tuple(range(8)))
    expected_tier = {0: "intra_gpu", 1: "intra_node", 2: "intra_gpu", 3: "inter_node",
                     4: "intra_gpu", 5: "intra_node", 6: "intra_gpu", 7: "inter_node"}  # 7 -> 0 wraps
    for rank in range(8):
        comm = comm_for(rank)
        assert comm.charge("all_gather", 800, world, "fwd_gather") == {expected_tier[rank]: 700}
        assert comm.charge("reduce_scatter", 800, world, "grad_reduce") == {expected_tier[rank]: 700}
        assert comm.charge("all_reduce", 800, world, "control") == {expected_tier[rank]: 1400}
        snap = comm.ledger.snapshot()
        assert snap[("fwd_gather", expected_tier[rank])] == 700 and snap[("control", expected_tier[rank])] == 1400
        assert sum(snap.values()) == 2800


def test_world_ring_totals_split_by_tier():
    """Summed over ranks, a node-ordered ring over 2x2x2 crosses the node boundary only twice."""
    world = RankGroup("world", tuple(range(8)))
    totals = ByteLedger()
    for rank in range(8):
        for (phase, tier), nbytes in _charged(rank, "all_gather", 800, world).items():
            totals.record(phase, tier, nbytes)
    assert ByteLedger.by_tier(totals.snapshot()) == {"intra_gpu": 4 * 700, "intra_node": 2 * 700, "inter_node": 2 * 700}


def _charged(rank, op, nbytes, group):
    comm = comm_for(rank)
    comm.charge(op, nbytes, group, "fwd_gather")
    return {k: v for k, v in comm.ledger.snapshot().items() if v}


def test_all_to_all_charges_every_peer():
    comm = comm_for(1)
    node = RankGroup("node", (0, 1, 2, 3))
    assert comm.charge("all_to_all", 400, node, "grad_reduce") == {"intra_gpu": 100, "intra_node": 200}
    world = RankGroup("world", tuple(range(8)))
    assert comm.charge("all_to_all", 800, world, "grad_reduce") == {"intra_gpu": 100, "intra_node": 200, "inter_node": 400}


def test_broadcast_charges_a_chain_from_the_first_member():
    """Each member but the last forwards all B bytes to the next one (7 bytes: no divisibility)."""
    world = RankGroup("world", tuple(range(8)))
    sent = {rank: comm_for(rank).charge("broadcast", 7, world, "checkpoint") for rank in range(8)}
    assert sent == {0: {"intra_gpu": 7}, 1: {"intra_node": 7}, 2: {"intra_gpu": 7}, 3: {"inter_node": 7},
                    4: {"intra_gpu": 7}, 5: {"intra_node": 7}, 6: {"intra_gpu": 7}, 7: {}}


def test_single_rank_groups_record_nothing_and_copy():
    comm = comm_for(3)
    alone = RankGroup("replica", (3,))
    out, inp = torch.zeros(4), torch.arange(4.0)
    assert comm.all_gather(out, inp, alone, "refresh") == {}
    assert torch.equal(out, inp)
    buf = torch.ones(3)
    assert comm.all_reduce(buf, alone, "replica_allreduce") == {} and torch.equal(buf, torch.ones(3))
    assert all(v == 0 for v in comm.ledger.snapshot().values())


def test_indivisible_buffers_and_unknown_names_are_refused():
    comm = comm_for(0)
    pair = RankGroup("weight", (0, 1))
    with pytest.raises(CommError, match="multiple of 2"):
        comm.charge("all_gather", 7, pair, "fwd_gather")
    with pytest.raises(CommError, match="expected 2 x 3"):
        comm.all_gather(torch.zeros(5), torch.zeros(3), pair, "fwd_gather")
    with pytest.raises(CommError, match="expected 2 x 2"):
        comm.reduce_scatter(torch.zeros(2), torch.zeros(5), pair, "grad_reduce")
    with pytest.raises(LedgerError, match="unknown ledger phase"):
        comm.charge("all_gather", 8, pair, "warmup")
    with pytest.raises(CommError, match="unknown collective"):
        comm.charge("scatter", 8, pair, "control")


def test_ledger_move_reset_and_metrics():
    ledger = ByteLedger()
    ledger.record("bwd_gather", "intra_gpu", 100)
    ledger.move({"intra_gpu": 60}, "bwd_gather", "recompute_gather")
    snap = ledger.snapshot()
    assert snap[("bwd_gather", "intra_gpu")] == 40 and snap[("recompute_gather", "intra_gpu")] == 60
    assert len(snap) == len(PHASES) * len(TIERS)
    with pytest.raises(LedgerError, match="not recorded"):
        ledger.move({"intra_gpu": 41}, "bwd_gather", "recompute_gather")
    metrics = ByteLedger.metrics(snap)
    assert metrics["comm/bytes/intra_gpu"] == 100 and metrics["comm/bytes/phase/recompute_gather"] == 60
    assert metrics["comm/bytes/inter_node"] == 0
    ledger.reset()
    assert all(v == 0 for v in ledger.snapshot().values())
