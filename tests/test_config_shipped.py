"""Every shipped config loads (alone and combined), GPT-NeoX's samples load or are refused clearly,
the generated reference is current, and the JSON round trip is exact."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from megatron.config import (ConfigError, config_from_dict, config_to_dict, load_config, load_config_json,
                             save_config_json, world_size_of)
from megatron.config.docs import render

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
NEOX_SAMPLES = REPO.parent / "shared" / "external" / "gpt-neox" / "configs"
PRESETS = ["ddp.yml", "zero1.yml", "zero2.yml", "zero3.yml", "hsdp.yml", "zeropp.yml", "zero_topo.yml",
           "zero_topo_paper.yml"]


def load(*names: str, env=None, overrides=()):
    return load_config([str(CONFIGS / n) for n in names], list(overrides), env=env or {}, notices=[])


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yml")))
def test_every_shipped_config_loads_alone(name):
    cfg = load(name)
    assert cfg.zero.resolved_factors is not None and cfg.training.train_batch_size >= 1


@pytest.mark.parametrize("sim,world", [("sim-2x2x2.yml", 8), ("sim-2x2.yml", 4)])
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("tiny", ["tiny-cpu.yml", "tiny-llama-cpu.yml"])
def test_tiny_cpu_combines_with_each_layout_and_preset(tiny, sim, world, preset):
    cfg = load(tiny, sim, preset)
    assert world_size_of(cfg) == world
    t = cfg.training
    assert t.train_batch_size == 32 and t.train_batch_size == t.train_micro_batch_size_per_gpu * t.gradient_accumulation_steps * world


def test_tiny_cpu_is_the_single_process_reference():
    cfg = load("tiny-cpu.yml")
    m = cfg.model
    assert 2 <= m.num_layers <= 4 and 128 <= m.hidden_size <= 256 and m.num_attention_heads == 4
    assert (m.seq_length, m.rotary_pct, m.gpt_j_residual, m.no_weight_tying) == (128, 0.5, True, True)
    assert (cfg.training.train_batch_size, cfg.training.train_micro_batch_size_per_gpu) == (32, 4)
    assert cfg.training.gradient_accumulation_steps == 8 and cfg.precision.precision == "fp32"
    assert world_size_of(cfg) == 1 and cfg.zero.resolved_factors == [1, 1, 1]
    text = (CONFIGS / "tiny-cpu.yml").read_text()
    assert "topology" not in text and "zero_optimization" not in text


def test_tiny_llama_cpu_is_tiny_cpu_with_a_llama_block():
    """Everything but the model keys is tiny-cpu.yml's, so the two runs compare block for block."""
    llama, neox = load("tiny-llama-cpu.yml"), load("tiny-llama-cpu.yml".replace("-llama", ""))
    m = llama.model
    assert (m.norm, m.activation, m.num_kv_heads, m.gpt_j_residual, m.use_bias_in_attn_linear, m.use_bias_in_mlp) == \
        ("rmsnorm", "swiglu", 2, False, False, False)
    for group in ("optimizer", "lr_schedule", "training", "precision", "data", "tokenizer"):
        assert getattr(llama, group) == getattr(neox, group), group


def test_paper_zero_topo_preset_quantizes_all_but_the_cross_hop():
    """configs/zero_topo_paper.yml: INT8 gathers and refresh, INT4 in-node hops, and the cross hop an
    unquantized all-reduce, as the engine (QuantSpec) and the models (comm_spec_from_config) see it."""
    from megatron.analytic.comm_model import step_collectives
    from megatron.topology.names import ALL_REDUCE
    from megatron.analytic.model_inputs import comm_spec_from_config
    from megatron.engine.quantized import QuantSpec
    cfg = load("tiny-cpu.yml", "sim-2x2x2.yml", "zero_topo_paper.yml")
    assert (cfg.zero.resolved_preset, cfg.zero.resolved_factors) == ("zero_topo", [2, 4, 8])
    quant = QuantSpec.from_config(cfg.zero)
    assert (quant.weight_gather_bits, quant.grad_reduce_bits, quant.cross_node_grad_bits, quant.refresh_bits) == (8, 4, 0, 8)
    spec = comm_spec_from_config(cfg, 512)
    assert spec.cross_node_reduction == "all_reduce" and spec.quant.cross_node_grad_bits == 0
    cross = [c for c in step_collectives(spec) if c.phase == "cross_grad_reduce"]
    assert cross and all((c.op, c.bits, c.elem_bytes) == (ALL_REDUCE, 0, 4) for c in cross)
    assert config_from_dict(json.loads(json.dumps(config_to_dict(cfg)))) == cfg


