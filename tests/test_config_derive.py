"""Values derived once at validation: batch triple, padded vocab, warmup, precision, layout, factors."""
from __future__ import annotations

import pytest

from megatron.config import ConfigError, load_config, pad_vocab_size, world_size_of


def load(tmp_path, text: str, overrides=(), env=None):
    path = tmp_path / "c.yml"
    path.write_text(text)
    return load_config([str(path)], list(overrides), env=env or {}, notices=[])


def triple(cfg):
    t = cfg.training
    return t.train_batch_size, t.train_micro_batch_size_per_gpu, t.gradient_accumulation_steps


@pytest.mark.parametrize("text,layout,expected", [
    ("train_batch_size: 32\ntrain_micro_batch_size_per_gpu: 4\n", None, (32, 4, 8)),
    ("train_batch_size: 32\ntrain_micro_batch_size_per_gpu: 4\n", "[2, 2, 2]", (32, 4, 1)),
    ("train_batch_size: 32\ntrain_micro_batch_size_per_gpu: 4\n", "[2, 2]", (32, 4, 2)),
    ("train_batch_size: 48\ngradient_accumulation_steps: 3\n", "[2, 2]", (48, 4, 3)),
    ("train_micro_batch_size_per_gpu: 2\ngradient_accumulation_steps: 3\n", "[2, 2, 2]", (48, 2, 3)),
    ("train_batch_size: 16\n", "[2, 2]", (16, 4, 1)),
    ("train_micro_batch_size_per_gpu: 5\n", "[2, 2]", (20, 5, 1)),
    ("train_batch_size: 64\ntrain_micro_batch_size_per_gpu: 4\ngradient_accumulation_steps: 2\n", "[2, 2, 2]", (64, 4, 2)),
])
def test_batch_triple_any_two_give_the_third_with_dp_equal_to_world_size(tmp_path, text, layout, expected):
    overrides = [f"topology.simulate={layout}"] if layout else []
    assert triple(load(tmp_path, text, overrides)) == expected


@pytest.mark.parametrize("text,layout,match", [
    ("train_batch_size: 30\ntrain_micro_batch_size_per_gpu: 4\n", None, r"30 is not a multiple of train_micro_batch_size_per_gpu 4"),
    ("train_batch_size: 32\ntrain_micro_batch_size_per_gpu: 4\n", "[3, 1]", r"not a multiple of .* data-parallel size 3"),
    ("train_batch_size: 32\ntrain_micro_batch_size_per_gpu: 4\ngradient_accumulation_steps: 2\n", "[2, 2, 2]",
     r"train_batch_size: 32 != train_micro_batch_size_per_gpu 4 x gradient_accumulation_steps 2 x data-parallel size 8 = 64"),
    ("train_batch_size: 32\ntrain_micro_batch_size_per_gpu: 4\ngradient_accumulation_steps: 2\n", None,
     r"32 != .* = 8"),
])
def test_batch_triple_errors_name_the_numbers(tmp_path, text, layout, match):
    overrides = [f"topology.simulate={layout}"] if layout else []
    with pytest.raises(ConfigError, match=match):
        load(tmp_path, text, overrides)


def test_no_batch_key_falls_back_to_micro_batch_one_with_a_notice(tmp_path):
    notices: list = []
    path = tmp_path / "c.yml"
    path.write_text("num_layers: 2\n")
    cfg = load_config([str(path)], env={}, notices=notices)
    assert triple(cfg) == (1, 1, 1)
    assert any("train_micro_batch_size_per_gpu 1" in n for n in notices)


def test_golden_padded_vocab_and_warmup_of_20b(tmp_path):
    cfg = load(tmp_path, "train_micro_batch_size_per_gpu: 1\nvocab_size: 50277\nmake_vocab_size_divisible_by: 128\n"
                         "train_iters: 150000\nlr_decay_iters: 150000\nwarmup: 0.01\n")
    assert cfg.model.padded_vocab_size == 50304
    assert cfg.lr_schedule.warmup_iters == 1500
    assert pad_vocab_size(50277, 128) == 50304 and pad_vocab_size(50304, 128) == 50304 and pad_vocab_size(1, 8) == 8


