"""YAML reading, merging and --set overrides; unknown keys, type and value errors."""
from __future__ import annotations

import textwrap

import pytest

from megatron.config import ConfigError, load_config

BASE = "train_micro_batch_size_per_gpu: 4\n"


def write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def load(tmp_path, *texts: str, overrides=(), **kw):
    paths = [write(tmp_path, f"c{i}.yml", t) for i, t in enumerate(texts)]
    return load_config(paths, list(overrides), env={}, notices=kw.pop("notices", []))


def test_files_merge_in_order_and_each_key_lands_in_its_group(tmp_path):
    cfg = load(tmp_path, BASE + "num_layers: 3\n", "hidden_size: 256\nlr_decay_style: linear\n")
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.lr_schedule.lr_decay_style) == (3, 256, "linear")
    assert [f["path"].rsplit("/", 1)[1] for f in cfg.config_files] == ["c0.yml", "c1.yml"]
    assert cfg.config_files[1]["text"].startswith("hidden_size: 256")


def test_a_key_in_two_files_is_an_error_naming_the_key_and_both_files(tmp_path):
    a = write(tmp_path, "a.yml", BASE + "num_layers: 3\n")
    b = write(tmp_path, "b.yml", "num-layers: 3\n")  # same key after hyphen normalisation
    with pytest.raises(ConfigError) as err:
        load_config([a, b], env={}, notices=[])
    message = str(err.value)
    assert "num_layers" in message and a in message and b in message and "\n" not in message


def test_a_key_twice_in_one_file_is_an_error_with_lines(tmp_path):
    with pytest.raises(ConfigError, match=r"appears twice \(lines 2 and 3\)"):
        load(tmp_path, BASE + "num_layers: 3\nnum_layers: 4\n")


def test_hyphens_and_underscores_are_the_same_key(tmp_path):
    cfg = load(tmp_path, "train-micro-batch-size-per-gpu: 2\ntensorboard-dir: tb\nzero-optimization: {stage: 2}\n")
    assert cfg.training.train_micro_batch_size_per_gpu == 2
    assert cfg.logging.tensorboard_dir == "tb"
    assert cfg.zero.stage == 2


@pytest.mark.parametrize("text,expected", [("1e-8", 1e-8), ("1.0e8", 1e8), ("5E3", 5000.0), (".5e1", 5.0), ("1.0e-8", 1e-8)])
def test_exponent_floats_without_dot_or_sign_are_numbers(tmp_path, text, expected):
    cfg = load(tmp_path, BASE + f"optimizer: {{params: {{eps: {text}}}}}\n")
    assert cfg.optimizer.eps == expected and isinstance(cfg.optimizer.eps, float)


def test_neox_json_like_yaml_with_comments_trailing_commas_and_True(tmp_path):
    cfg = load(tmp_path, """\
        # comment
        {
          "train_micro_batch_size_per_gpu": 4,  # trailing comment
          "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "eps": 1e-8,},},
          "fp32_allreduce": True,
        }
        """)
    assert cfg.optimizer.lr == 1e-3 and cfg.precision.fp32_allreduce is True


def test_set_overrides_flat_and_nested_keys_after_merging(tmp_path):
    cfg = load(tmp_path, BASE + "num_layers: 3\nzero_optimization: {stage: 1}\n",
               overrides=["num_layers=5", "zero_optimization.stage=3", "optimizer.params.eps=1e-6"])
    assert cfg.model.num_layers == 5 and cfg.zero.stage == 3 and cfg.optimizer.eps == 1e-6
    assert cfg.overrides == ["num_layers=5", "zero_optimization.stage=3", "optimizer.params.eps=1e-6"]


def test_set_of_a_nested_key_creates_a_dict_no_file_had(tmp_path):
    cfg = load(tmp_path, BASE, overrides=["topology.simulate=[2, 2]", "zero_optimization.preset=hsdp"])
    assert cfg.topology.simulate == [2, 2] and cfg.zero.resolved_factors == [2, 2, 2]


@pytest.mark.parametrize("override,match", [
    ("num_layers", "expected KEY=VALUE"),
    ("=3", "expected KEY=VALUE"),
    ("num_layers.x=3", "not a mapping"),
    ("num_layers=[1,", "invalid YAML"),
])
def test_bad_set_arguments_are_one_line_errors(tmp_path, override, match):
    with pytest.raises(ConfigError, match=match) as err:
        load(tmp_path, BASE + "num_layers: 3\n", overrides=[override])
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("text,suggestion", [
    ("num_layer: 2\n", "num_layers"),
    ("hiden_size: 64\n", "hidden_size"),
    ("zero_optimization: {stagee: 1}\n", "zero_optimization.stage"),
    ("optimizer: {params: {betass: [0.9, 0.9]}}\n", "optimizer.params.betas"),
    ("fp16: {enabeld: true}\n", "fp16.enabled"),
])
def test_unknown_keys_suggest_the_closest_valid_name(tmp_path, text, suggestion):
    with pytest.raises(ConfigError, match="unknown key") as err:
        load(tmp_path, BASE + text)
    assert f"did you mean '{suggestion}'?" in str(err.value) or f"did you mean {suggestion}?" in str(err.value)


