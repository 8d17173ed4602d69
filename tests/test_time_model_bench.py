"""bench/time_model.py without a network: the three-tier layout's probe and rows are launched on the
three-tier emulated cluster, a three-tier probe's figures reach the tiers they were measured on, and
the planner (fed such a probe) ranks our measured rows as the time model predicts them."""
from __future__ import annotations

import importlib.util
import json
import shlex
import sys

import pytest

from conftest import REPO

from megatron.analytic import planner
from megatron.analytic.hardware import PROBE_FORMAT
from megatron.benchmarking import compare_peers

_spec = importlib.util.spec_from_file_location("time_model_bench", REPO / "bench" / "time_model.py")
tm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tm)
sys.path.insert(0, str(REPO / "tools"))
import emulate_cluster  # noqa: E402

THREE = ["--layouts", "2x2x2", "--rate", "640mbit", "--gpu-rate", "640mbit", "--dtype", "bf16"]


def three_tier_probe(pair=0.5, gpu=0.08, node=0.08) -> dict:
    """A probe of 2 x 2 x 2 with a figure of its own per tier (GB/s per domain): the pair on loopback,
    the GPU links, the node links; no curves, so the tier figures are what the model reads."""
    tiers = {"inter_node": {"bandwidth_gbs": node, "latency_us": 300.0},
             "intra_node": {"bandwidth_gbs": gpu, "latency_us": 200.0},
             "intra_gpu": {"bandwidth_gbs": pair, "latency_us": 100.0}}
    return {"format": PROBE_FORMAT, "layout": [2, 2, 2], "backend": "gloo", "tiers": tiers,
            "algorithms": {"ring_allgather": tiers, "all_to_all": tiers},
            "device": {"achieved_flops": 2e10, "optimizer_elements_per_s": 5e7, "quantize_elements_per_s": 1e8,
                       "copy_bytes_per_s": 1e9, "overlap_efficiency": 0.9,
                       "overlap_by_tier": {"inter_node": 0.9, "intra_node": 0.5, "intra_gpu": 0.0}},
            "network": {"rate": "640mbit", "gpus_per_node": 2, "gpu_rate": "640mbit"}}


def test_the_three_tier_probe_runs_on_the_three_tier_network():
    args = tm.parse_args(THREE)
    cmd = tm.probe_command(args, "2x2x2", REPO / "probe.json")
    tool = emulate_cluster._parser().parse_args(cmd[2:])
    assert (tool.nodes, tool.ranks_per_node, tool.gpus_per_node, tool.gpu_rate, tool.rate) == (2, 4, 2, "640mbit",
                                                                                                "640mbit")
    inner = shlex.split(tool.command)
    assert inner[inner.index("--layout") + 1:inner.index("--layout") + 4] == ["2", "2", "2"]
    assert inner[inner.index("--dtype") + 1] == "bf16"  # the benchmark's 16-bit rows: the model timed in bf16
    # the same tiers on the two-tier network have no GPU namespaces
    two = emulate_cluster._parser().parse_args(tm.probe_command(args, "2x4", REPO / "p.json")[2:])
    assert two.gpus_per_node == 0
    assert tm.network_of(args, "2x2x2") == {"rate": "640mbit", "gpus_per_node": 2, "gpu_rate": "640mbit"}
    assert tm.network_of(args, "2x4")["gpus_per_node"] == 0


def test_the_rows_launch_as_compare_peers_launches_its_own(tmp_path):
    args = tm.parse_args(THREE)
    cmd = compare_peers.launch_command(tm.launch_args(args), tm.ours("topo_148"), "2x2x2", 4, "on", tmp_path)
    tool = emulate_cluster._parser().parse_args(cmd[2:])
    assert (tool.gpus_per_node, tool.gpu_rate, tool.rate) == (2, "640mbit", "640mbit")
    inner = shlex.split(tool.command)
    assert inner[inner.index("--dtype") + 1] == "bf16" and inner[inner.index("--overlap") + 1] == "on"
    config = json.loads(inner[inner.index("--config") + 1])
    assert config["key"] == "ours_topo_148" and config["overrides"] == list(compare_peers.factors(1, 4, 8))


def test_the_layouts_around_zero_topo_are_compare_peers_own_and_run_on_eight_ranks_only():
    for key, config in tm.AROUND.items():
        ours = tm.ours(key)
        assert (ours.key, ours.preset, ours.overrides, ours.layouts) == (config.key, config.preset, config.overrides,
                                                                         config.layouts)
        assert "2x2" not in ours.layouts and "2x2x2" in ours.layouts
        assert key not in tm.DEFAULT_PRESETS