def test_padded_vocab_only_when_known_without_files(tmp_path):
    assert load(tmp_path, "train_micro_batch_size_per_gpu: 1\nvocab_file: x.json\n").model.padded_vocab_size is None
    char = load(tmp_path, "train_micro_batch_size_per_gpu: 1\ntokenizer_type: CharLevelTokenizer\nmake_vocab_size_divisible_by: 100\n")
    assert char.model.padded_vocab_size == 600


def test_defaults_that_depend_on_other_keys(tmp_path):
    cfg = load(tmp_path, "train_micro_batch_size_per_gpu: 1\nhidden_size: 64\nseq_length: 96\ntrain_iters: 250\nwarmup: 0.1\n")
    assert cfg.model.max_position_embeddings == 96 and cfg.model.intermediate_size == 256
    assert cfg.lr_schedule.lr_decay_iters == 250 and cfg.lr_schedule.warmup_iters == 25
    half = load(tmp_path, "train_micro_batch_size_per_gpu: 1\ntrain_iters: 1000\nlr_decay_fraction: 0.5\nwarmup: 0.01\n")
    assert half.lr_schedule.lr_decay_iters == 500 and half.lr_schedule.warmup_iters == 5


@pytest.mark.parametrize("text,expected", [
    ("", "fp32"),
    ("bf16: {enabled: true}\n", "bfloat16"),
    ("bf16: {enabled: false}\n", "fp32"),
    ("precision: bfloat16\n", "bfloat16"),
    ("precision: bf16\n", "bfloat16"),
    ("fp16: {enabled: true, type: bfloat16}\n", "bfloat16"),
    ("fp16: {enabled: true, loss_scale: 0}\n", "fp16"),
    ("fp16: {fp16: true, enabled: true}\n", "fp16"),
    ("fp16: {enabled: false}\nprecision: fp32\n", "fp32"),
])
def test_precision_from_the_three_neox_spellings(tmp_path, text, expected):
    assert load(tmp_path, "train_micro_batch_size_per_gpu: 1\n" + text).precision.precision == expected


@pytest.mark.parametrize("text, expected", [
    ("precision: bf16\n", True), ("fp16: {enabled: true}\n", True), ("precision: fp32\n", False),
    ("precision: bf16\nfp32_allreduce: false\n", False), ("precision: fp32\nfp32_allreduce: true\n", True),
])
def test_step_boundary_hops_default_to_fp32_under_half_precision(tmp_path, text, expected):
    assert load(tmp_path, "train_micro_batch_size_per_gpu: 1\n" + text).precision.fp32_allreduce is expected


def test_bad_fp16_block_is_refused_with_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"^fp16: hysteresis must be >= 1, got 0"):
        load(tmp_path, "train_micro_batch_size_per_gpu: 1\nfp16: {enabled: true, hysteresis: 0}\n")
    with pytest.raises(ConfigError, match=r"^fp16: hysteresis must be >= 1, got 0 \(in --set\)"):
        load(tmp_path, "train_micro_batch_size_per_gpu: 1\n", ["fp16.enabled=true", "fp16.hysteresis=0"])


def test_conflicting_precision_keys_are_an_error(tmp_path):
    with pytest.raises(ConfigError, match=r"precision keys disagree: fp16.enabled asks for fp16, precision asks for bfloat16"):
        load(tmp_path, "train_micro_batch_size_per_gpu: 1\nfp16: {enabled: true}\nprecision: bfloat16\n")


# Factors (w, g, os) per preset on each simulated layout (docs/engine.md "Presets").
FACTORS = {
    "[2, 2, 2]": {"stage: 0": [1, 1, 1], "stage: 1": [1, 1, 8], "stage: 2": [1, 8, 8], "stage: 3": [8, 8, 8],
                  "preset: hsdp": [4, 4, 4], "preset: zeropp": [8, 8, 8], "preset: zero_topo": [2, 4, 8]},
    "[2, 2]": {"stage: 0": [1, 1, 1], "stage: 1": [1, 1, 4], "stage: 2": [1, 4, 4], "stage: 3": [4, 4, 4],
               "preset: hsdp": [2, 2, 2], "preset: zeropp": [4, 4, 4], "preset: zero_topo": [2, 2, 4]},
}


