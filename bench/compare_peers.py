#!/usr/bin/env python
"""Speed side by side on an emulated cluster (three tiers by default: 2 nodes x 2 GPUs x 2 ranks): our
presets and layouts, DeepSpeed ZeRO-3 / hpZ / MiCS and FSDP2, each peer at its default and at its best
(docs/benchmarks.md). The command line of megatron/benchmarking/compare_peers.py, and each of its
ranks (with --rank-main).

    .venv/bin/python bench/compare_peers.py --dtype bf16      # the whole matrix (as root)
    .venv/bin/python bench/compare_peers.py --only ds_zero3 ours_zero_topo --layouts 2x2 \\
        --accumulation 4 --steps 3 --warmup 1 --out /tmp/c.json --png /tmp/c.png --markdown
    .venv/bin/python bench/compare_peers.py --from-json bench/results/compare_peers.json --markdown

Exit codes: 0 when every configuration ran, 1 when some failed (each failure is a row of the table),
2 for bad arguments, 69 when this machine cannot emulate a cluster (not root, or no iproute2).
"""
from __future__ import annotations

import sys

from megatron.benchmarking import compare_report as report
from megatron.benchmarking.emulated_network import UsageError, environment_problem, parse_rate
from megatron.benchmarking.compare_peers import (UNAVAILABLE, BenchError, parse_args, rank_main,
                                                 run_matrix, write_json)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse_args(argv)
        if args.rank_main:
            return rank_main(args)
        if args.from_json:
            results = report.load(args.from_json)
        else:
            try:
                parse_rate(args.rate)
            except UsageError as err:
                raise BenchError(str(err)) from None
            problem = environment_problem()
            if problem:
                print(f"compare_peers: cannot emulate a cluster here: {problem}", file=sys.stderr)
                return UNAVAILABLE
            results = run_matrix(args, argv)
            write_json(args.out, results)
            print(f"compare_peers: {len(results['rows'])} launches in {results['meta']['wall_s']:.0f} s; "
                  f"results in {args.out}", flush=True)
        if args.png:
            report.bar_chart(results, args.png)
        if args.markdown:
            print(report.markdown(results))
        return 0 if all(row["ok"] for row in results["rows"]) else 1
    except (BenchError, report.ReportError) as err:
        print(f"compare_peers: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
