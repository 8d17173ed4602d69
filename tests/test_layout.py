"""ShardLayout (megatron/topology/layout.py), the one source of the shard layout: preset factors,
chunk indices, group ranks and the padding quantum against hand-written tables; its refusals; and
every reader of a config (validation, the engine's groups, the comm model, the dry run) agreeing."""
from __future__ import annotations

import ast
import re
from dataclasses import fields

import pytest

from conftest import REPO
from megatron.config import ConfigError, load_config
from megatron.config.schema import ZeroConfig
from megatron.dry_run import render_dry_run
from megatron.launch.launcher import plan_launch
from megatron.topology import ProcessGroups, ShardChunks, ShardFactors, ShardLayout, Topology, TopologyError
from megatron.topology.layout import NAMED_PRESETS, STAGE_PRESETS, display_name, preset_of_display_name
from megatron.analytic.comm_model import CommModelError, CommSpec, groups_of_kind
from megatron.analytic.model_inputs import comm_spec_from_config

# (w, g, os) of every preset, by hand from docs/engine.md "Presets": N ranks, R per node, f the
# fastest tier's size; stage k, hsdp = (R, R, R), zero_topo = (f, R, N), zeropp = (N, N, N).
PRESET_FACTORS = {
    (2, 2, 2): {"stage0": (1, 1, 1), "stage1": (1, 1, 8), "stage2": (1, 8, 8), "stage3": (8, 8, 8),
                "hsdp": (4, 4, 4), "zero_topo": (2, 4, 8), "zeropp": (8, 8, 8)},
    (2, 4): {"stage0": (1, 1, 1), "stage1": (1, 1, 8), "stage2": (1, 8, 8), "stage3": (8, 8, 8),
             "hsdp": (4, 4, 4), "zero_topo": (4, 4, 8), "zeropp": (8, 8, 8)},
    (1, 8): {"stage0": (1, 1, 1), "stage1": (1, 1, 8), "stage2": (1, 8, 8), "stage3": (8, 8, 8),
             "hsdp": (8, 8, 8), "zero_topo": (8, 8, 8), "zeropp": (8, 8, 8)},
    (48, 4, 2): {"stage0": (1, 1, 1), "stage1": (1, 1, 384), "stage2": (1, 384, 384), "stage3": (384, 384, 384),
                 "hsdp": (8, 8, 8), "zero_topo": (2, 8, 384), "zeropp": (384, 384, 384)},
}
# (world size, ranks per node, fastest tier, nodes)
SIZES = {(2, 2, 2): (8, 4, 2, 2), (2, 4): (8, 4, 4, 2), (1, 8): (8, 8, 8, 1), (48, 4, 2): (384, 8, 2, 48)}


@pytest.mark.parametrize("tiers", list(PRESET_FACTORS))
def test_every_preset_on_every_layout(tiers):
    for preset, factors in PRESET_FACTORS[tiers].items():
        layout = ShardLayout.resolve(tiers, preset=preset)
        assert (layout.preset, layout.factors.as_tuple(), layout.hpz) == (preset, factors, preset == "zeropp")
        assert (layout.world_size, layout.ranks_per_node, layout.fastest_tier_size, layout.num_nodes) == SIZES[tiers]
    for stage in range(4):
        assert ShardLayout.resolve(tiers, stage=stage) == ShardLayout.resolve(tiers, preset=f"stage{stage}")
    custom = ShardLayout.resolve(tiers, stage=3, preset="hsdp", shard_factors=[1, 1, 1])  # factors win
    assert (custom.preset, custom.factors) == ("custom", ShardFactors(1, 1, 1))