@pytest.mark.parametrize("layout,zero,expected", [(lay, z, f) for lay, table in FACTORS.items() for z, f in table.items()])
def test_resolved_factors_for_each_preset_and_layout(tmp_path, layout, zero, expected):
    cfg = load(tmp_path, f"train_micro_batch_size_per_gpu: 1\ntopology: {{simulate: {layout}}}\nzero_optimization: {{{zero}}}\n")
    assert cfg.zero.resolved_factors == expected
    assert world_size_of(cfg) == (8 if layout == "[2, 2, 2]" else 4)


def test_explicit_shard_factors_and_non_nesting_refusal(tmp_path):
    base = "train_micro_batch_size_per_gpu: 1\ntopology: {simulate: [2, 2, 2]}\n"
    cfg = load(tmp_path, base + "zero_optimization: {shard_factors: [2, 8, 8], preset: hsdp}\n")
    assert cfg.zero.resolved_factors == [2, 8, 8] and cfg.zero.resolved_preset == "custom"
    for factors, fails in (([4, 2, 8], "w=4 does not divide g=2"), ([2, 4, 6], "g=4 does not divide os=6"),
                           ([1, 1, 16], "os=16 does not divide N=8")):
        w, g, os_ = factors
        with pytest.raises(ConfigError, match=rf"shard_factors: \(w, g, os\) = \({w}, {g}, {os_}\) must satisfy "
                                              rf"w \| g \| os \| N = 8: {fails}"):
            load(tmp_path, base + f"zero_optimization: {{shard_factors: {factors}}}\n")
    with pytest.raises(ConfigError, match=r"shard_factors: expected \[w, g, os\]"):
        load(tmp_path, base + "zero_optimization: {shard_factors: [2, 4]}\n")


def test_hpz_partition_size_with_stage_3_selects_zeropp(tmp_path):
    base = "train_micro_batch_size_per_gpu: 1\ntopology: {simulate: [2, 2, 2]}\n"
    cfg = load(tmp_path, base + "zero_optimization: {stage: 3, zero_hpz_partition_size: 4}\n")
    assert (cfg.zero.preset, cfg.zero.resolved_factors) == ("zeropp", [8, 8, 8])
    with pytest.raises(ConfigError, match="is not the ranks per node"):
        load(tmp_path, base + "zero_optimization: {stage: 3, zero_hpz_partition_size: 2}\n")
    with pytest.raises(ConfigError, match="needs stage 3"):
        load(tmp_path, base + "zero_optimization: {stage: 1, zero_hpz_partition_size: 4}\n")


def test_cross_node_reduction_all_reduce_makes_the_cross_hop_unquantized(tmp_path):
    base = "train_micro_batch_size_per_gpu: 1\ntopology: {simulate: [2, 2, 2]}\n"
    ours = load(tmp_path, base + "zero_optimization: {preset: zero_topo, zero_quantized_gradients: true}\n")
    assert (ours.zero.cross_node_reduction, ours.zero.cross_node_grad_bits) == ("reduce_scatter", None)  # -> 4
    # INT4 micro-step hops with the paper's hop: the cross hop's default bits are 0, not grad_reduce_bits
    paper = load(tmp_path, base + "zero_optimization: {preset: zero_topo, zero_quantized_gradients: true, "
                                  "cross_node_reduction: all_reduce}\n")
    assert (paper.zero.cross_node_grad_bits, paper.zero.grad_reduce_bits) == (0, None)
    explicit = load(tmp_path, base + "zero_optimization: {preset: zero_topo, cross_node_reduction: all_reduce, "
                                     "cross_node_grad_bits: 0}\n")
    assert explicit.zero.cross_node_grad_bits == 0