def test_paper_models_and_frontier():
    big = load("20B.yml", "local_setup.yml", "frontier.yml", "zero_topo.yml", env={"SLURM_JOB_NUM_NODES": "48"})
    m = big.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length, m.rotary_pct) == (44, 6144, 64, 2048, 0.25)
    assert m.gpt_j_residual and m.no_weight_tying and m.padded_vocab_size == 50304
    assert (big.optimizer.lr, big.lr_schedule.min_lr, big.optimizer.betas) == (0.97e-4, 0.97e-5, [0.9, 0.95])
    assert big.lr_schedule.warmup_iters == 1500 and big.precision.precision == "bfloat16"
    assert big.topology.layout == [48, 4, 2] and big.zero.resolved_factors == [2, 8, 384]
    assert big.launcher.launcher == "slurm"
    ten = load("10B.yml")
    assert (ten.model.num_layers, ten.model.hidden_size, ten.model.num_attention_heads) == (36, 4608, 36)


@pytest.mark.parametrize("name", ["10B.yml", "20B.yml", "local_setup.yml", "tiny-cpu.yml", "tiny-llama-cpu.yml",
                                  "llama2-7B.yml", "mistral-7B.yml"] + PRESETS)
def test_only_frontier_and_sim_configs_carry_topology(name):
    assert "topology" not in (CONFIGS / name).read_text()


def _neox_samples() -> list[str]:
    if not NEOX_SAMPLES.is_dir():
        return []
    return sorted(str(p.relative_to(NEOX_SAMPLES)) for p in NEOX_SAMPLES.rglob("*.yml"))


needs_samples = pytest.mark.skipif(not NEOX_SAMPLES.is_dir(), reason=f"GPT-NeoX sample configs not found at {NEOX_SAMPLES}")
REFUSED_SAMPLES = {"20B.yml": "pipe_parallel_size: 4", "pythia/12B.yml": "model_parallel_size: 4"}
# The Llama family's samples load with GPT-NeoX's meaning of their keys (issue 40), but for
# mistral/7B.yml, whose intermediate_size builds (in GPT-NeoX as here) an up+gate projection whose
# halves (4779) do not match the inner width (4778): refused in one line naming the key to change.
LLAMA_REFUSED = {"mistral/7B.yml": r"intermediate_size: 14336 with activation swiglu .* halves \(4779\) do not match "
                                   r"the inner width 4778 .*; set intermediate_size to 3 x the SwiGLU width you want"}


@needs_samples
@pytest.mark.parametrize("name", _neox_samples() or ["none"])
def test_gpt_neox_samples_load_or_are_refused_for_tensor_or_pipeline_parallelism(name):
    path = str(NEOX_SAMPLES / name)
    if name in LLAMA_REFUSED:
        with pytest.raises(ConfigError, match=LLAMA_REFUSED[name]) as err:
            load_config([path], env={}, notices=[])
        assert "\n" not in str(err.value)
        return
    if name in REFUSED_SAMPLES:
        with pytest.raises(ConfigError, match=REFUSED_SAMPLES[name] + r" is not accepted .*ZeRO-topo shards instead") as err:
            load_config([path], env={}, notices=[])
        assert "\n" not in str(err.value)
        return
    cfg = load_config([path], env={}, notices=[])
    assert world_size_of(cfg) == 1


@needs_samples
def test_gpt_neox_sample_combination_like_its_readme():
    notices: list = []
    cfg = load_config([str(NEOX_SAMPLES / "125M.yml"), str(NEOX_SAMPLES / "local_setup.yml")], env={}, notices=notices)
    assert cfg.data.data_path == "data/enwik8/enwik8_text_document" and cfg.precision.precision == "fp16"
    assert cfg.zero.resolved_preset == "stage1" and cfg.lr_schedule.warmup_iters == 3200
    assert any("partition_activations" in n for n in notices)
    assert len(notices) == len(set(notices))


def test_json_round_trip_is_exact(tmp_path):
    cfg = load("tiny-cpu.yml", "sim-2x2x2.yml", "zero_topo.yml", overrides=["optimizer.params.eps=1e-7"])
    again = config_from_dict(json.loads(json.dumps(config_to_dict(cfg))))
    assert again == cfg
    path = save_config_json(cfg, tmp_path / "run" / "config.json")
    assert load_config_json(path) == cfg
    assert [p.name for p in path.parent.iterdir()] == ["config.json"]  # no temp file left behind


def test_serialized_config_with_unknown_fields_is_refused(tmp_path):
    data = config_to_dict(load("tiny-cpu.yml"))
    data["model"]["num_layerz"] = 3
    with pytest.raises(ConfigError, match="unknown field"):
        config_from_dict(data)
    with pytest.raises(ConfigError, match="config JSON not found"):
        load_config_json(tmp_path / "missing.json")


def test_dataclass_replace_keeps_working_for_train_py():
    cfg = load("tiny-cpu.yml")
    padded = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, padded_vocab_size=4096))
    assert padded.model.padded_vocab_size == 4096 and cfg.model.padded_vocab_size is None


def test_docs_config_md_is_current():
    committed = (REPO / "docs" / "config.md").read_text()
    assert committed == render(), "docs/config.md is stale: run `python -m megatron.config.docs > docs/config.md`"
