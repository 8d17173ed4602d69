"""What gloo can push between the two ranks of a pair on loopback, with every pair busy at once: the
ceiling the three-tier emulated cluster's rates are scaled to (docs/emulated_cluster.md, "Choosing
the rates"). Ranks 2p and 2p+1 form pair p; each pair all-gathers a --mb MB buffer (each rank sends
--mb MB to its partner) --reps times over its own gloo sub-group. Rank 0 prints the payload rate of
one pair (MB/s, one direction) and the sum over pairs.

    .venv/bin/python bench/pair_rate.py --ranks 2            # one pair alone
    .venv/bin/python bench/pair_rate.py --ranks 8            # four pairs at once, as in a 2 x 2 x 2 run

It starts its own ranks (FileStore rendezvous in a private folder, 127.0.0.1 loopback); no root needed.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    rank, world = args.rank, args.ranks
    dist.init_process_group("gloo", init_method=f"file://{args.workdir}/store", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    pairs = [dist.new_group([2 * p, 2 * p + 1]) for p in range(world // 2)]
    mine = pairs[rank // 2]
    n = int(args.mb * 1e6) // 4
    src, out = torch.ones(n), torch.empty(2 * n)
    dist.all_gather_into_tensor(out, src, group=mine)  # connect and warm up
    times = []
    for _ in range(args.reps):
        dist.barrier()
        start = time.perf_counter()
        dist.all_gather_into_tensor(out, src, group=mine)
        times.append(time.perf_counter() - start)
    rates = torch.tensor([args.mb / min(times)], dtype=torch.float64)  # MB/s one direction, best rep
    gathered = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(gathered, rates)
    if rank == 0:
        per_pair = [float(gathered[2 * p]) for p in range(world // 2)]
        result = {"ranks": world, "mb": args.mb, "reps": args.reps, "pair_mb_s": per_pair,
                  "median_pair_mb_s": sorted(per_pair)[len(per_pair) // 2], "sum_mb_s": sum(per_pair)}
        print(json.dumps(result))
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=8, help="even; pairs are (0,1), (2,3), ...")
    p.add_argument("--mb", type=float, default=32.0, help="MB each rank sends its partner per repetition")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out")
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.ranks < 2 or args.ranks % 2:
        p.error("--ranks must be even and at least 2")
    if args.rank is not None:
        rank_main(args)
        return 0
    workdir = tempfile.mkdtemp(prefix="pair_rate_")
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    base = [sys.executable, __file__, "--ranks", str(args.ranks), "--mb", str(args.mb), "--reps", str(args.reps),
            "--workdir", workdir, *(["--out", args.out] if args.out else [])]
    procs = [subprocess.Popen(base + ["--rank", str(r)], env=env) for r in range(args.ranks)]
    codes = [proc.wait() for proc in procs]
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
