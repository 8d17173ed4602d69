"""Bytes on the wire per collective against the ledger's charge, on an emulated cluster.

Run once per rank by tools/emulate_cluster.py (gloo, CPU). For each collective and group, every
node's first rank reads its interface's tx_bytes (/sys/class/net/$GLOO_SOCKET_IFNAME, this node's
namespace) before and after `--reps` repetitions fenced by barriers; the ranks' ledger charges for
the inter_node tier are summed over the world and compared with the nodes' summed tx bytes. A
window with barriers only is measured first and subtracted from every other window.
`--setup-only` does what a run does before and after its collectives (join the process group,
create the groups of `--factors w g os` as the trainer does, one barrier, destroy) and nothing
else: the emulator's counters then give the fixed cost a run adds to its ledger.

    .venv/bin/python tools/emulate_cluster.py --nodes 2 --ranks-per-node 2 --rate unlimited \\
        --command ".venv/bin/python bench/wire_bytes.py --mb 4 --out /tmp/wire.json"
    .venv/bin/python tools/emulate_cluster.py --nodes 2 --ranks-per-node 2 --rate unlimited \
        --command ".venv/bin/python bench/wire_bytes.py --setup-only --factors 2 2 4"
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megatron.topology.layout import ShardLayout
from megatron.topology import ProcessGroups, Topology
from megatron.topology.groups import RankGroup
from megatron.topology.layout import ShardFactors
from megatron.engine.comm import Communicator
from megatron.engine.ledger import ByteLedger


def tx_bytes() -> int:
    return int(Path(f"/sys/class/net/{os.environ['GLOO_SOCKET_IFNAME']}/statistics/tx_bytes").read_text())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=float, default=4.0, help="full buffer size B per collective, MB (fp32)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=None, help="rank 0 writes the table here as JSON")
    p.add_argument("--setup-only", action="store_true", help="join, create the groups, barrier, leave")
    p.add_argument("--factors", type=int, nargs=3, default=None, metavar=("W", "G", "OS"),
                   help="shard factors whose groups --setup-only creates (default N N N)")
    args = p.parse_args(argv)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    first_of_node = int(os.environ["LOCAL_RANK"]) == 0
    topology = Topology.simulated([world // per_node, per_node])
    if args.setup_only:
        ProcessGroups.build(topology, ShardLayout.from_topology(topology, ShardFactors(*(args.factors or (world, world, world)))))
        dist.barrier()
        dist.destroy_process_group()
        return 0
    groups = ProcessGroups.build(topology, ShardLayout.from_topology(topology, ShardFactors(world, world, world)))
    cross_ranks = [tuple(range(local, world, per_node)) for local in range(per_node)]
    cross_handles = [dist.new_group(list(r)) for r in cross_ranks]  # every rank creates every group
    mine = next(i for i, r in enumerate(cross_ranks) if rank in r)
    cross = RankGroup("cross", cross_ranks[mine], cross_handles[mine])
    comm = Communicator(groups, ByteLedger())
    n = int(args.mb * 1e6 / 4) // (world * 8) * (world * 8)

    def window(run) -> tuple[int, int]:
        """(wire bytes all nodes sent, ledger inter_node bytes all ranks charged) for `reps` x run()."""
        comm.ledger.reset()
        dist.barrier()
        start = tx_bytes() if first_of_node else 0
        dist.barrier()
        for _ in range(args.reps):
            run()
        dist.barrier()
        sent = tx_bytes() - start if first_of_node else 0
        charged = comm.ledger.by_tier(comm.ledger.snapshot())["inter_node"]
        totals = torch.tensor([float(sent), float(charged)], dtype=torch.float64)
        dist.all_reduce(totals)
        return int(totals[0]), int(totals[1])

    def ops(group: RankGroup) -> dict:
        k = group.size
        full, part = torch.ones(n), torch.ones(n // k)
        return {
            "all_gather": lambda: comm.all_gather(full, part, group, "control"),
            "reduce_scatter": lambda: comm.reduce_scatter(part, full, group, "control"),
            "all_reduce": lambda: comm.all_reduce(full, group, "control"),
            "all_to_all": lambda: comm.all_to_all(torch.empty(n), full, group, "control"),
        }

    fence, _ = window(lambda: None)
    rows = []
    for name, group in (("world", groups.world), ("cross", cross)):
        for op, run in ops(group).items():
            wire, ledger = window(run)
            rows.append({"op": op, "group": name, "group_size": group.size, "buffer_bytes": n * 4,
                         "reps": args.reps, "ledger_inter_node": ledger, "wire_tx": wire - fence,
                         "ratio": round((wire - fence) / ledger, 4) if ledger else None})
    if rank == 0:
        print(f"fence (barriers only): {fence:,} B; buffer {n * 4:,} B x {args.reps} reps, world {world}")
        print(f"{'op':<16}{'group':<8}{'ledger inter_node':>20}{'wire tx':>16}{'wire/ledger':>13}")
        for r in rows:
            print(f"{r['op']:<16}{r['group']:<8}{r['ledger_inter_node']:>20,}{r['wire_tx']:>16,}{r['ratio']!s:>13}")
        if args.out:
            Path(args.out).write_text(json.dumps({"fence": fence, "rows": rows}, indent=2))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