@pytest.mark.parametrize("zero,match", [
    ("preset: zero_topo, cross_node_reduction: all_reduce, cross_node_grad_bits: 4",
     r"^zero_optimization.cross_node_grad_bits: 4 quantizes the cross hop, but cross_node_reduction all_reduce "
     r"sends it unquantized \(in .*c.yml\); set cross_node_grad_bits: 0"),
    ("preset: zeropp, cross_node_reduction: all_reduce",
     r"^zero_optimization.cross_node_reduction: all_reduce needs a cross group, which zeropp \(hpZ\) does not have"),
    ("stage: 3, zero_hpz_partition_size: 4, cross_node_reduction: all_reduce", r"^zero_optimization.cross_node_reduction: "),
    ("plan: auto, cross_node_reduction: all_reduce", r"^zero_optimization.cross_node_reduction: all_reduce is set together "
                                                     r"with plan: auto"),
    ("preset: zero_topo, cross_node_reduction: allreduce",
     r"^zero_optimization.cross_node_reduction: 'allreduce' is not supported .*use one of reduce_scatter, all_reduce"),
])
def test_cross_node_reduction_refusals_are_one_line(tmp_path, zero, match):
    base = "train_micro_batch_size_per_gpu: 1\ntopology: {simulate: [2, 2, 2]}\n"
    with pytest.raises(ConfigError, match=match) as err:
        load(tmp_path, base + f"zero_optimization: {{{zero}}}\n")
    assert "\n" not in str(err.value)


def test_topology_presets_take_nodes_from_num_nodes_then_slurm_then_one(tmp_path):
    text = "train_micro_batch_size_per_gpu: 1\ntopology: {preset: frontier}\n"
    assert load(tmp_path, text).topology.layout == [1, 4, 2]
    assert load(tmp_path, text, env={"SLURM_JOB_NUM_NODES": "48"}).topology.layout == [48, 4, 2]
    cfg = load(tmp_path, text + "num_nodes: 3\n", env={"SLURM_JOB_NUM_NODES": "48"})
    assert cfg.topology.layout == [3, 4, 2] and world_size_of(cfg) == 24
    dgx = load(tmp_path, "train_micro_batch_size_per_gpu: 1\ntopology: {preset: dgx}\nnum_nodes: 2\nzero_optimization: {preset: zero_topo}\n")
    assert dgx.topology.layout == [2, 8] and dgx.zero.resolved_factors == [8, 8, 16]


@pytest.mark.parametrize("text,match", [
    ("topology: {simulate: [2, 0, 2]}\n", "topology.simulate: expected"),
    ("topology: {simulate: [8]}\n", "topology.simulate: expected"),
    ("topology: {preset: sim}\n", "'sim' needs topology.simulate"),
    ("topology: {preset: tpu}\n", "topology.preset: 'tpu' is not supported"),
    ("topology: {preset: frontier}\nnum_gpus: 4\n", "num_gpus: 4 disagrees with topology preset frontier"),
    ("launcher: hostfile\n", "hostfile needs"),
    ("num_nodes: 0\n", "num_nodes: must be -1"),
])
def test_layout_and_launcher_errors(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match):
        load(tmp_path, "train_micro_batch_size_per_gpu: 1\n" + text)


def test_external_world_size_must_match_the_layout(tmp_path):
    from megatron.config import launch_environment_error
    cfg = load(tmp_path, "train_micro_batch_size_per_gpu: 1\ntopology: {simulate: [2, 2]}\n")
    assert launch_environment_error(cfg, {"WORLD_SIZE": "4"}) is None
    assert "has 4 ranks" in launch_environment_error(cfg, {"WORLD_SIZE": "8"})
    assert launch_environment_error(cfg, {"SLURM_NTASKS": "8"}) is None  # only read under launcher slurm
    slurm = load(tmp_path, "train_micro_batch_size_per_gpu: 1\ntopology: {preset: frontier}\nlauncher: slurm\n",
                 env={"SLURM_JOB_NUM_NODES": "2"})
    assert "SLURM_NTASKS=8" in launch_environment_error(slurm, {"SLURM_NTASKS": "8", "SLURM_JOB_NUM_NODES": "2"})
    assert launch_environment_error(slurm, {"SLURM_NTASKS": "16"}) is None
