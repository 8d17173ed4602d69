"""Mapping between our model in its Llama-family shape and Hugging Face ``LlamaForCausalLM`` /
``MistralForCausalLM``: the weights (one table, ``llama_pieces``) and ``config.json``.

Our fused projections are row-concatenations of HF's separate ones, so every parameter of ours is a
list of row ranges of HF tensors, taken in order (``llama_pieces``), and both directions follow
from that one table:

    ours (below layers.{i}.)              HF (below model.layers.{i}.)
    input_layernorm.weight                input_layernorm.weight
    post_attention_layernorm.weight       post_attention_layernorm.weight
    attention.query_key_value.*           self_attn.q_proj, k_proj, v_proj: [Q | K | V] rows with
                                          grouped-query attention (GPT-NeoX's layout); per head
                                          [q_i | k_i | v_i] with multi-head attention
    attention.dense.*                     self_attn.o_proj
    mlp.dense_h_to_4h.*                   mlp.up_proj rows, then mlp.gate_proj rows (GPT-NeoX's
                                          linear1 halves [up | gate])
    mlp.dense_4h_to_h.*                   mlp.down_proj
    embed.embed_in.weight                 model.embed_tokens.weight
    final.final_layer_norm.weight         model.norm.weight
    final.embed_out.weight                lm_head.weight (untied models only)

No rotary permutation: we and HF both rotate the two halves of each head ("rotate_half"). A
piece-wise table (rather than whole tensors) is what the import that reads only a rank's slices
needs (``load_hf``, megatron/checkpointing/hf_weights.py): a slice of one of our parameters is a few
row ranges of HF tensors. The export (megatron/checkpointing/hf_io.py) writes whole tensors from it.
transformers is imported only where a config object is built.
"""
from __future__ import annotations

from typing import Any, Mapping, NamedTuple

import torch

from megatron.config.model_shape import gated, head_dim, kv_heads, max_positions, mlp_widths
from megatron.config.schema import ModelConfig


class HFLlamaError(ValueError):
    """A model this mapping cannot express as LlamaForCausalLM / MistralForCausalLM (one line)."""


class Piece(NamedTuple):
    """Rows [lo, hi) of the HF tensor ``name`` (hi = -1: all its rows, the vocabulary's)."""
    name: str
    lo: int
    hi: int


def llama_architecture(cfg: ModelConfig) -> str:
    """'mistral' with a sliding window, else 'llama'; refuses what neither expresses."""
    unsupported = [why for why, bad in (
        ("norm layernorm (Llama uses rmsnorm)", cfg.norm != "rmsnorm"),
        ("activation gelu (Llama uses swiglu)", not gated(cfg)),
        ("gpt_j_residual true (Llama's residual is sequential)", cfg.gpt_j_residual),
        (f"rotary_pct {cfg.rotary_pct} (Llama rotates whole heads)", cfg.rotary_pct != 1),
        ("sliding_window_width with biases (MistralConfig has no bias options)",
         cfg.sliding_window_width is not None and (cfg.use_bias_in_attn_linear or cfg.use_bias_in_mlp)),
    ) if bad]
    if unsupported:
        raise HFLlamaError(f"not a Llama/Mistral shape: {'; '.join(unsupported)}")
    return "mistral" if cfg.sliding_window_width is not None else "llama"


