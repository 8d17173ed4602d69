"""The block's shape derived from ``ModelConfig``, and the rules a shape must meet, in one place.

Pure arithmetic (no torch): the config validation (validate.py), the model (gpt_neox.py) and every
analytic size (model/sizes.py, hence the memory and time models, the planner and the dry run) read
these functions, so a rule or a width is written once.

MLP widths follow GPT-NeoX's ParallelMLP (../shared/external/gpt-neox/reference/LLAMA_KEYS.md):
with a gated activation (swiglu) ``intermediate_size`` is not the inner width; GPT-NeoX takes two
thirds of it, rounds the fused up+gate projection and the inner width separately, and so can build
a projection whose halves do not match the inner width (its mistral/7B.yml does). That shape cannot
run, so it is refused here with the key to change.
"""
from __future__ import annotations

import operator
from dataclasses import fields
from typing import NamedTuple, Optional

from megatron.config.schema import ModelConfig


class MLPWidths(NamedTuple):
    """``in_rows``: output rows of the first projection (up and gate fused when gated); ``inner``:
    the input width of the second projection."""
    in_rows: int
    inner: int


def _round_up(n: int, multiple: int) -> int:
    return multiple * -(-n // multiple)


def gated(m: ModelConfig) -> bool:
    return m.activation == "swiglu"


def mlp_widths(m: ModelConfig) -> MLPWidths:
    size = m.intermediate_size if m.intermediate_size is not None else 4 * m.hidden_size
    mult = m.mlp_multiple_of
    if not gated(m):
        width = _round_up(size, mult)
        return MLPWidths(width, width)
    f = int(size * 2 / 3)  # GPT-NeoX: int(ffn_dim * 2 / 3), then the input half floor(f / 2)
    return MLPWidths(_round_up(f, 2 * mult), _round_up(f // 2, mult))


def head_dim(m: ModelConfig) -> int:
    return m.hidden_size // m.num_attention_heads


def kv_heads(m: ModelConfig) -> int:
    """Key/value heads: num_kv_heads, or one per query head (multi-head attention) when unset."""
    return m.num_kv_heads if m.num_kv_heads is not None else m.num_attention_heads


def qkv_rows(m: ModelConfig) -> int:
    """Output rows of the fused QKV projection: hidden for Q, kv_heads x head_dim each for K and V."""
    return m.hidden_size + 2 * kv_heads(m) * head_dim(m)


def rotary_dims(m: ModelConfig) -> int:
    """How many leading dimensions of each head are rotated (HF/NeoX: ``int(head_dim * rotary_pct)``)."""
    return int(head_dim(m) * m.rotary_pct)


def max_positions(m: ModelConfig) -> int:
    """Length of the rotary table: ``max_position_embeddings``, or ``seq_length`` when unset."""
    return m.max_position_embeddings if m.max_position_embeddings is not None else m.seq_length


_BOUNDS = {"ge": operator.ge, "gt": operator.gt, "le": operator.le, "lt": operator.lt}


class ShapeProblem(NamedTuple):
    field: str
    problem: str
    fix: str


def shape_problem(m: ModelConfig) -> Optional[ShapeProblem]:
    """The first rule the model's shape breaks, or None. Each rule is written only here; the fields'
    own choices and bounds are the schema's metadata, checked here too for a ModelConfig built in code
    (a loaded config was checked when it was routed)."""
    for f in fields(m):
        value, meta = getattr(m, f.name), f.metadata
        if value is None or meta.get("derived"):
            continue
        if "choices" in meta and value not in meta["choices"]:
            return ShapeProblem(f.name, f"{value!r} is not supported", f"use one of {', '.join(map(str, meta['choices']))}")
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        for bound, holds in _BOUNDS.items() if numeric else ():
            if bound in meta and not holds(value, meta[bound]):
                return ShapeProblem(f.name, f"{value} is out of range", f"it must be {bound} {meta[bound]}")
    if m.hidden_size % m.num_attention_heads:
        return ShapeProblem("num_attention_heads", f"{m.num_attention_heads} heads do not divide hidden_size {m.hidden_size}",
                            "pick a head count that divides hidden_size")
    if m.num_kv_heads is not None and m.num_attention_heads % m.num_kv_heads:
        return ShapeProblem("num_kv_heads", f"{m.num_kv_heads} does not divide num_attention_heads {m.num_attention_heads}",
                            "pick a divisor (1 = multi-query) or leave it unset (multi-head)")
    rot = rotary_dims(m)
    if rot < 2 or rot % 2:
        return ShapeProblem("rotary_pct", f"{m.rotary_pct} of the head size {head_dim(m)} rotates {rot} dims; "
                            "it must be an even number >= 2", "pick a rotary_pct that gives an even count")
    if max_positions(m) < m.seq_length:
        return ShapeProblem("max_position_embeddings", f"{m.max_position_embeddings} is shorter than seq_length {m.seq_length}",
                            "raise it or leave it unset (it defaults to seq_length)")
    widths = mlp_widths(m)
    if gated(m) and widths.in_rows != 2 * widths.inner:
        return ShapeProblem(
            "intermediate_size", f"{m.intermediate_size} with activation swiglu and mlp_multiple_of {m.mlp_multiple_of} "
            f"builds (as GPT-NeoX) an up+gate projection of {widths.in_rows} rows, whose halves ({widths.in_rows // 2}) "
            f"do not match the inner width {widths.inner}",
            f"set intermediate_size to 3 x the SwiGLU width you want ({3 * widths.inner} gives {widths.inner}; "
            "Mistral-7B's 14336 is 43008)")
    if m.recompute_granularity == "selective" and not m.checkpoint_activations:
        return ShapeProblem("recompute_granularity", "'selective' says what a checkpointed block recomputes, and "
                            "checkpoint_activations is off", "set checkpoint_activations: true")
    return None
