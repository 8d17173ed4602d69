"""The Hugging Face mapping: parity of logits with transformers' GPTNeoXForCausalLM, round trips."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from megatron.checkpointing.hf import (
    BLOCK_PARAMETER_NAMES, HFConversionError, from_hf_state_dict, hf_config_dict, hf_config_from_model_config,
    model_config_from_hf, to_hf_state_dict,
)
from megatron.config.schema import ModelConfig
from megatron.model import GPTNeoX

transformers = pytest.importorskip("transformers", reason="transformers is needed for the HF parity tests")
safetensors_torch = pytest.importorskip("safetensors.torch")

VOCAB = 96


def tiny_cfg(**overrides) -> ModelConfig:
    fields = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=24, intermediate_size=80,
                  padded_vocab_size=VOCAB, no_weight_tying=True, rotary_emb_base=500)
    fields.update(overrides)
    return ModelConfig(**fields)


def our_model(cfg: ModelConfig, seed: int = 0) -> GPTNeoX:
    """Our model with every parameter moved off its init, so biases and norms matter."""
    torch.manual_seed(seed)
    model = GPTNeoX(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def export_and_load_hf(model: GPTNeoX, cfg: ModelConfig, folder) -> torch.nn.Module:
    """Write config.json + model.safetensors as an export would, and load them with transformers."""
    (folder / "config.json").write_text(json.dumps(hf_config_dict(cfg, VOCAB)))
    hf_sd = {k: v.contiguous() for k, v in to_hf_state_dict(model.state_dict(), cfg).items()}
    safetensors_torch.save_file(hf_sd, str(folder / "model.safetensors"))
    return transformers.GPTNeoXForCausalLM.from_pretrained(str(folder), attn_implementation="eager").eval()


def tokens(seq: int = 24) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(11))


@pytest.mark.parametrize("rotary_pct,parallel,untied", [
    (0.25, True, True),
    (1.0, False, True),
    (0.25, True, False),
    (1.0, False, False),
])
def test_logits_match_transformers(tmp_path, rotary_pct, parallel, untied):
    cfg = tiny_cfg(rotary_pct=rotary_pct, gpt_j_residual=parallel, no_weight_tying=untied)
    ours = our_model(cfg)
    hf = export_and_load_hf(ours, cfg, tmp_path)
    assert hf.config.tie_word_embeddings == (not untied)
    with torch.no_grad():
        diff = (ours(tokens()) - hf(tokens()).logits).abs().max().item()
    assert diff < 1e-4


def test_import_from_transformers_state_dict():
    """HF's in-memory names (lm_head) and HF-initialised weights load into ours with the same logits."""
    cfg = tiny_cfg(rotary_pct=0.5, gpt_j_residual=True)
    torch.manual_seed(2)
    hf = transformers.GPTNeoXForCausalLM(hf_config_from_model_config(cfg, VOCAB)).eval()
    back = model_config_from_hf(hf.config)
    ours = GPTNeoX(back).eval()
    hf_sd = dict(hf.state_dict())
    hf_sd["gpt_neox.layers.0.attention.masked_bias"] = torch.tensor(-1e9)  # buffers old checkpoints carry
    ours.load_state_dict(from_hf_state_dict(hf_sd, back))
    with torch.no_grad():
        assert (ours(tokens()) - hf(tokens()).logits).abs().max().item() < 1e-4


@pytest.mark.parametrize("untied", [True, False])
def test_state_dict_round_trip(untied):
    cfg = tiny_cfg(no_weight_tying=untied)
    sd = our_model(cfg).state_dict()
    hf_sd = to_hf_state_dict(sd, cfg)
    assert ("embed_out.weight" in hf_sd) == untied  # HF saves tied models without the output layer
    back = from_hf_state_dict(hf_sd, cfg)
    assert list(back) == list(sd)
    for name in sd:
        assert torch.equal(back[name], sd[name]), name


def test_block_names_match_the_model():
    model = GPTNeoX(tiny_cfg())
    assert tuple(name for name, _ in model.layers[0].named_parameters()) == BLOCK_PARAMETER_NAMES


def test_qkv_needs_no_permutation():
    cfg = tiny_cfg()
    sd = our_model(cfg).state_dict()
    hf_sd = to_hf_state_dict(sd, cfg)
    assert hf_sd["gpt_neox.layers.1.attention.query_key_value.weight"] is sd["layers.1.attention.query_key_value.weight"]


def test_config_round_trip():
    cfg = tiny_cfg(rotary_pct=0.5, gpt_j_residual=True, no_weight_tying=False, layernorm_epsilon=1e-6,
                   max_position_embeddings=24)
    back = model_config_from_hf(hf_config_from_model_config(cfg, VOCAB))
    for f in dataclasses.fields(ModelConfig):
        if f.name not in ("init_method", "output_layer_init_method", "checkpoint_activations"):
            assert getattr(back, f.name) == getattr(cfg, f.name), f.name


def test_config_from_legacy_transformers_4_dict():
    """config.json as transformers 4.x wrote it (rotary_pct / rotary_emb_base, no rope_parameters)."""
    legacy = {"model_type": "gpt_neox", "vocab_size": 50432, "hidden_size": 6144, "num_hidden_layers": 44,
              "num_attention_heads": 64, "intermediate_size": 24576, "max_position_embeddings": 2048,
              "rotary_pct": 0.25, "rotary_emb_base": 10000, "use_parallel_residual": True,
              "tie_word_embeddings": False, "layer_norm_eps": 1e-5, "hidden_act": "gelu", "rope_scaling": None}
    cfg = model_config_from_hf(legacy)
    assert (cfg.num_layers, cfg.hidden_size, cfg.rotary_pct, cfg.rotary_emb_base) == (44, 6144, 0.25, 10000)
    assert cfg.gpt_j_residual and cfg.no_weight_tying and cfg.padded_vocab_size == 50432
    exported = hf_config_dict(cfg, 50432)
    assert exported["rotary_pct"] == 0.25 and exported["rope_parameters"]["partial_rotary_factor"] == 0.25


def test_conversion_errors():
    cfg = tiny_cfg()
    sd = our_model(cfg).state_dict()
    sd.pop("layers.1.mlp.dense_4h_to_h.bias")
    with pytest.raises(HFConversionError, match="missing"):
        to_hf_state_dict(sd, cfg)
    hf_sd = to_hf_state_dict(our_model(cfg).state_dict(), cfg)
    with pytest.raises(HFConversionError, match="missing"):  # a 3-layer config does not fit 2 layers
        from_hf_state_dict(hf_sd, tiny_cfg(num_layers=3))
    with pytest.raises(HFConversionError, match="hidden_act"):
        model_config_from_hf({**hf_config_dict(cfg, VOCAB), "hidden_act": "relu"})
    with pytest.raises(HFConversionError, match="rope type"):
        model_config_from_hf({**hf_config_dict(cfg, VOCAB), "rope_parameters": {"rope_type": "linear"}})
