"""The Frontier figure sets against the PCCL authors' raw RCCL timings (megatron/analytic/pccl_frontier.py).

Where ../shared/external/pccl-frontier's CSV is present: the shipped points of figure_sets.py are
derived again from it and must match, and a few points are recomputed here straight from the
CSV's rows, without the module's reduction. Without the CSV those tests skip; the reduction itself
and the curves built from the shipped points are checked on hand-made rows and by hand."""
from __future__ import annotations

import csv
import statistics

import pytest

from conftest import SHARED
from megatron.analytic import pccl_frontier
from megatron.analytic.figure_sets import (CLEAN_POINTS, EAGER_POINTS, FIGURE_SETS, Assumptions, cross_curve,
                                           frontier_curves, measured_curve)
from megatron.topology.algorithms import PAIRWISE_ALL_TO_ALL, RING_ALLGATHER, RING_ALLREDUCE, RING_REDUCE_SCATTER

CSV = SHARED / "external" / "pccl-frontier" / "pccl_frontier_collectives.csv"
needs_csv = pytest.mark.skipif(not CSV.exists(), reason=f"{CSV} is absent (the PCCL authors' Frontier RCCL timings, "
                                                        "see its PROVENANCE.md): the shipped points cannot be rechecked")


def _csv_rows():
    with open(CSV, newline="") as f:
        return list(csv.DictReader(f))


def _busbw(rows, run, nodes, size_mib):
    """The one RCCL row of a run folder, node count and size."""
    hits = [float(r["busbw_gb_s"]) for r in rows if r["run"] == run and r["method"] == "nccl"
            and int(r["nodes"]) == nodes and int(r["size_mib"]) == size_mib]
    assert len(hits) == 1, (run, nodes, size_mib, hits)
    return hits[0]


def _same_points(derived: dict, shipped: dict) -> None:
    assert set(derived) == set(shipped)
    for key in shipped:
        got, want = derived[key], shipped[key]
        assert [(s, n) for s, _, n in got] == [(s, n) for s, _, n in want], key
        assert [g for _, g, _ in got] == pytest.approx([g for _, g, _ in want], abs=5e-7), key


@needs_csv
@pytest.mark.parametrize("regime, shipped", [("clean", CLEAN_POINTS), ("eager", EAGER_POINTS)])
def test_the_shipped_points_are_the_csvs(regime, shipped):
    _same_points(pccl_frontier.derive(pccl_frontier.read_rows(CSV), regime), shipped)


@needs_csv
def test_points_recomputed_from_the_rows_by_hand():
    rows = _csv_rows()
    world_ag = dict((s, g) for s, g, _ in CLEAN_POINTS[("all_gather", "world")])
    # 8 KiB steps of the clean all-gather: 2 MiB on 32 nodes (256 ranks) and 4 MiB on 64 (512 ranks);
    # 1 MiB on 16 nodes is a job's first size, left out.
    assert world_ag[8192] == pytest.approx(statistics.median(
        [_busbw(rows, "all_gather_3", 32, 2), _busbw(rows, "all_gather_3", 64, 4)]))
    # 1 MiB steps: size = 1 MiB x 8 x nodes for 2-64 nodes
    assert world_ag[1 << 20] == pytest.approx(statistics.median(
        [_busbw(rows, "all_gather_3", n, 8 * n) for n in (2, 4, 8, 16, 32, 64)]))
    # the reduce-scatter's size is its per-rank input: 256 MiB on 4 nodes is 8 MiB steps (32 ranks)
    world_rs = dict((s, g) for s, g, _ in CLEAN_POINTS[("reduce_scatter", "world")])
    assert world_rs[8 << 20] == pytest.approx(statistics.median(
        [_busbw(rows, "reduce_scatter_3", n, 64 * n) for n in (2, 4, 8, 16)]))
    # the one-node curve is the one-node job's rows: 1024 MiB over 8 ranks
    node = dict((s, g) for s, g, _ in CLEAN_POINTS[("all_gather", "node")])
    assert node[128 << 20] == _busbw(rows, "all_gather_3", 1, 1024)
    # the eager runs' collapse: 128 KiB steps, median of 2-128 nodes, below 1 GB/s
    eager = dict((s, g) for s, g, _ in EAGER_POINTS[("all_gather", "world")])
    assert eager[128 << 10] == pytest.approx(statistics.median(
        [_busbw(rows, "all_gather_2", n, n) for n in (2, 4, 8, 16, 32, 64, 128)]))
    assert eager[128 << 10] < 1.0 < 4.0 < world_ag[128 << 10]


