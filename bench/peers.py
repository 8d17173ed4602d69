"""Parity with the peers: train the same GPT-NeoX, data and seed under our engine or a peer on gloo
ranks, and record the global mean loss of every optimizer step (docs/peers.md). The command line of
megatron/benchmarking/peers.py, and each of its ranks (with --rank).

    .venv/bin/python bench/peers.py --peer deepspeed --preset zero3 --steps 5 --out /tmp/ds.json
    .venv/bin/python bench/peers.py --peer ours      --preset zero3 --steps 5 --out /tmp/ours.json
    .venv/bin/python bench/peers.py --peer fsdp2     --preset hsdp  --steps 5 --out /tmp/fsdp2.json
    .venv/bin/python bench/peers.py --compare /tmp/ours.json /tmp/ds.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from megatron.benchmarking.peers import (LR, PARITY, SUPPORTED, PeerError, describe, launch, load_result,
                                         max_loss_differences, parse_args, rank_main)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.compare:
            a, b = (load_result(p) for p in args.compare)
            print(describe(a) + "\n" + describe(b))
            for acc, diff in max_loss_differences(a, b).items():
                print(f"accumulation {acc}: max per-step |loss difference| {diff:.3e}")
            return 0
        if args.peer is None or args.preset is None:
            raise PeerError("give --peer and --preset (or --compare A B)")
        if (args.peer, args.preset) not in SUPPORTED:
            raise PeerError(f"peer {args.peer} has no counterpart of preset {args.preset}; "
                            f"supported: {sorted(SUPPORTED)}")
        if args.steps < 1 or min(args.accumulation) < 1:
            raise PeerError("--steps and --accumulation must be positive")
        if args.rank is not None:
            rank_main(args)  # does not return
        runs = launch(args)
        result = {"peer": args.peer, "preset": args.preset, "world_size": PARITY.world_size,
                  "layout": list(PARITY.tiers), "steps": args.steps, "lr": LR, "vocab": PARITY.vocab,
                  "seq_length": PARITY.seq_length, "micro_batch": PARITY.micro_batch, "runs": runs}
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
        print(describe(result))
        return 0
    except PeerError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