def llama_pieces(cfg: ModelConfig) -> list[tuple[str, list[Piece]]]:
    """Every parameter of ours (full name, in ``named_parameters`` order) with the HF row ranges it
    is the concatenation of. The output layer is listed only when untied (HF saves a tied model
    without it)."""
    llama_architecture(cfg)
    h, d, heads, kv = cfg.hidden_size, head_dim(cfg), cfg.num_attention_heads, kv_heads(cfg)
    inner = mlp_widths(cfg).inner
    whole = lambda name, rows: [Piece(name, 0, rows)]  # noqa: E731
    table = [("embed.embed_in.weight", [Piece("model.embed_tokens.weight", 0, -1)])]  # -1: all rows (vocab)
    for i in range(cfg.num_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        table += [(ours + "input_layernorm.weight", whole(hf + "input_layernorm.weight", h)),
                  (ours + "post_attention_layernorm.weight", whole(hf + "post_attention_layernorm.weight", h))]
        attn, mlp = ["weight"] + (["bias"] if cfg.use_bias_in_attn_linear else []), \
            ["weight"] + (["bias"] if cfg.use_bias_in_mlp else [])
        q, k, v, o = (hf + f"self_attn.{p}_proj." for p in "qkvo")
        for kind in attn:
            if kv == heads:  # multi-head: per head [q_i | k_i | v_i]
                qkv = [Piece(p + kind, j * d, (j + 1) * d) for j in range(heads) for p in (q, k, v)]
            else:  # grouped-query: [Q | K | V]
                qkv = [Piece(q + kind, 0, heads * d), Piece(k + kind, 0, kv * d), Piece(v + kind, 0, kv * d)]
            table.append((ours + f"attention.query_key_value.{kind}", qkv))
        table += [(ours + f"attention.dense.{kind}", whole(o + kind, h)) for kind in attn]
        for kind in mlp:
            table.append((ours + f"mlp.dense_h_to_4h.{kind}", [Piece(hf + f"mlp.up_proj.{kind}", 0, inner),
                                                              Piece(hf + f"mlp.gate_proj.{kind}", 0, inner)]))
        table += [(ours + f"mlp.dense_4h_to_h.{kind}", whole(hf + f"mlp.down_proj.{kind}", h)) for kind in mlp]
    table.append(("final.final_layer_norm.weight", whole("model.norm.weight", h)))
    if cfg.no_weight_tying:
        table.append(("final.embed_out.weight", [Piece("lm_head.weight", 0, -1)]))
    return table


def _rows(piece: Piece, tensor: torch.Tensor) -> torch.Tensor:
    return tensor if piece.hi == -1 else tensor[piece.lo:piece.hi]


def from_llama_state_dict(hf_sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF Llama/Mistral tensors -> our state dict (``GPTNeoX.load_state_dict``; a tied output is the
    embedding itself)."""
    ours = {name: torch.cat([_rows(p, hf_sd[p.name]) for p in pieces]) for name, pieces in llama_pieces(cfg)}
    if not cfg.no_weight_tying:
        ours["final.embed_out.weight"] = ours["embed.embed_in.weight"]
    return ours


def to_llama_state_dict(our_sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict -> HF Llama/Mistral tensors (new, contiguous)."""
    parts: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for name, pieces in llama_pieces(cfg):
        tensor, at = our_sd[name], 0
        for p in pieces:
            rows = tensor.shape[0] if p.hi == -1 else p.hi - p.lo
            parts.setdefault(p.name, []).append((p.lo, tensor[at:at + rows]))
            at += rows
    return {hf: torch.cat([t for _, t in sorted(chunks, key=lambda c: c[0])]).contiguous()
            for hf, chunks in parts.items()}


def llama_config_dict(cfg: ModelConfig, vocab_size: int) -> dict[str, Any]:
    """``config.json`` of the equivalent LlamaForCausalLM / MistralForCausalLM. Mistral's
    ``sliding_window`` counts the query itself (transformers: key > query - W), ours does not
    (GPT-NeoX: the w previous positions): W = sliding_window_width + 1."""
    arch = llama_architecture(cfg)
    d = {
        "architectures": ["MistralForCausalLM" if arch == "mistral" else "LlamaForCausalLM"],
        "model_type": arch,
        "vocab_size": vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": mlp_widths(cfg).inner,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": kv_heads(cfg),
        "head_dim": head_dim(cfg),
        "hidden_act": "silu",
        "max_position_embeddings": max_positions(cfg),
        "rms_norm_eps": cfg.rms_norm_epsilon,
        "tie_word_embeddings": not cfg.no_weight_tying,
        "attention_dropout": cfg.attention_dropout,
        "initializer_range": cfg.init_method_std,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(cfg.rotary_emb_base)},
        "rope_theta": float(cfg.rotary_emb_base),  # transformers 4.x's key
        "torch_dtype": "float32",
    }
    if arch == "mistral":
        d["sliding_window"] = cfg.sliding_window_width + 1
    else:
        d["attention_bias"], d["mlp_bias"] = cfg.use_bias_in_attn_linear, cfg.use_bias_in_mlp
    return d


def model_config_from_llama(d: Mapping[str, Any]) -> ModelConfig:
    """Our ``ModelConfig`` for a Llama/Mistral ``config.json`` dict: the inverse of
    ``llama_config_dict`` (intermediate_size 3 x HF's, which GPT-NeoX's rule turns back into HF's
    width with mlp_multiple_of 1; sliding_window W -> sliding_window_width W - 1). Refuses, in one
    line, what our model does not build (another activation, scaled rotary, a head_dim that is not
    hidden_size / heads)."""
    def fail(msg: str):
        raise HFLlamaError(f"HF config: {msg}")
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                           "max_position_embeddings") if d.get(k) is None]
    if missing:
        fail(f"missing {', '.join(missing)}")
    h, heads = d["hidden_size"], d["num_attention_heads"]
    if d.get("head_dim") not in (None, h // heads) or h % heads:
        fail(f"head_dim {d.get('head_dim')} is not hidden_size / num_attention_heads; our heads split the width")
    if d.get("hidden_act", "silu") != "silu":
        fail(f"hidden_act '{d['hidden_act']}' is not supported; only silu (SwiGLU)")
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        fail(f"rope type '{rope.get('rope_type', rope.get('type'))}' is not supported")
    base = rope.get("rope_theta", d.get("rope_theta", 10000.0))
    kv = d.get("num_key_value_heads") or heads
    mistral = d.get("model_type") == "mistral"
    window = d.get("sliding_window") if mistral else None
    return ModelConfig(
        num_layers=d["num_hidden_layers"], hidden_size=h, num_attention_heads=heads,
        num_kv_heads=None if kv == heads else kv,
        seq_length=d["max_position_embeddings"], max_position_embeddings=d["max_position_embeddings"],
        intermediate_size=3 * d["intermediate_size"], mlp_multiple_of=1, norm="rmsnorm",
        rms_norm_epsilon=float(d.get("rms_norm_eps", 1e-6)), activation="swiglu",
        use_bias_in_attn_linear=bool(d.get("attention_bias", False)), use_bias_in_mlp=bool(d.get("mlp_bias", False)),
        sliding_window_width=None if window is None else window - 1, rotary_pct=1.0,
        rotary_emb_base=int(base) if float(base).is_integer() else base, gpt_j_residual=False,
        no_weight_tying=not d.get("tie_word_embeddings", False), init_method_std=float(d.get("initializer_range", 0.02)),
        attention_dropout=float(d.get("attention_dropout", 0.0)), padded_vocab_size=d["vocab_size"])


def llama_config(cfg: ModelConfig, vocab_size: int):
    """A transformers LlamaConfig / MistralConfig object (imports transformers)."""
    from transformers import LlamaConfig, MistralConfig
    d = llama_config_dict(cfg, vocab_size)
    return (MistralConfig if d["model_type"] == "mistral" else LlamaConfig)(**d)