@needs_csv
def test_every_job_ran_its_sizes_in_one_run_folder_of_one_log():
    # a job = (run folder, node count): one Slurm log each, so "its first size" is well defined
    logs = {}
    for r in _csv_rows():
        if r["run"] in ("all_gather_2", "all_gather_3", "reduce_scatter_2", "reduce_scatter_3") and r["method"] == "nccl":
            logs.setdefault((r["run"], r["nodes"]), set()).add(r["source_file"])
    assert logs and all(len(files) == 1 for files in logs.values())


def _row(run, nodes, size_mib, busbw):
    return {"collective": "all_gather", "run": run, "regime": "clean", "nodes": nodes, "ranks": 8 * nodes,
            "method": "nccl", "size_mib": size_mib, "time_ms": 1.0, "busbw_gb_s": busbw, "source_file": "x"}


def test_the_reduction_on_hand_made_rows():
    run = pccl_frontier.REGIMES["clean"]["all_gather"]
    rows = [_row(run, 1, 1, 9.0), _row(run, 1, 2, 10.0),                  # one node: 128 and 256 KiB steps
            _row(run, 2, 1, 0.01), _row(run, 2, 2, 2.0), _row(run, 2, 4, 4.0),  # 2 nodes: 64, 128, 256 KiB
            _row(run, 4, 1, 0.02), _row(run, 4, 4, 3.0), _row(run, 4, 8, 5.0),  # 4 nodes: 32, 128, 256 KiB
            {**_row(run, 4, 8, 99.0), "method": "mpi"}]                       # not RCCL: never read
    rows += [{**_row(pccl_frontier.REGIMES["clean"]["reduce_scatter"], 1, 4, 1.0)},
             {**_row(pccl_frontier.REGIMES["clean"]["reduce_scatter"], 2, 4, 1.0)}]
    pts = pccl_frontier.derive(rows, "clean")
    # each job's first (1 MiB) size is gone; 128 KiB: 2 MiB on 2 nodes and 4 MiB on 4; 256 KiB likewise
    assert pts[("all_gather", "node")] == ((256 << 10, 10.0, (1,)),)
    assert pts[("all_gather", "world")] == ((128 << 10, 2.5, (2, 4)), (256 << 10, 4.5, (2, 4)))
    kept = pccl_frontier.derive(rows, "clean", drop_first=False)[("all_gather", "world")]
    assert kept[:2] == ((32 << 10, 0.02, (4,)), (64 << 10, 0.01, (2,)))
    # a reading restricted to some node counts keeps the one-node job
    only4 = pccl_frontier.derive(rows, "clean", nodes=(4,))
    assert only4[("all_gather", "world")] == ((128 << 10, 3.0, (4,)), (256 << 10, 5.0, (4,)))
    assert only4[("all_gather", "node")] == pts[("all_gather", "node")]


