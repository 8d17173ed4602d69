"""Link curves from the PCCL authors' raw Frontier RCCL timings (docs/frontier-model.md, "The figures").

The data: ``../shared/external/pccl-frontier/pccl_frontier_collectives.csv`` (PROVENANCE.md beside
it; public repository axonn-ai/sc2025-pccl-reproducer, branch ``experimental``, data/ at commit
5a6353f). One row per (run folder, nodes, method, size): RCCL's ``all_gather_into_tensor`` /
``reduce_scatter_tensor`` on the world group through torch.distributed, 8 ranks per node, bf16,
the bus bandwidth the authors printed. ``figure_sets.py`` ships the points this module derives
(``derive``); ``tests/test_pccl_frontier.py`` derives them again from the CSV and compares.

The reduction, fixed before any ratio of the paper was computed and the same for every curve:

1. Rows of one regime (``REGIMES``) and method ``nccl`` (RCCL), i.e. one job per node count.
2. **Each job's first size is left out.** The benchmark runs its sizes in ascending order, so the
   1 MiB row is also the job's first collective. From 16 nodes on it is 6-50x below the other jobs
   at the same ring step (e.g. all-gather, 8 KiB steps: 0.116 GB/s at 16 nodes, the first size,
   against 0.929 at 32 and 0.686 at 64 nodes), in both regimes: a setup cost, not a rate.
   ``drop_first=False`` keeps it (bench/frontier_model.py shows what that does).
3. A row's ring step is the chunk one rank passes per step, ``size MiB x 2^20 / ranks`` bytes: the
   all-gather's size is its whole output, the reduce-scatter's its per-rank input (PROVENANCE.md),
   so both are the ``B / k`` the time model indexes its curves by.
4. One node (8 ranks in one node) gives the ``node`` curve: the rate per rank. Two or more nodes
   give the ``world`` curve (a ring through every node, 8 ranks each): the busbw, which is each
   node's egress, (k - 1)/k of B over t. At each step size the point is the median busbw of the
   multi-node jobs that measured it: the rate moves with the step far more than with the node
   count (docs/frontier-model.md's table of points lists the node counts behind each).

Each point keeps the node counts of the rows it came from: with (run, method nccl, size = step x
ranks / 2^20) they name the CSV rows.

    .venv/bin/python -m megatron.analytic.pccl_frontier          # prints figure_sets.py's tables
"""
from __future__ import annotations

import csv
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Optional

MIB = 1 << 20
DATA = Path(__file__).resolve().parents[3] / "shared" / "external" / "pccl-frontier" / "pccl_frontier_collectives.csv"
SOURCE = "axonn-ai/sc2025-pccl-reproducer@5a6353f (../shared/external/pccl-frontier)"
# regime -> {collective: run folder}. The eager runs are the "_2" folders: the same srun line as the
# clean "_3" ones (--gpus-per-task=1 --gpu-bind=closest), libfabric's eager protocol left on. The
# first folders (all_gather, reduce_scatter) collapse too but ran with other srun flags: left out.
REGIMES = {
    "clean": {"all_gather": "all_gather_3", "reduce_scatter": "reduce_scatter_3"},
    "eager": {"all_gather": "all_gather_2", "reduce_scatter": "reduce_scatter_2"},
}
COLLECTIVES = ("all_gather", "reduce_scatter")
SPANS = ("node", "world")


def read_rows(path: Path = DATA) -> list:
    """The CSV's rows as dicts of typed fields."""
    with open(path, newline="") as f:
        return [{"collective": r["collective"], "run": r["run"], "regime": r["regime"], "nodes": int(r["nodes"]),
                 "ranks": int(r["ranks"]), "method": r["method"], "size_mib": int(r["size_mib"]),
                 "time_ms": float(r["time_ms"]), "busbw_gb_s": float(r["busbw_gb_s"]), "source_file": r["source_file"]}
                for r in csv.DictReader(f)]


def step_bytes(row: dict) -> int:
    """The ring step's chunk of a row: size x 2^20 / ranks (both collectives, module docstring)."""
    return row["size_mib"] * MIB // row["ranks"]


def job_rows(rows: Iterable, run: str, drop_first: bool = True, nodes: Optional[Iterable[int]] = None) -> list:
    """RCCL rows of one run folder; without each job's first (smallest) size unless ``drop_first`` is
    False; only the node counts in ``nodes`` (all when None; one node is always kept: the node curve)."""
    picked = [r for r in rows if r["run"] == run and r["method"] == "nccl"
              and (nodes is None or r["nodes"] == 1 or r["nodes"] in set(nodes))]
    if drop_first:
        first = {}
        for r in picked:
            first[r["nodes"]] = min(first.get(r["nodes"], r["size_mib"]), r["size_mib"])
        picked = [r for r in picked if r["size_mib"] != first[r["nodes"]]]
    return picked


def derive(rows: Iterable, regime: str, drop_first: bool = True, nodes: Optional[Iterable[int]] = None) -> dict:
    """{(collective, span): ((step bytes, busbw GB/s, node counts), ...)} ascending in step bytes: per
    step size, the median busbw of the jobs that measured it (``node``: the one-node job)."""
    rows = list(rows)
    out = {}
    for collective in COLLECTIVES:
        by_step = {span: defaultdict(dict) for span in SPANS}
        for r in job_rows(rows, REGIMES[regime][collective], drop_first, nodes):
            if r["ranks"] != 8 * r["nodes"]:
                raise ValueError(f"{r['source_file']}: {r['ranks']} ranks on {r['nodes']} nodes, not 8 per node")
            by_step["node" if r["nodes"] == 1 else "world"][step_bytes(r)][r["nodes"]] = r["busbw_gb_s"]
        for span in SPANS:
            out[(collective, span)] = tuple(
                (step, round(statistics.median(per_job.values()), 6), tuple(sorted(per_job)))
                for step, per_job in sorted(by_step[span].items()))
    return out


def render(points: dict, name: str) -> str:
    """``points`` as the Python literal figure_sets.py ships."""
    lines = [f"{name} = {{"]
    for key, pts in points.items():
        lines.append(f"    {key!r}: (")
        for i in range(0, len(pts), 2):
            lines.append("        " + " ".join(f"({s}, {g!r}, {n!r})," for s, g, n in pts[i:i + 2]))
        lines.append("    ),")
    return "\n".join(lines + ["}"])


def main(argv=None) -> int:
    path = Path(argv[0]) if argv else DATA
    rows = read_rows(path)
    for regime in REGIMES:
        print(render(derive(rows, regime), f"{regime.upper()}_POINTS"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
