"""What each tier of the three-tier emulated cluster carries, measured with gloo itself: rank 0 sends
--mb MB to its pair partner (rank 1, same GPU: loopback), then to the first rank of the node's next GPU
(a GPU link in, one out), then to the first rank of node 1 (GPU link, both uplinks, GPU link), one at a
time, each timed until the receiver acknowledges. Rank 0 prints the payload rate per tier (and writes
it with --out). Every rank of the world joins the process group; only those four send or receive.

    .venv/bin/python tools/emulate_cluster.py --nodes 2 --gpus-per-node 2 --ranks-per-node 4 \\
        --rate 200mbit --gpu-rate 400mbit --report /tmp/r.json --command ".venv/bin/python bench/tier_rate.py --mb 10"

--pair-mb sets the loopback transfer apart (default 10 x --mb), so it lasts long enough to time.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=float, default=10.0, help="MB sent across the GPU and node links")
    p.add_argument("--pair-mb", type=float, default=None, help="MB sent to the pair partner (default 10 x --mb)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    per_node, per_gpu = int(os.environ["LOCAL_WORLD_SIZE"]), int(os.environ.get("NEOX_EMU_RANKS_PER_GPU", "1"))
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    targets = {"intra_gpu": 1 if per_gpu > 1 else None, "intra_node": per_gpu if per_node > per_gpu else None,
               "inter_node": per_node if world > per_node else None}
    sizes = {"intra_gpu": args.pair_mb or 10 * args.mb, "intra_node": args.mb, "inter_node": args.mb}
    ack = torch.zeros(1)
    rates = {}
    for tier, dst in targets.items():
        dist.barrier()
        if dst is None:
            continue
        buf = torch.ones(int(sizes[tier] * 1e6) // 4)
        if rank == 0:
            start = time.perf_counter()
            dist.send(buf, dst)
            dist.recv(ack, dst)
            seconds = time.perf_counter() - start
            rates[tier] = {"mb": sizes[tier], "seconds": seconds, "payload_bits_per_s": sizes[tier] * 8e6 / seconds}
        elif rank == dst:
            dist.recv(buf, 0)
            dist.send(ack, 0)
    dist.barrier()
    if rank == 0:
        print(json.dumps(rates))
        if args.out:
            Path(args.out).write_text(json.dumps(rates, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