def test_the_curves_built_from_the_points_by_hand():
    curves = FIGURE_SETS["frontier-measured"].curves
    ag = dict((s, g * 1e9) for s, g, _ in CLEAN_POINTS[("all_gather", "world")])
    rs = dict((s, g * 1e9) for s, g, _ in CLEAN_POINTS[("reduce_scatter", "world")])
    # the measured points are the world curves, each algorithm its own
    assert curves[(RING_ALLGATHER, "world")].bandwidth(1 << 20) == pytest.approx(ag[1 << 20])
    assert curves[(RING_REDUCE_SCATTER, "world")].bandwidth(1 << 20) == pytest.approx(rs[1 << 20])
    assert ag[1 << 20] != rs[1 << 20]
    # an all-reduce steps through a reduce-scatter and then an all-gather: 2 s / r = s / r_rs + s / r_ag
    assert curves[(RING_ALLREDUCE, "world")].bandwidth(1 << 20) == pytest.approx(2 / (1 / rs[1 << 20] + 1 / ag[1 << 20]))
    # 8 cross rings per node: 8 x the world rate at 64 KiB steps, capped at the world plateau above
    assert curves[(RING_ALLGATHER, "cross")].bandwidth(64 << 10) == pytest.approx(8 * ag[64 << 10])
    assert curves[(RING_ALLGATHER, "cross")].bandwidth(4 << 20) == pytest.approx(max(ag.values()))
    # across nodes the all-to-all runs at the all-gather ring's rate / 2.5 (rccl#1206)
    assert curves[(PAIRWISE_ALL_TO_ALL, "world")].bandwidth(1 << 20) == pytest.approx(ag[1 << 20] / 2.5)
    # below the first point a step takes as long as that step did: the implied per-step latency
    first_step, first_rate = min(ag.items())
    assert curves[(RING_ALLGATHER, "world")].bandwidth(first_step / 4) == pytest.approx(first_rate / 4)
    # every curve is end to end (busbw): no latency added, but the pair's (148 GB/s, no RCCL pair run)
    assert {c.latency_s for (a, shape), c in curves.items() if shape != "pair"} == {0.0}


def test_the_eager_set_is_the_collapse_runs():
    clean, eager = FIGURE_SETS["frontier-measured"].curves, FIGURE_SETS["frontier-eager"].curves
    step = 128 << 10
    want = dict((s, g * 1e9) for s, g, _ in EAGER_POINTS[("all_gather", "world")])[step]
    assert eager[(RING_ALLGATHER, "world")].bandwidth(step) == pytest.approx(want)
    assert eager[(RING_ALLGATHER, "world")].bandwidth(step) < clean[(RING_ALLGATHER, "world")].bandwidth(step) / 5
    # large steps leave the eager protocol behind: the two regimes agree within 5% at 8 MiB
    assert eager[(RING_ALLGATHER, "world")].bandwidth(8 << 20) == pytest.approx(
        clean[(RING_ALLGATHER, "world")].bandwidth(8 << 20), rel=0.05)


def test_assumptions_move_only_what_they_say():
    base = frontier_curves(CLEAN_POINTS)
    capped = frontier_curves(CLEAN_POINTS, Assumptions(cross_cap_gbs=95.28))
    assert base[(RING_ALLGATHER, "world")] == capped[(RING_ALLGATHER, "world")]
    assert capped[(RING_ALLGATHER, "cross")].bandwidth(64 << 20) == pytest.approx(95.28e9)
    half = frontier_curves(CLEAN_POINTS, Assumptions(world_scale=0.5))
    world = base[(RING_ALLGATHER, "world")].bandwidth(1 << 20)
    assert half[(RING_ALLGATHER, "world")].bandwidth(1 << 20) == pytest.approx(world / 2)
    assert half[(RING_ALLGATHER, "node")] == base[(RING_ALLGATHER, "node")]
    direct = cross_curve(measured_curve(CLEAN_POINTS[("all_gather", "world")], "x"), 1.0e9)
    assert max(r for _, r in direct.points) == 1.0e9


def test_a_config_can_ask_for_the_eager_set():
    from conftest import REPO
    from megatron.config import load_config
    from megatron.analytic.model_inputs import hardware_from_config
    cfg = load_config([str(REPO / "configs" / "20B.yml"), str(REPO / "configs" / "zero3.yml")],
                      ["topology.preset=frontier", "num_nodes=8", "topology.figure_set=frontier-eager"], notices=[])
    hw = hardware_from_config(cfg)
    assert hw.figure_set == "frontier-eager" and hw.source.startswith("frontier-eager")
    assert hw.curve(RING_ALLGATHER, "world") == FIGURE_SETS["frontier-eager"].curves[(RING_ALLGATHER, "world")]
