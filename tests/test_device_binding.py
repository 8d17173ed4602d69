"""GCD-pair check: device-index parsing, KFD topology reading, the pair rule and the start-up hook.

Everything runs on CPU: KFD sysfs trees are written under tmp_path, and the hook is shown to do
nothing (no collective) when the device is not a ROCm GPU.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatron.runtime import Runtime
from megatron.topology import device_binding
from megatron.topology.device_binding import (
    check_gcd_pairs,
    frontier_mates,
    gcd_pair_warnings,
    package_mates_from_kfd,
    physical_device_index,
    warn_if_gcd_pairs_broken,
)

# Where `srun -c7 --gpus-per-task=1 --gpu-bind=closest` puts local ranks 0..7 on a Frontier node.
CLOSEST = [4, 5, 2, 3, 6, 7, 0, 1]
MAP_GPU_EVEN_ODD = [0, 2, 4, 6, 1, 3, 5, 7]  # --gpu-bind=map_gpu:0,2,4,6,1,3,5,7
CPU_NODES, GPU_NODES = 4, 8


def _physical_under_slurm(binding: list[int], nodes: int) -> list:
    """Each task sees one device (index 0) and Slurm names its physical GPU in ROCR_VISIBLE_DEVICES."""
    return [physical_device_index({"ROCR_VISIBLE_DEVICES": str(gpu)}, 0)
            for _ in range(nodes) for gpu in binding]


def _write_kfd(root, weight) -> str:
    """4 CPU nodes (no SIMDs), then 8 GPU nodes; weight(i, j) is the GPU i -> GPU j link weight.

    Every GPU also links to CPU node 0 with weight 10 (lighter than any XGMI link), which must be
    ignored: only GPU peers can be package mates.
    """
    for node in range(CPU_NODES + GPU_NODES):
        folder = root / str(node)
        (folder / "io_links").mkdir(parents=True)
        simd = 0 if node < CPU_NODES else 440
        (folder / "properties").write_text(f"cpu_cores_count {64 if simd == 0 else 0}\n"
                                           f"simd_count {simd}\nmax_waves_per_simd 8\n")
        if simd == 0:
            continue
        links = [(0, 2, 10)] + [(CPU_NODES + j, 11, weight(node - CPU_NODES, j))
                                for j in range(GPU_NODES) if j != node - CPU_NODES]
        for k, (to, kind, w) in enumerate(links):
            (folder / "io_links" / str(k)).mkdir()
            (folder / "io_links" / str(k) / "properties").write_text(
                f"type {kind}\nversion_major 0\nnode_from {node}\nnode_to {to}\nweight {w}\n"
                f"min_latency 0\nmax_bandwidth 50000\n")
    return str(root)


def _mi250x_weight(i: int, j: int) -> int:
    if i ^ 1 == j:
        return 15                                   # the in-package XGMI link
    return 30 if i // 4 == j // 4 else 45           # one or two XGMI hops away


# -- physical_device_index ------------------------------------------------------------------------
@pytest.mark.parametrize("env, current, want", [
    ({}, 3, 3),                                                       # nothing set: the device itself
    ({"ROCR_VISIBLE_DEVICES": "4"}, 0, 4),                            # Slurm's one-GPU binding
    ({"ROCR_VISIBLE_DEVICES": "4,5"}, 1, 5),
    ({"HIP_VISIBLE_DEVICES": "2"}, 0, 2),
    ({"CUDA_VISIBLE_DEVICES": "6, 7"}, 1, 7),
    ({"HIP_VISIBLE_DEVICES": "1", "CUDA_VISIBLE_DEVICES": "0,5"}, 0, 1),  # HIP's own name wins
    ({"ROCR_VISIBLE_DEVICES": "4,5,6", "HIP_VISIBLE_DEVICES": "2"}, 0, 6),  # HIP picks from ROCr's
    ({"ROCR_VISIBLE_DEVICES": ""}, 2, 2),                             # empty counts as unset
    ({"ROCR_VISIBLE_DEVICES": "GPU-5f3a9c2e41d7b8a0"}, 0, None),      # UUIDs name no index
    ({"CUDA_VISIBLE_DEVICES": "GPU-1d2e,GPU-77aa"}, 1, None),
    ({"ROCR_VISIBLE_DEVICES": "x,y"}, 0, None),
    ({"ROCR_VISIBLE_DEVICES": "3"}, 1, None),                         # fewer entries than devices
])
def test_physical_device_index(env, current, want):
    assert physical_device_index(env, current) == want


# -- check_gcd_pairs ----------------------------------------------------------------------------
def test_closest_binding_on_two_nodes_passes():
    physical = _physical_under_slurm(CLOSEST, nodes=2)
    assert physical == CLOSEST * 2
    assert check_gcd_pairs(physical, 8, frontier_mates(range(8))) == []


def test_map_gpu_binding_warns_naming_the_broken_pairs():
    physical = _physical_under_slurm(MAP_GPU_EVEN_ODD, nodes=2)
    lines = check_gcd_pairs(physical, 8, frontier_mates(range(8)))
    text = "\n".join(lines)
    for node, base in ((0, 0), (1, 8)):
        node_line = next(line for line in lines if line.startswith(f"node {node}:"))
        for k, (a, b) in enumerate(zip(MAP_GPU_EVEN_ODD[::2], MAP_GPU_EVEN_ODD[1::2])):
            assert f"ranks {base + 2 * k},{base + 2 * k + 1} on GPUs {a},{b}" in node_line
    assert "--gpu-bind=closest" in text and "--distribution=block" in text
    assert "could not be checked" not in text


def test_only_the_broken_pair_is_named():
    physical = list(CLOSEST)
    physical[6], physical[7] = physical[7], physical[6]  # (1, 0): still one package, order aside
    assert check_gcd_pairs(physical, 8, frontier_mates(range(8))) == []
    physical = [4, 5, 2, 6, 3, 7, 0, 1]
    lines = check_gcd_pairs(physical, 8, frontier_mates(range(8)))
    assert "ranks 2,3 on GPUs 2,6" in lines[1] and "ranks 4,5 on GPUs 3,7" in lines[1]
    assert "ranks 0,1" not in lines[1] and "ranks 6,7" not in lines[1]


def test_unknown_devices_give_one_could_not_be_checked_line():
    lines = check_gcd_pairs([None] * 16, 8, frontier_mates(range(8)))
    assert len(lines) == 1 and "could not be checked" in lines[0] and "8 of 8" in lines[0]
    assert check_gcd_pairs(CLOSEST, 8, {}) == [lines[0].replace("8 of 8", "4 of 4")]


def test_many_broken_nodes_are_capped():
    lines = check_gcd_pairs(MAP_GPU_EVEN_ODD * 20, 8, frontier_mates(range(8)))
    assert sum(line.startswith("node ") for line in lines) == device_binding.MAX_NODE_LINES
    assert any("12 more node(s)" in line for line in lines)


def test_bad_node_shape_is_refused():
    with pytest.raises(ValueError):
        check_gcd_pairs(CLOSEST, 3, {})
    with pytest.raises(ValueError):
        check_gcd_pairs(CLOSEST[:6], 8, {})


# -- package_mates_from_kfd -----------------------------------------------------------------------
def test_kfd_mi250x_tree_gives_the_package_pairs(tmp_path):
    root = _write_kfd(tmp_path / "nodes", _mi250x_weight)
    assert package_mates_from_kfd(root) == frontier_mates(range(8))
    assert gcd_pair_warnings(CLOSEST * 2, [2, 4, 2], root) == []
    assert gcd_pair_warnings(MAP_GPU_EVEN_ODD, [1, 4, 2], root)


def test_kfd_gpu_order_is_node_number_order(tmp_path):
    # Pair GPU i with 7 - i; node folders 10 and 11 sort before 4 as strings, not as numbers.
    root = _write_kfd(tmp_path / "nodes", lambda i, j: 15 if i + j == 7 else 30)
    assert package_mates_from_kfd(root) == {i: 7 - i for i in range(8)}


def test_kfd_ties_give_no_mates(tmp_path):
    root = _write_kfd(tmp_path / "nodes", lambda i, j: 30)
    assert package_mates_from_kfd(root) == {}


def test_kfd_keeps_only_unique_mutual_mates(tmp_path):
    def weight(i, j):
        if {i, j} == {0, 1}:
            return 15
        if (i, j) in ((2, 1), (2, 3), (3, 2)):  # 2 ties between 1 and 3; 3 picks 2, 2 does not say
            return 20
        return 45
    assert package_mates_from_kfd(_write_kfd(tmp_path / "nodes", weight)) == {0: 1, 1: 0}


def test_kfd_missing_folder_gives_nothing_and_the_frontier_rule_applies(tmp_path):
    missing = str(tmp_path / "no_kfd_here")
    assert package_mates_from_kfd(missing) == {}
    assert gcd_pair_warnings(CLOSEST, [1, 4, 2], missing) == []
    assert any("ranks 0,1 on GPUs 0,2" in line
               for line in gcd_pair_warnings(MAP_GPU_EVEN_ODD, [1, 4, 2], missing))


# -- the start-up hook ----------------------------------------------------------------------------
@pytest.fixture
def no_collectives(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the GCD-pair hook attempted a collective")
    for name in ("all_gather", "all_gather_into_tensor", "get_backend", "is_initialized"):
        monkeypatch.setattr(dist, name, refuse)


FRONTIER_CFG = SimpleNamespace(topology=SimpleNamespace(layout=[2, 4, 2]))


@pytest.mark.parametrize("hip", [None, "6.2.41133"])
def test_hook_is_a_no_op_on_cpu(no_collectives, monkeypatch, capsys, hip):
    monkeypatch.setattr(torch.version, "hip", hip)
    runtime = Runtime(rank=0, world_size=16, local_rank=0, device=torch.device("cpu"))
    warn_if_gcd_pairs_broken(FRONTIER_CFG, runtime, env={"ROCR_VISIBLE_DEVICES": "0"})
    assert capsys.readouterr().err == ""


def test_hook_is_a_no_op_on_cuda(no_collectives, monkeypatch, capsys):
    monkeypatch.setattr(torch.version, "hip", None)
    runtime = Runtime(rank=0, world_size=16, local_rank=0, device=torch.device("cuda", 0))
    warn_if_gcd_pairs_broken(FRONTIER_CFG, runtime)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("layout, world", [(None, 1), ([2, 8], 16), ([2, 4, 1], 8), ([1, 4, 2], 1)])
def test_hook_skips_layouts_without_gcd_pairs_and_single_processes(no_collectives, monkeypatch,
                                                                    layout, world):
    monkeypatch.setattr(torch.version, "hip", "6.2.41133")
    cfg = SimpleNamespace(topology=SimpleNamespace(layout=layout))
    runtime = Runtime(rank=0, world_size=world, local_rank=0, device=torch.device("cuda", 0))
    warn_if_gcd_pairs_broken(cfg, runtime)
