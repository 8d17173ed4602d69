"""Every GPT-NeoX key is classified; no-op keys print one notice; refused keys pass at neutral values."""
from __future__ import annotations

import pytest

from megatron.config import ConfigError, load_config
from megatron.config.coverage import coverage
from megatron.config.registry import REGISTRY, Status, neox_key_names


def load(tmp_path, text: str):
    path = tmp_path / "c.yml"
    path.write_text("train_micro_batch_size_per_gpu: 1\n" + text)
    notices: list = []
    cfg = load_config([str(path)], env={}, notices=notices)
    return cfg, notices


def test_every_neox_key_is_classified_and_counts_are_reported(capsys):
    names = neox_key_names()
    assert len(names) == len(set(names)) and len(names) > 300
    result = coverage()
    assert result["unclassified"] == []
    with capsys.disabled():
        print("\nGPT-NeoX key coverage: " + ", ".join(f"{k} {len(v)}" for k, v in result.items()))
    for must in ("num_layers", "train_micro_batch_size_per_gpu", "zero_optimization", "fp16", "bf16", "lr"):
        assert REGISTRY[must].status is Status.HONOURED


def test_every_honoured_key_reaches_a_typed_field():
    from megatron.config.routing import schema_field
    for key, rule in REGISTRY.items():
        if rule.status is Status.HONOURED and not rule.container:
            assert schema_field(rule.target).metadata["help"], key
        if rule.status is Status.REFUSED:
            assert rule.reason and rule.accepts, key


def test_noop_keys_are_accepted_with_one_notice_per_reason(tmp_path):
    cfg, notices = load(tmp_path, "bias_gelu_fusion: true\nrope_fusion: true\npartition_activations: true\n"
                                  "zero_optimization: {stage: 1, overlap_comm: true, reduce_scatter: true, contiguous_gradients: true}\n"
                                  "layernorm_fusion: false\n")
    assert cfg.zero.stage == 1
    fusion = [n for n in notices if "kernel fusion" in n]
    assert len(fusion) == 1 and "bias_gelu_fusion, rope_fusion" in fusion[0] and "layernorm_fusion" not in fusion[0]
    assert cfg.zero.overlap_comm is True  # honoured, no notice
    assert any("zero_optimization.{reduce_scatter, contiguous_gradients}" in n for n in notices)
    assert not any("overlap_comm" in n.split(":")[1] for n in notices)  # the ignored keys, before the reason
    assert any(n.startswith("notice: ignoring partition_activations") for n in notices)


def test_notices_go_to_stderr_once_when_no_list_is_given(tmp_path, capsys):
    path = tmp_path / "c.yml"
    path.write_text("train_micro_batch_size_per_gpu: 1\nbias_gelu_fusion: true\n")
    load_config([str(path)], env={})
    err = capsys.readouterr().err
    assert err.count("bias_gelu_fusion") == 1


@pytest.mark.parametrize("text", [
    "model_parallel_size: 1\n", "pipe_parallel_size: 0\n", "pipe_parallel_size: 1\n", "num_kv_heads: 4\n",
    "attention_config: [[[flash], 2]]\n", "attention_config: [[[global, flash], 1]]\n", "moe_num_experts: 1\n",
    "zero_optimization: {cpu_offload: false, offload_optimizer: {device: none}}\n", "use_bias_in_norms: true\n",
    "pack_impl: packed\n", "scheduler: null\n", "amp: {enabled: false}\n", "padded_vocab_size: null\n",
])
def test_refused_keys_at_neutral_values_are_fine(tmp_path, text):
    load(tmp_path, text)


@pytest.mark.parametrize("text,match", [
    ("model_parallel_size: 2\n", "tensor parallelism is not supported; ZeRO-topo shards instead — set model_parallel_size: 1"),
    ("pipe_parallel_size: 2\n", "pipeline parallelism is not supported"),
    ("attention_config: [[[local], 2]]\n", "only dense causal attention"),
    ("attention_config: [[[mamba], 2]]\n", "Mamba, RWKV, sparse and local layer types are other model families"),
    ("moe_num_experts: 8\n", "mixture of experts is not supported"),
    ("zero_optimization: {offload_optimizer: {device: cpu}}\n", "offload is not supported"),
    ("train_epochs: 3\n", "set train_iters instead"),
    ("warmup_iters: 10\n", "derived by validation"),
    ("padded_vocab_size: 50304\n", "derived by validation"),
    ("zero_optimization: {resolved_factors: [1, 1, 1]}\n", "derived by validation"),
    ("world_size: 8\n", "derived from `topology`"),
])
def test_refused_keys_say_what_to_do_instead(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match) as err:
        load(tmp_path, text)
    assert "\n" not in str(err.value) and "is not accepted (accepted:" in str(err.value)