# (tiers, preset, rank): (weight chunk of S/w, gradient chunk of S/g, optimizer chunk of S/os)
CHUNKS = {
    ((2, 2, 2), "zero_topo", 1): (1, 2, 4), ((2, 2, 2), "zero_topo", 5): (1, 2, 5),  # docs/engine.md
    ((2, 2, 2), "zero_topo", 2): (0, 1, 2), ((2, 2, 2), "zero_topo", 7): (1, 3, 7),
    ((2, 2, 2), "hsdp", 6): (2, 2, 2),
    ((2, 4), "zero_topo", 2): (2, 2, 4), ((2, 4), "zero_topo", 5): (1, 1, 3), ((2, 4), "zero_topo", 7): (3, 3, 7),
    ((1, 8), "stage2", 5): (0, 5, 5), ((1, 8), "stage1", 3): (0, 0, 3),
    ((48, 4, 2), "zero_topo", 0): (0, 0, 0), ((48, 4, 2), "zero_topo", 1): (1, 4, 192),
    ((48, 4, 2), "zero_topo", 9): (1, 4, 193), ((48, 4, 2), "zero_topo", 10): (0, 1, 49),
    ((48, 4, 2), "zero_topo", 383): (1, 7, 383), ((48, 4, 2), "hsdp", 13): (5, 5, 5),
}


@pytest.mark.parametrize("key", list(CHUNKS), ids=[f"{t}-{p}-r{r}" for t, p, r in CHUNKS])
def test_chunk_indices_of_a_rank(key):
    tiers, preset, rank = key
    assert ShardLayout.resolve(tiers, preset=preset).chunks(rank) == ShardChunks(*CHUNKS[key])


def test_group_ranks_of_a_rank():
    eight = ShardLayout.resolve((2, 2, 2), preset="zero_topo")
    assert {kind: eight.group(kind, 5) for kind in ("weight", "stride", "cross", "replica", "node", "rail")} == {
        "weight": (4, 5), "stride": (5, 7), "cross": (1, 5), "replica": (5,), "node": (4, 5, 6, 7), "rail": (1, 5)}
    assert eight.group("world", 3) == tuple(range(8))
    big = ShardLayout.resolve((48, 4, 2), preset="zero_topo")
    assert big.group("weight", 9) == (8, 9) and big.group("stride", 9) == (9, 11, 13, 15)
    assert big.group("cross", 9) == tuple(range(1, 384, 8)) and big.group("replica", 9) == (9,)
    hsdp = ShardLayout.resolve((2, 2, 2), preset="hsdp")
    assert hsdp.group("replica", 6) == (2, 6) and hsdp.group("stride", 6) == (6,)


def test_padding_quantum_and_padded_size():
    eight = ShardLayout.resolve((2, 2, 2), preset="stage0")
    assert (eight.padding_quantum(), eight.padding_quantum(256)) == (8, 2048)
    assert [eight.padded_size(n) for n in (1, 100, 104, 105)] == [8, 104, 104, 112]
    assert [eight.padded_size(n, 256) for n in (1, 2048, 2049)] == [2048, 2048, 4096]
    assert ShardLayout.resolve((2, 2), preset="zero_topo").padding_quantum(24) == 96
    big = ShardLayout.resolve((48, 4, 2), preset="zero_topo")
    assert (big.padding_quantum(), big.padding_quantum(256)) == (384, 98_304)
    assert big.padded_size(50_304 * 6144) == 50_304 * 6144  # the 20B embedding: 50,304 = 131 x 384
    assert big.padded_size(1, 256) == 98_304


@pytest.mark.parametrize("factors, fails", [
    ([4, 2, 8], "w=4 does not divide g=2"), ([2, 4, 6], "g=4 does not divide os=6"),
    ([1, 1, 16], "os=16 does not divide N=8"),
])
def test_factors_that_do_not_nest_name_the_failing_pair(tmp_path, factors, fails):
    with pytest.raises(TopologyError, match=re.escape(fails)):
        ShardLayout.resolve((2, 2, 2), shard_factors=factors)
    path = tmp_path / "c.yml"
    path.write_text(f"train_micro_batch_size_per_gpu: 1\ntopology: {{simulate: [2, 2, 2]}}\n"
                    f"zero_optimization: {{shard_factors: {factors}}}\n")
    with pytest.raises(ConfigError, match=r"^zero_optimization\.shard_factors: .*" + re.escape(fails)):
        load_config([str(path)], env={}, notices=[])


