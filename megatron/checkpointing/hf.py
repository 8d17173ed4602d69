"""Mapping between our GPT-NeoX and Hugging Face ``GPTNeoXForCausalLM``: config and state dict.

Our units use HF's parameter names and QKV layout (see ``megatron/model/gpt_neox.py``), so the state
dict mapping only swaps prefixes:

    ours                          HF checkpoint (safetensors / pytorch_model.bin)
    embed.embed_in.weight         gpt_neox.embed_in.weight
    layers.{i}.<name>             gpt_neox.layers.{i}.<name>
    final.final_layer_norm.*      gpt_neox.final_layer_norm.*
    final.embed_out.weight        embed_out.weight      (absent when tied, as HF saves tied models)

HF names are those of checkpoint files; transformers 5 renames ``embed_out`` to ``lm_head`` when it
loads one, so ``lm_head.weight`` is accepted on the way in as well. transformers is imported only
inside the functions that need it.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from megatron.config.schema import ModelConfig
from megatron.config.model_shape import kv_heads, max_positions, mlp_widths

# Parameters of one transformer block, by their (shared) names below `layers.{i}.`.
BLOCK_PARAMETER_NAMES = (
    "input_layernorm.weight", "input_layernorm.bias",
    "post_attention_layernorm.weight", "post_attention_layernorm.bias",
    "attention.query_key_value.weight", "attention.query_key_value.bias",
    "attention.dense.weight", "attention.dense.bias",
    "mlp.dense_h_to_4h.weight", "mlp.dense_h_to_4h.bias",
    "mlp.dense_4h_to_h.weight", "mlp.dense_4h_to_h.bias",
)
# Whole-name pairs (ours, HF) outside the blocks.
EDGE_NAMES = (
    ("embed.embed_in.weight", "gpt_neox.embed_in.weight"),
    ("final.final_layer_norm.weight", "gpt_neox.final_layer_norm.weight"),
    ("final.final_layer_norm.bias", "gpt_neox.final_layer_norm.bias"),
    ("final.embed_out.weight", "embed_out.weight"),
)
OUR_OUTPUT, HF_OUTPUT, HF_OUTPUT_IN_MEMORY = "final.embed_out.weight", "embed_out.weight", "lm_head.weight"
OUR_EMBED = "embed.embed_in.weight"
# Buffers older HF checkpoints carry next to the weights; they are recomputed, never loaded.
HF_IGNORED_SUFFIXES = ("attention.bias", "attention.masked_bias", "rotary_emb.inv_freq")


class HFConversionError(ValueError):
    """A checkpoint or config that cannot be mapped between our model and Hugging Face's."""


LLAMA_MODEL_TYPES = ("llama", "mistral")


def require_gpt_neox_shape(model_cfg: ModelConfig) -> None:
    """GPTNeoXForCausalLM holds only NeoX-20B-shaped blocks; a Llama-family shape goes through the
    Llama bridge (megatron/checkpointing/hf_llama.py)."""
    llama = [key for key, differs in (
        ("norm: rmsnorm", model_cfg.norm != "layernorm"), ("activation: swiglu", model_cfg.activation != "gelu"),
        ("num_kv_heads", kv_heads(model_cfg) != model_cfg.num_attention_heads),
        ("use_bias_in_attn_linear: false", not model_cfg.use_bias_in_attn_linear),
        ("use_bias_in_mlp: false", not model_cfg.use_bias_in_mlp),
        ("sliding_window_width", model_cfg.sliding_window_width is not None)) if differs]
    if llama:
        raise HFConversionError(f"a model with {', '.join(llama)} is not a GPTNeoXForCausalLM, and without both "
                                "norm rmsnorm and activation swiglu not a LlamaForCausalLM / MistralForCausalLM either")


