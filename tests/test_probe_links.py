"""tools/probe_links.py: its line fit recovers known figures, and a real probe on 4 gloo ranks writes
a file the time model and tools/plan.py read."""
from __future__ import annotations

import json
import math
import sys

import pytest

from conftest import REPO
from dist_harness import run_ranks

sys.path.insert(0, str(REPO / "tools"))
import probe_links  # noqa: E402

from megatron.analytic.hardware import Hardware, PROBE_FORMAT  # noqa: E402


def test_the_fit_recovers_latency_and_bandwidth_from_exact_points():
    # seconds = steps x 20 us + load / 3 GB/s, three ring steps
    points = [(load, 3 * 20e-6 + load / 3e9) for load in (1e4, 1e5, 1e6, 4e6)]
    fit = probe_links.fit_line(points, steps=3)
    assert fit["bandwidth_gbs"] == pytest.approx(3.0)
    assert fit["latency_us"] == pytest.approx(20.0)


def test_noise_that_slopes_down_is_read_as_the_fastest_rate_and_the_mean_rest_as_latency():
    # slope: the fastest point's 2e6 bytes in 1 ms; intercept: the mean of what that rate leaves,
    # ((2 - 0.5) + (1 - 1)) / 2 ms = 0.75 ms, over 2 steps
    fit = probe_links.fit_line([(1e6, 2e-3), (2e6, 1e-3)], steps=2)
    assert fit["bandwidth_gbs"] == pytest.approx(2e6 / 1e-3 / 1e9)
    assert fit["latency_us"] == pytest.approx(375.0)


def test_band_groups_are_the_ranks_that_differ_in_one_digit():
    assert probe_links.band_groups((2, 2, 2), 0) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert probe_links.band_groups((2, 2, 2), 1) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert probe_links.band_groups((2, 2, 2), 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]


def _probe_rank(rank: int, world_size: int, out: str) -> dict | None:
    import torch
    args = probe_links.parse_args(["--layout", "2", "2", "--out", out, "--sizes-kb", "16", "128", "--repeats", "1",
                                   "--model", "1", "32", "2", "16", "64", "1", "--optimizer-elements", "20000"])
    return probe_links.run_probe(args, rank, torch.device("cpu"), "gloo", ["test"])


def _probe_one_device(rank: int, world_size: int, out: str) -> dict | None:
    import torch
    args = probe_links.parse_args(["--layout", "1", "1", "--out", out, "--repeats", "1",
                                   "--model", "1", "32", "2", "16", "64", "1", "--optimizer-elements", "20000"])
    return probe_links.run_probe(args, rank, torch.device("cpu"), "gloo", ["test"])


def test_a_probe_on_one_device_gives_its_rates_and_keeps_the_presets_links(tmp_path):
    out = tmp_path / "probe.json"
    data = run_ranks("test_probe_links:_probe_one_device", 1, tmp_path / "ranks", timeout_s=300, out=str(out))[0]
    assert data == json.loads(out.read_text()) and data["layout"] == [1, 1]
    assert data["tiers"] == {} and data["algorithms"] == {} and data["checks"] == [] and data["samples"] == []
    device = data["device"]
    assert set(device) == {"achieved_flops", "optimizer_elements_per_s", "quantize_elements_per_s", "copy_bytes_per_s"}
    assert all(v > 0 and math.isfinite(v) for v in device.values())
    topology = __import__("megatron.topology", fromlist=["Topology"]).Topology.simulated((2, 2))
    preset = Hardware.from_topology(topology, backend="nccl")
    hw = preset.with_probe(str(out), str(out))
    assert hw.links == preset.links and hw.device.overlap_efficiency == preset.device.overlap_efficiency
    assert hw.device.achieved_flops == device["achieved_flops"]
    assert hw.device.memory_bytes == preset.device.memory_bytes  # a CPU reports no device memory


def test_a_probe_on_four_ranks_feeds_the_time_model_and_the_planner(tmp_path, capsys):
    out = tmp_path / "probe.json"
    results = run_ranks("test_probe_links:_probe_rank", 4, tmp_path / "ranks", timeout_s=300, out=str(out))
    data = json.loads(out.read_text())
    assert results[0] == data and results[1] is None
    assert data["format"] == PROBE_FORMAT and data["layout"] == [2, 2] and data["backend"] == "gloo"
    # both tiers, every algorithm the engine runs on them (gloo: one-tier reduce-scatter = all-to-all + sum)
    assert set(data["tiers"]) == {"inter_node", "intra_node"}
    assert set(data["algorithms"]) == {"ring_allgather", "all_to_all_sum", "all_to_all", "ring_allreduce"}
    for per_tier in data["algorithms"].values():
        for fig in per_tier.values():
            assert fig["bandwidth_gbs"] > 0 and math.isfinite(fig["bandwidth_gbs"]) and fig["latency_us"] >= 0
    device = data["device"]
    assert device["achieved_flops"] > 0 and device["optimizer_elements_per_s"] > 0
    assert 0.0 <= device["overlap_efficiency"] <= 1.0
    assert set(device["overlap_by_tier"]) == {"inter_node", "intra_node"}
    assert all(0.0 <= e <= 1.0 for e in device["overlap_by_tier"].values())
    assert len(data["samples"]) == 3 * 4 * 2  # (two tiers' bands + the world ring) x ops x sizes
    # curves per shape: one rank per node (the cross / rail groups), the node, the world ring; every
    # engine algorithm on each, two points each (the sizes), in ascending step bytes
    assert set(data["curves"]["ring_allgather"]) == {"cross", "node", "world"}
    assert set(data["curves"]["all_to_all"]) == {"cross", "node", "world"}  # qgZ's two hops, and the world
    for per_shape in data["curves"].values():
        for curve in per_shape.values():
            steps = [c for c, _ in curve["points"]]
            assert steps == sorted(steps) and len(steps) == 2 and all(r > 0 for _, r in curve["points"])
    assert {c["group"] for c in data["checks"]} == {"world"}
    # the model reads it ...
    hw = Hardware.from_topology(__import__("megatron.topology", fromlist=["Topology"]).Topology.simulated((2, 2)),
                                backend="nccl").with_probe(str(out), str(out))
    assert hw.backend == "gloo" and hw.device.achieved_flops == device["achieved_flops"]
    assert hw.device.overlap("intra_node") == device["overlap_by_tier"]["intra_node"]
    fig = data["tiers"]["inter_node"]
    assert hw.link("ring_allgather", "inter_node").bandwidth == pytest.approx(fig["bandwidth_gbs"] * 1e9)
    world = data["curves"]["ring_allgather"]["world"]["points"]
    assert hw.curve("ring_allgather", "world").bandwidth(world[0][0]) == pytest.approx(world[0][1] * 1e9)
    # ... and so does the planner's command line
    import plan as plan_cli
    code = plan_cli.main([str(REPO / "configs" / "tiny-cpu.yml"), "--topology", "sim", "--layout", "2", "2",
                          "--probe", str(out), "--top", "2", "--set", "vocab_size=512"])
    captured = capsys.readouterr()
    text = captured.out
    assert code == 0 and f"figures probe {out}" in text and "best:" in text, (code, captured.err, text)