def test_refusals():
    with pytest.raises(TopologyError, match="unknown ZeRO preset 'zero4'"):
        ShardLayout.resolve((2, 2, 2), preset="zero4")
    with pytest.raises(TopologyError, match=r"stage must be 0, 1, 2 or 3, got 4"):
        ShardLayout.resolve((2, 2, 2), stage=4)
    with pytest.raises(TopologyError, match=r"preset stage3 on layout \[2, 2, 2\] means"):
        ShardLayout((2, 2, 2), ShardFactors(2, 4, 8), "stage3")
    with pytest.raises(TopologyError, match="2 or 3 positive tier sizes"):
        ShardLayout.resolve((8,), stage=0)
    with pytest.raises(TopologyError, match="positive integers"):
        ShardLayout.resolve((2, 2, 2), shard_factors=[2, 4])
    with pytest.raises(TopologyError, match="outside a layout of 8"):
        ShardLayout.resolve((2, 2, 2), stage=0).chunks(8)
    with pytest.raises(CommModelError, match="must be a ShardLayout"):  # the comm model takes the one layout
        CommSpec((100,), (2, 2, 2))


def test_the_config_preset_key_accepts_the_layouts_named_presets():
    preset = next(f for f in fields(ZeroConfig) if f.name == "preset")
    assert set(preset.metadata["choices"]) == set(NAMED_PRESETS)


def test_display_names_are_the_config_files_of_the_presets():
    """One stage-to-name table (layout.STAGE_DISPLAY_NAMES), read by the logs (run_history) and the
    benchmarks (comm_volume): each display name is the configs/<name>.yml that selects the preset."""
    for preset in STAGE_PRESETS + NAMED_PRESETS:
        name = display_name(preset)
        assert preset_of_display_name(name) == preset
        cfg = load_config([str(REPO / "configs" / "sim-2x2x2.yml"), str(REPO / "configs" / f"{name}.yml")],
                          notices=[])
        assert ShardLayout.from_config(cfg).preset == preset
    assert [display_name(p) for p in STAGE_PRESETS] == ["ddp", "zero1", "zero2", "zero3"]