def name_pairs(model_cfg: ModelConfig) -> list[tuple[str, str]]:
    """Every (our name, HF name) pair of a model with this config, the output layer included."""
    require_gpt_neox_shape(model_cfg)
    pairs = [EDGE_NAMES[0]]
    for i in range(model_cfg.num_layers):
        pairs += [(f"layers.{i}.{n}", f"gpt_neox.layers.{i}.{n}") for n in BLOCK_PARAMETER_NAMES]
    return pairs + list(EDGE_NAMES[1:])


def _check_keys(given: set[str], expected: set[str], what: str) -> None:
    missing, unexpected = sorted(expected - given), sorted(given - expected)
    if missing or unexpected:
        raise HFConversionError(
            f"{what} does not match the model config: missing {missing[:4]}{'...' if len(missing) > 4 else ''}, "
            f"unexpected {unexpected[:4]}{'...' if len(unexpected) > 4 else ''}")


def to_hf_state_dict(our_state_dict: Mapping[str, torch.Tensor], model_cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict (``GPTNeoX.state_dict()``) -> HF checkpoint names. Tensors are shared, not copied.

    With tied embeddings the output layer is left out (it is the embedding), as HF saves tied models.
    """
    tied = not model_cfg.no_weight_tying
    pairs = name_pairs(model_cfg)
    given = set(our_state_dict)
    if tied:  # our tied state dict may or may not list the shared output weight
        given.discard(OUR_OUTPUT)
        pairs = [(ours, hf) for ours, hf in pairs if ours != OUR_OUTPUT]
    _check_keys(given, {ours for ours, _ in pairs}, "our state dict")
    return {hf: our_state_dict[ours] for ours, hf in pairs}


def from_hf_state_dict(hf_sd: Mapping[str, torch.Tensor], model_cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF checkpoint names -> our state dict, loadable with ``GPTNeoX.load_state_dict``.

    Accepts ``lm_head.weight`` (transformers 5 in-memory name) for ``embed_out.weight`` and ignores
    the attention-mask and rotary buffers old checkpoints contain. With tied embeddings the output
    weight is the embedding tensor itself (an HF output weight, if present, is ignored as HF does).
    """
    hf = {k: v for k, v in hf_sd.items() if not k.endswith(HF_IGNORED_SUFFIXES)}
    if HF_OUTPUT_IN_MEMORY in hf:
        if HF_OUTPUT in hf:
            raise HFConversionError("HF state dict has both embed_out.weight and lm_head.weight; keep one")
        hf[HF_OUTPUT] = hf.pop(HF_OUTPUT_IN_MEMORY)
    tied = not model_cfg.no_weight_tying
    pairs = name_pairs(model_cfg)
    if tied:
        hf.pop(HF_OUTPUT, None)
        pairs = [(ours, name) for ours, name in pairs if ours != OUR_OUTPUT]
    _check_keys(set(hf), {name for _, name in pairs}, "HF state dict")
    ours = {our_name: hf[hf_name] for our_name, hf_name in pairs}
    if tied:
        ours[OUR_OUTPUT] = ours[OUR_EMBED]
    # Our state_dict() lists the output layer last; keep that order so the two compare key by key.
    order = [name for name, _ in name_pairs(model_cfg)]
    return {name: ours[name] for name in order}


def _rotary_base_for_json(base: float) -> int | float:
    return int(base) if float(base).is_integer() else float(base)


def hf_config_dict(model_cfg: ModelConfig, vocab_size: int) -> dict[str, Any]:
    """The ``config.json`` of the equivalent HF model; no transformers import needed.

    Rotary settings are written both as ``rope_parameters`` (transformers 5) and as the legacy
    ``rotary_pct`` / ``rotary_emb_base`` keys, so transformers 4.x reads the same model.
    """
    require_gpt_neox_shape(model_cfg)
    base = _rotary_base_for_json(model_cfg.rotary_emb_base)
    return {
        "architectures": ["GPTNeoXForCausalLM"],
        "model_type": "gpt_neox",
        "vocab_size": vocab_size,
        "hidden_size": model_cfg.hidden_size,
        "num_hidden_layers": model_cfg.num_layers,
        "num_attention_heads": model_cfg.num_attention_heads,
        "intermediate_size": mlp_widths(model_cfg).inner,
        "hidden_act": "gelu",
        "max_position_embeddings": max_positions(model_cfg),
        "layer_norm_eps": model_cfg.layernorm_epsilon,
        "use_parallel_residual": model_cfg.gpt_j_residual,
        "tie_word_embeddings": not model_cfg.no_weight_tying,
        "attention_bias": True,
        "attention_dropout": model_cfg.attention_dropout,
        "hidden_dropout": model_cfg.hidden_dropout,
        "initializer_range": model_cfg.init_method_std,
        "rope_parameters": {"rope_type": "default", "rope_theta": base,
                            "partial_rotary_factor": model_cfg.rotary_pct},
        "rotary_pct": model_cfg.rotary_pct,
        "rotary_emb_base": base,
        "use_cache": True,
    }


def hf_config_from_model_config(model_cfg: ModelConfig, vocab_size: int):
    """A ``transformers.GPTNeoXConfig`` describing the same model as ``model_cfg``."""
    from transformers import GPTNeoXConfig  # lazy: transformers is only needed for HF interop

    return GPTNeoXConfig.from_dict(hf_config_dict(model_cfg, vocab_size))


def model_config_from_hf(hf_config: Any) -> ModelConfig:
    """Our ``ModelConfig`` for an HF GPT-NeoX config (a ``GPTNeoXConfig`` or its config.json dict),
    or a Llama / Mistral one (``hf_llama.model_config_from_llama``).

    Missing optional keys take HF's GPTNeoXConfig defaults; an architecture we do not implement
    (another activation, no attention bias, scaled rotary) is refused.
    """
    d = dict(hf_config) if isinstance(hf_config, Mapping) else hf_config.to_dict()
    if d.get("model_type") in LLAMA_MODEL_TYPES:
        from megatron.checkpointing.hf_llama import model_config_from_llama
        return model_config_from_llama(d)
    if d.get("model_type", "gpt_neox") != "gpt_neox":
        raise HFConversionError(f"HF config: model_type '{d['model_type']}' is not gpt_neox")
    required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "intermediate_size", "max_position_embeddings")
    missing = [k for k in required if d.get(k) is None]
    if missing:
        raise HFConversionError(f"HF config: missing {', '.join(missing)}")
    if d.get("hidden_act", "gelu") != "gelu":
        raise HFConversionError(f"HF config: hidden_act '{d['hidden_act']}' is not supported; only exact 'gelu'")
    if not d.get("attention_bias", True):
        raise HFConversionError("HF config: attention_bias false is not supported; our attention has biases")
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise HFConversionError(f"HF config: rope type '{rope.get('rope_type', rope.get('type'))}' is not supported")
    rotary_pct = rope.get("partial_rotary_factor", d.get("rotary_pct", 0.25))
    base = rope.get("rope_theta", d.get("rotary_emb_base", 10000))
    return ModelConfig(
        num_layers=d["num_hidden_layers"],
        hidden_size=d["hidden_size"],
        num_attention_heads=d["num_attention_heads"],
        seq_length=d["max_position_embeddings"],
        max_position_embeddings=d["max_position_embeddings"],
        intermediate_size=d["intermediate_size"],
        rotary_pct=float(rotary_pct),
        rotary_emb_base=_rotary_base_for_json(base),
        gpt_j_residual=bool(d.get("use_parallel_residual", True)),
        layernorm_epsilon=float(d.get("layer_norm_eps", 1e-5)),
        no_weight_tying=not d.get("tie_word_embeddings", False),
        init_method_std=float(d.get("initializer_range", 0.02)),
        hidden_dropout=float(d.get("hidden_dropout", 0.0)),
        attention_dropout=float(d.get("attention_dropout", 0.0)),
        padded_vocab_size=d["vocab_size"],
    )