def test_grouped_spelling_gets_a_hint(tmp_path):
    with pytest.raises(ConfigError, match="flat names"):
        load(tmp_path, BASE + "model: {num_layers: 2}\n")


@pytest.mark.parametrize("text,match", [
    ("num_layers: two\n", r"num_layers: expected an integer, got 'two'"),
    ("num_layers: 2.5\n", r"num_layers: expected an integer"),
    ("gpt_j_residual: 1\n", r"gpt_j_residual: expected true or false"),
    ("optimizer: {params: {lr: fast}}\n", r"optimizer.params.lr: expected a number"),
    ("optimizer: 3\n", r"optimizer: expected a mapping"),
    ("train_data_paths: data/a\n", r"train_data_paths: expected a list"),
    ("num_layers: -1\n", r"num_layers: must be >= 1, got -1"),
    ("hidden_dropout: 1.5\n", r"hidden_dropout: must be < 1.0"),
    ("warmup: 100\n", r"warmup: must be <= 1.0, got 100"),
    ("lr_decay_style: exponential\n", r"lr_decay_style: 'exponential' is not supported.*cosine, linear, constant"),
    ("norm: scalenorm\n", r"norm: 'scalenorm' is not supported \(in .*\); use one of layernorm, rmsnorm"),
    ("num_kv_heads: 3\n", r"num_kv_heads: 3 does not divide num_attention_heads 4"),
    ("activation: swiglu\nintermediate_size: 14336\n",
     r"intermediate_size: 14336 with activation swiglu .* halves \(4779\) do not match the inner width 4778"),
    ("tokenizer_type: GPT2BPETokenizer\n", r"tokenizer_type: 'GPT2BPETokenizer' is not supported"),
    ("zero_optimization: {stage: 4}\n", r"zero_optimization.stage: 4 is not supported"),
    ("launcher: mpi\n", r"launcher: 'mpi' is not supported"),
    ("hidden_size: 100\nnum_attention_heads: 3\n", r"num_attention_heads: 3 heads do not divide hidden_size 100"),
    ("max_position_embeddings: 64\n", r"max_position_embeddings: 64 is shorter than seq_length 128"),
    ("optimizer: {params: {betas: [0.9]}}\n", r"optimizer.params.betas: expected two numbers"),
    ("min_lr: 1.0\n", r"min_lr: 1.0 is above the peak lr"),
    ("split: 'a,b'\n", r"split: 'a,b' is not"),
    ("train_data_paths: [a, b]\ntrain_data_weights: [1.0]\n", r"train_data_weights: has 1 weights for 2 paths"),
    ("rotary_pct: 0.01\n", r"rotary_pct: 0.01 of the head size 32 rotates 0 dims"),
])
def test_type_and_value_errors_name_the_key_in_one_line(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match) as err:
        load(tmp_path, BASE + text)
    assert "\n" not in str(err.value)
    assert "c0.yml" in str(err.value) or "defaults" in str(err.value)


def test_case_and_alias_spellings_normalise(tmp_path):
    cfg = load(tmp_path, BASE + "optimizer: {type: adamw}\ndata_impl: infer\nlauncher: pdsh\nhostfile: /h\n")
    assert (cfg.optimizer.type, cfg.data.data_impl, cfg.launcher.launcher) == ("AdamW", "mmap", "hostfile")


def test_aliases_land_in_the_canonical_field_and_conflicts_are_errors(tmp_path):
    cfg = load(tmp_path, "batch_size: 2\nlr: 0.01\nzero_stage: 2\noptimizer_type: adam\n")
    assert cfg.training.train_micro_batch_size_per_gpu == 2
    assert (cfg.optimizer.lr, cfg.zero.stage, cfg.optimizer.type) == (0.01, 2, "Adam")
    with pytest.raises(ConfigError, match=r"lr .* and optimizer.params.lr .* give different values"):
        load(tmp_path, BASE + "lr: 0.01\noptimizer: {params: {lr: 0.02}}\n")
    # An override in either spelling beats the file's value in the other.
    assert load(tmp_path, BASE + "optimizer: {params: {lr: 0.02}}\n", overrides=["lr=0.5"]).optimizer.lr == 0.5
    assert load(tmp_path, BASE + "lr: 0.02\n", overrides=["optimizer.params.lr=0.5"]).optimizer.lr == 0.5


def test_missing_file_and_non_mapping_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config([str(tmp_path / "nope.yml")], env={}, notices=[])
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load(tmp_path, "- a\n- b\n")
    with pytest.raises(ConfigError, match=r"c0.yml:\d+:\d+: invalid YAML"):
        load(tmp_path, "{num_layers: [1, 2\n")