def test_no_analytic_model_imports_the_engine():
    """The models check the engine's byte ledger and memory: they may share the layout and the
    names, never the engine's code (nor the quantization kernels)."""
    for path in sorted((REPO / "megatron" / "analytic").glob("*.py")):
        tree = ast.parse(path.read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        bad = {m for m in imported if m == "megatron.engine" or m.startswith(("megatron.engine.", "megatron.ops"))}
        assert not bad, f"{path.name} imports {sorted(bad)}"


# ------------------------------------------------------------- every reader of a config agrees

SLURM_48 = {"SLURM_JOB_ID": "777", "SLURM_JOB_NUM_NODES": "48", "SLURM_JOB_NODELIST": "frontier[1-48]",
            "SLURM_GPUS_ON_NODE": "8"}
# (config files, overrides, environment): (resolved_preset, factors), by hand
CONFIGS = [
    (["sim-2x2x2.yml", "ddp.yml"], [], {}, ("stage0", (1, 1, 1))),
    (["sim-2x2x2.yml", "zero1.yml"], [], {}, ("stage1", (1, 1, 8))),
    (["sim-2x2x2.yml", "zero2.yml"], [], {}, ("stage2", (1, 8, 8))),
    (["sim-2x2x2.yml", "zero3.yml"], [], {}, ("stage3", (8, 8, 8))),
    (["sim-2x2x2.yml", "hsdp.yml"], [], {}, ("hsdp", (4, 4, 4))),
    (["sim-2x2x2.yml", "zeropp.yml"], [], {}, ("zeropp", (8, 8, 8))),
    (["sim-2x2x2.yml", "zero_topo.yml"], [], {}, ("zero_topo", (2, 4, 8))),
    (["sim-2x2.yml", "zero_topo.yml"], [], {}, ("zero_topo", (2, 2, 4))),
    (["sim-2x2.yml", "hsdp.yml"], ["zero_optimization.zero_quantized_gradients=true"], {}, ("hsdp", (2, 2, 2))),
    (["sim-2x2x2.yml"], ["zero_optimization.shard_factors=[1,2,4]"], {}, ("custom", (1, 2, 4))),
    (["sim-2x2x2.yml", "zero3.yml"], ["zero_optimization.zero_hpz_partition_size=4"], {}, ("zeropp", (8, 8, 8))),
    (["20B.yml", "frontier.yml", "zero_topo.yml", "local_setup.yml"], [], SLURM_48, ("zero_topo", (2, 8, 384))),
]


@pytest.mark.parametrize("files, overrides, env, expected", CONFIGS,
                         ids=["+".join(f.removesuffix(".yml") for f in c[0]) + ("+" + c[1][0] if c[1] else "") for c in CONFIGS])
def test_validation_groups_comm_model_and_dry_run_agree(files, overrides, env, expected):
    base = [] if files[0] == "20B.yml" else ["tiny-cpu.yml"]
    cfg = load_config([str(REPO / "configs" / f) for f in base + files], overrides, env=env, notices=[])
    layout = ShardLayout.from_config(cfg)
    preset, factors = expected
    assert (layout.preset, layout.factors.as_tuple()) == expected
    assert (cfg.zero.resolved_preset, cfg.zero.resolved_factors) == (preset, list(factors))

    topology = Topology.from_config(cfg, layout.world_size)
    spec = comm_spec_from_config(cfg, 512)
    assert spec.layout == layout and spec.factors == factors and spec.layout.hpz == (preset == "zeropp")
    for rank in sorted({0, 1, layout.world_size // 2 + 1, layout.world_size - 1}):
        groups = ProcessGroups(topology, layout, rank, create=False)  # the same layout object, passed on
        assert groups.layout is layout
        for kind in ("weight", "stride", "cross", "replica", "node", "rail", "world"):
            assert getattr(groups, kind).ranks == layout.group(kind, rank), (kind, rank)
            if layout.world_size <= 8:  # the comm model's own statement of the groups
                assert list(layout.group(kind, rank)) in groups_of_kind(kind, spec), (kind, rank)

    plan = plan_launch(cfg, "train.py", "neox_config.json", env=env)
    text = render_dry_run(cfg, plan, env, None)
    said = re.search(r"^sharding: (\S+), \(w, g, os\) = \((\d+), (\d+), (\d+)\) on N = (\d+)$", text, re.M)
    assert said, text
    assert (said.group(1), tuple(int(x) for x in said.group(2, 3, 4))) == expected
    assert int(said.group(5)) == layout.world_size


def test_engine_records_the_layout_it_was_built_on():
    """One process: the engine's layout, the checkpoint's factors and preset are the config's."""
    import torch

    from megatron.config.schema import NeoXConfig
    from megatron.engine import lm_loss
    from megatron.model import GPTNeoX
    from megatron.engine.setup import engine_from_config

    cfg = NeoXConfig()
    cfg.model.num_layers, cfg.model.hidden_size, cfg.model.no_weight_tying = 1, 32, True
    cfg.zero.stage, cfg.training.gradient_accumulation_steps = 2, 1
    torch.manual_seed(0)
    engine = engine_from_config(cfg, GPTNeoX(cfg.model, 64), lm_loss, world_size=1)
    assert engine.layout == ShardLayout.from_config(cfg) == ShardLayout.from_topology(
        Topology.single_node(1), preset="stage2")
    assert [u.size for u in engine.units] == [engine.layout.padded_size(u.numel) for u in engine.units]
    state = engine.checkpoint_state()
    assert (state["factors"], state["preset"]) == ([1, 1, 1], "stage2")