def test_each_tier_reads_its_own_figures_from_a_three_tier_probe():
    shape = compare_peers.bench_shape("bench", "2x2x2", 4)
    cfg = tm.row_config(tm.ours("zero_topo"), shape, "on", "bf16")
    assert cfg.precision.bf16 and not cfg.precision.fp32_allreduce  # the 16-bit rows' keys
    hw = tm.probe_hardware(cfg, shape, three_tier_probe(pair=0.5, gpu=0.08, node=0.02), "p")
    for tier, gbs in (("intra_gpu", 0.5), ("intra_node", 0.08), ("inter_node", 0.02)):
        assert hw.link("ring_allgather", tier).bandwidth == pytest.approx(gbs * 1e9)
        assert hw.link("ring_reduce_scatter", tier).bandwidth == pytest.approx(gbs * 1e9)  # its fallback's
        assert hw.links[tier].bandwidth == pytest.approx(gbs * 1e9)
    assert [hw.device.overlap(t) for t in ("inter_node", "intra_node", "intra_gpu")] == [0.9, 0.5, 0.0]


def test_slower_gpu_links_cost_w_equals_node_more_than_zero_topo_and_a_slower_pair_costs_zero_topo():
    def step(key, **figures):
        return tm.predict(key, "2x2x2", 4, "on", three_tier_probe(**figures), "bf16")["predicted_s"]
    # zero_topo's weights live in the pair (w = 2); w = node (4, 4, 8) gathers them over the GPU links
    topo, node_w = step("zero_topo"), step("topo_448")
    assert step("topo_448", gpu=0.008) / node_w > 2 * step("zero_topo", gpu=0.008) / topo
    assert step("zero_topo", pair=0.005) > 3 * topo


def measured_rows(times: dict) -> list:
    """compare_peers-style rows of 2x2x2 at accumulation 4 in bf16 (step times given), a peer's and a
    failed one among them."""
    rows = [{"ok": True, "peer": "ours", "config": key, "label": compare_peers.BY_KEY[key].label, "layout": "2x2x2",
             "accumulation": 4, "dtype": "bf16", "overlap": "on", "median_step_s": s} for key, s in times.items()]
    rows.append({**rows[0], "peer": "fsdp2", "config": "fsdp2_hsdp_best", "median_step_s": 0.1})
    rows.append({**rows[0], "ok": False, "config": "ours_topo_288", "median_step_s": None})
    return rows


def test_the_planner_scores_each_measured_row_as_the_time_model_predicts_it_and_picks_as_its_search():
    keys = {"ours_zero_topo": "zero_topo", "ours_topo_148": "topo_148", "ours_zeropp": "zeropp_q",
            "ours_hsdp": "hsdp", "ours_topo_448": "topo_448"}
    probe = three_tier_probe()
    predicted = {c: tm.predict(k, "2x2x2", 4, "on", probe, "bf16")["predicted_s"] for c, k in keys.items()}
    pick = min(predicted, key=predicted.get)
    # measured: the planner's pick 3% slower than the fastest, which it ranks second
    second = sorted(predicted, key=predicted.get)[1]
    times = {c: 10.0 + i for i, c in enumerate(keys)} | {second: 1.00, pick: 1.03}
    [view] = tm.planner_view(measured_rows(times), {"2x2x2": probe})
    assert {e["config"]: e["predicted_s"] for e in view["rows"]} == predicted  # the peer's and the failed row left out
    assert view["pick"] == pick and view["fastest"] == second
    assert view["pick_over_fastest"] == pytest.approx(0.03) and view["within_goal"]
    ranks = {e["config"]: (e["planner_rank"], e["measured_rank"]) for e in view["rows"]}
    assert ranks[pick] == (1, 2) and ranks[second] == (2, 1)
    assert view["search_best"] and view["search_best_s"] <= predicted[pick]  # the free search sees every layout
    # 6% over the fastest misses the goal
    [view] = tm.planner_view(measured_rows(times | {pick: 1.06}), {"2x2x2": probe})
    assert not view["within_goal"]
    # the pick is the search's own choice rule (planner.choose) over the same candidates
    shape = compare_peers.bench_shape("bench", "2x2x2", 4)
    configs = [tm.row_config(compare_peers.BY_KEY[c], shape, "on", "bf16") for c in keys]
    inputs = planner.inputs_from_config(configs[0], shape.vocab, tm.probe_hardware(configs[0], shape, probe, "p"))
    rows = [planner.evaluate(planner.preset_candidate(cfg, bool(cfg.model.checkpoint_activations)), inputs)
            for cfg in configs]
    assert planner.choose(rows).time.total_s == pytest.approx(predicted[pick])


def test_the_planner_alone_on_a_saved_probe_runs_nothing(tmp_path, monkeypatch, capsys):
    def refuse(*a, **k):
        raise AssertionError("nothing is launched")
    monkeypatch.setattr(compare_peers, "run_one", refuse)
    monkeypatch.setattr(tm.subprocess, "run", refuse)
    probe, measured = tmp_path / "probe.json", tmp_path / "measured.json"
    probe.write_text(json.dumps(three_tier_probe()))
    measured.write_text(json.dumps({"rows": measured_rows({"ours_zero_topo": 2.0, "ours_hsdp": 3.0})}))
    assert tm.main(["--planner", str(measured), "--probe", str(probe), "--markdown"]) == 0
    out = capsys.readouterr().out
    assert "Planner on 2x2x2, accumulation 4, bf16" in out and "The planner picks * ours_zero_topo" in out
    assert tm.main(["--probe", str(probe)]) == 2  # a probe alone says nothing
