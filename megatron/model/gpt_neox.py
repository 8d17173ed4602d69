"""The GPT-NeoX model, with exactly the semantics of Hugging Face ``GPTNeoXForCausalLM``, and GPT-NeoX's
Llama-family options (RMSNorm, SwiGLU, grouped-/multi-query and sliding-window attention, bias-free
layers), which make it Hugging Face's ``LlamaForCausalLM`` / ``MistralForCausalLM`` up to a renaming
and a split of the fused projections (``megatron/checkpointing/hf_llama.py``).

Shape of the model, as the sharding engine sees it: three kinds of *unit*, run in this order by
``forward`` and each called exactly once per forward (so hooks placed on units fire once):

    embed   Embedding      token embedding (+ hidden dropout)
    layers  [Block] * L    pre-norm transformer blocks, rotary attention through SDPA
    final   OutputHead     final norm + output projection (optionally tied to the embedding)

Units hold parameters only. The rotary cos/sin tables are non-persistent buffers of the top-level
model, sliced to the sequence length and passed to every block, so a unit never owns a buffer the
engine would have to shard or move.

Parameter names inside units are Hugging Face's (``attention.query_key_value``, ``mlp.dense_h_to_4h``,
...), and the fused QKV projection uses HF's layout (per head ``[q | k | v]``), so converting to or
from HF is a renaming of prefixes, never a permutation (see ``megatron/checkpointing/hf.py``). With
grouped-query attention the fused projection is GPT-NeoX's ``[all Q | all K | all V]``; with SwiGLU
``mlp.dense_h_to_4h`` holds GPT-NeoX's linear1 rows ``[up | gate]``. Sizes and the rules a shape
must meet come from ``megatron/config/model_shape.py``, the one place they are written.
No distributed code lives here.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts,
                                    set_checkpoint_early_stop)

from megatron.config.errors import ConfigError, config_error
from megatron.config.model_shape import (gated, head_dim, kv_heads, max_positions, mlp_widths, qkv_rows,
                                         rotary_dims, shape_problem)
from megatron.config.schema import INIT_METHODS, ModelConfig
from megatron.model.fused_cross_entropy import linear_cross_entropy
from megatron.model.kv_cache import KVCache, LayerCache

# Names (suffixes) of the weights initialised with ``output_layer_init_method``: the projections that
# write back into the residual stream. Every other matrix uses ``init_method``.
OUTPUT_SIDE_WEIGHTS = ("attention.dense.weight", "mlp.dense_4h_to_h.weight")


class ModelConfigError(ConfigError, ValueError):
    """A model configuration that cannot be built; the message is one line naming the key.

    A ConfigError, so the launcher reports it as the one-line user error it is.
    """


def validate_model_config(cfg: ModelConfig, vocab_size: int | None) -> None:
    """Refuse, with one clear line, any configuration this model cannot build (the rules themselves
    are ``model_shape.shape_problem``'s, shared with the config's validation)."""
    if vocab_size is None or vocab_size <= 0:
        raise ModelConfigError("model config: vocabulary size unknown: set padded_vocab_size "
                               "(derived from the tokenizer) or pass vocab_size")
    problem = shape_problem(cfg)
    if problem is not None:
        raise ModelConfigError(f"model config: {config_error(problem.field, problem.problem, fix=problem.fix)}")


# ---------------------------------------------------------------------------------------------------
# Rotary position embedding (NeoX / HF "rotate_half" convention)
# ---------------------------------------------------------------------------------------------------

def rotary_tables(rotary_dims: int, max_positions: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape [max_positions, rotary_dims], computed in fp32 as HF does.

    Always on the CPU, even inside ``torch.device("meta")``: the tables are small, and their ops on
    the meta device would import torch's Python decompositions (~110 MB per process)."""
    cpu = torch.device("cpu")
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dims, 2, dtype=torch.float32, device=cpu) / rotary_dims))
    angles = torch.arange(max_positions, dtype=torch.float32, device=cpu)[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)  # frequencies repeat over the two halves
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` dims of x [B, heads, T, head_dim]; the rest pass through."""
    n = cos.shape[-1]
    x_rot, x_pass = x[..., :n], x[..., n:]
    first, second = x_rot.chunk(2, dim=-1)
    rotated_half = torch.cat((-second, first), dim=-1)
    return torch.cat((x_rot * cos + rotated_half * sin, x_pass), dim=-1)


# ---------------------------------------------------------------------------------------------------
# Units
# ---------------------------------------------------------------------------------------------------

class Embedding(nn.Module):
    """Unit 0: token ids [B, T] -> hidden states [B, T, H]."""

    def __init__(self, vocab_size: int, hidden_size: int, dropout: float):
        super().__init__()
        # An uninitialised weight (init_weights draws it): nn.Embedding's own normal_ init would, on
        # the meta device, import torch's Python decompositions (~150 MB in every process).
        self.embed_in = nn.Embedding(vocab_size, hidden_size, _weight=torch.empty(vocab_size, hidden_size))
        self.dropout = nn.Dropout(dropout)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.embed_in(tokens))


class RMSNorm(nn.Module):
    """GPT-NeoX's RMSNorm: weight * x / sqrt(mean(x^2) + eps), in fp32 and cast back; no bias."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size))  # ones, drawn by init_parameters (no RNG)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * y).to(x.dtype)


def make_norm(cfg: ModelConfig) -> nn.Module:
    """The block's and the head's norm: LayerNorm (with bias) or RMSNorm, each with its own epsilon."""
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.hidden_size, cfg.rms_norm_epsilon)
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)


class SelfAttention(nn.Module):
    """Causal attention with a fused QKV projection. Multi-head: laid out per head as [q | k | v]
    (HF GPTNeoX). Grouped-/multi-query (num_kv_heads < heads): [all Q | all K | all V] (GPT-NeoX),
    each K/V head serving heads / num_kv_heads consecutive query heads. Optionally a sliding window."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, kv_heads(cfg), head_dim(cfg)
        self.window = cfg.sliding_window_width
        self.attention_dropout = cfg.attention_dropout
        bias = cfg.use_bias_in_attn_linear
        self.query_key_value = nn.Linear(cfg.hidden_size, qkv_rows(cfg), bias=bias)
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=bias)

    def _split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[B, T, rows] -> q [B, heads, T, d], k and v [B, kv_heads, T, d]."""
        batch, seq, _ = qkv.shape
        if self.num_kv_heads == self.num_heads:
            return qkv.view(batch, seq, self.num_heads, 3 * self.head_dim).transpose(1, 2).chunk(3, dim=-1)
        kv_width = self.num_kv_heads * self.head_dim
        q, k, v = qkv.split((self.num_heads * self.head_dim, kv_width, kv_width), dim=-1)
        return tuple(t.view(batch, seq, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                kv: LayerCache | None = None) -> torch.Tensor:
        batch, seq, hidden = x.shape
        q, k, v = self._split(self.query_key_value(x))
        cos, sin = rope
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        past = 0
        if kv is not None:
            past = kv.owner.length
            k, v = kv.extend(k, v)  # the held positions (the window's, or every one), then these
        mask = visible_keys(past, seq, k.shape[2], self.window, q.device)
        grouped = self.num_kv_heads != self.num_heads
        if grouped and mask is not None:
            # SDPA's grouped-query path runs only its flash and math kernels on CUDA, and flash takes
            # no mask: with one (a window, several cached queries) the K/V heads are copied out to
            # one per query head, so the memory-efficient kernel runs instead of the [T, T] math one.
            groups = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            grouped = False
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None and past == 0 and seq > 1,
            dropout_p=self.attention_dropout if self.training else 0.0,
            enable_gqa=grouped)  # SDPA shares each K/V head among its query heads, no copies
        return self.dense(y.transpose(1, 2).reshape(batch, seq, hidden))


def visible_keys(past: int, new: int, keys: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """Which of `keys` keys (the last positions up to past + new - 1: a windowed cache holds only the
    latest) each of `new` queries that follow `past` processed positions sees: query i (position
    past + i) sees positions past + i - window .. past + i (all earlier ones without a window; GPT-NeoX's
    flash-attn window (w, 0)). None where SDPA's is_causal says it (nothing cached, no window: SDPA
    aligns its diagonal to the top-left corner) or where every key is visible (one query, no window cut)."""
    if past == 0 and window is None:
        return None
    if new == 1 and (window is None or keys <= window + 1):
        return None
    query = torch.arange(past, past + new, device=device)[:, None]
    key = torch.arange(past + new - keys, past + new, device=device)[None, :]
    visible = key <= query
    if window is not None:
        visible &= key >= query - window
    return visible


class MLP(nn.Module):
    """Feed-forward: exact (erf) GELU, or SwiGLU silu(gate) * up with the first projection's rows
    [up | gate] (GPT-NeoX's linear1). Widths from model_shape.mlp_widths (GPT-NeoX's rule)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        widths, bias = mlp_widths(cfg), cfg.use_bias_in_mlp
        self.gated = gated(cfg)
        self.dense_h_to_4h = nn.Linear(cfg.hidden_size, widths.in_rows, bias=bias)
        self.dense_4h_to_h = nn.Linear(widths.inner, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dense_h_to_4h(x)
        if self.gated:
            up, gate = y.chunk(2, dim=-1)
            return self.dense_4h_to_h(F.silu(gate) * up)
        return self.dense_4h_to_h(F.gelu(y))


class Block(nn.Module):
    """One transformer block: parallel residual (gpt_j_residual, two norms) or sequential."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.parallel_residual = cfg.gpt_j_residual
        self.input_layernorm = make_norm(cfg)
        self.post_attention_layernorm = make_norm(cfg)
        self.attention = SelfAttention(cfg)
        self.mlp = MLP(cfg)
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                kv: LayerCache | None = None) -> torch.Tensor:
        attn = self.dropout(self.attention(self.input_layernorm(x), rope, kv))
        if self.parallel_residual:
            return x + attn + self.dropout(self.mlp(self.post_attention_layernorm(x)))
        x = x + attn
        return x + self.dropout(self.mlp(self.post_attention_layernorm(x)))


class OutputHead(nn.Module):
    """Last unit: final norm and the projection to vocabulary logits (no bias, as HF)."""

    def __init__(self, cfg: ModelConfig, vocab_size: int):
        super().__init__()
        self.final_layer_norm = make_norm(cfg)
        self.embed_out = nn.Linear(cfg.hidden_size, vocab_size, bias=False)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """The logits; with ``labels``, the mean cross entropy instead, chunk by chunk (no logits)."""
        if labels is None:
            return self.embed_out(self.final_layer_norm(x))
        return linear_cross_entropy(self.final_layer_norm(x), self.embed_out.weight, labels)


# ---------------------------------------------------------------------------------------------------
# Selective recompute (recompute_granularity: selective)
# ---------------------------------------------------------------------------------------------------

def _matmul_and_attention_ops() -> frozenset:
    """The aten ops that do a block's FLOPs: its four projections (``addmm``, or ``mm`` without a
    bias) and SDPA's fused kernels, whichever this build has. SDPA's math fallback (a mask, or no
    fused kernel) decomposes into ``bmm`` and softmax: left out, so it is recomputed rather than
    keeping its [T, T] scores."""
    names = ("mm", "addmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
    return frozenset(getattr(torch.ops.aten, name).default for name in names if hasattr(torch.ops.aten, name))


_KEPT_OPS = _matmul_and_attention_ops()


def _keep_if_matmul_or_attention(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    # The same decision in forward and in the recompute: torch then hands the recompute the kept
    # outputs in the order forward made them.
    return CheckpointPolicy.MUST_SAVE if op in _KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE


# checkpoint(context_fn=...) calls it once per checkpointed call, for fresh caching contexts.
keep_matmuls_and_attention = functools.partial(create_selective_checkpoint_contexts, _keep_if_matmul_or_attention)


# ---------------------------------------------------------------------------------------------------
# Initialisation (NeoX's methods)
# ---------------------------------------------------------------------------------------------------

def init_std(method: str, cfg: ModelConfig) -> float | None:
    """Standard deviation of a normal init method; None for the xavier methods (shape dependent)."""
    h, layers = cfg.hidden_size, cfg.num_layers
    stds = {
        "normal": cfg.init_method_std,
        "scaled_normal": cfg.init_method_std / math.sqrt(2.0 * layers),
        "small_init": math.sqrt(2.0 / (5.0 * h)),  # Nguyen & Salazar (2019)
        "wang_init": 2.0 / (layers * math.sqrt(h)),  # Wang (2021), used by GPT-J / NeoX
    }
    if method in stds:
        return stds[method]
    if method in ("xavier_normal", "xavier_uniform"):
        return None
    raise ModelConfigError(f"model config: init method '{method}' is unknown; choose one of {', '.join(INIT_METHODS)}")


def init_function(method: str, cfg: ModelConfig) -> Callable[[torch.Tensor], None]:
    """An in-place initialiser for a weight matrix, drawing from the default torch RNG."""
    std = init_std(method, cfg)
    if method == "xavier_normal":
        return nn.init.xavier_normal_
    if method == "xavier_uniform":
        return nn.init.xavier_uniform_
    return lambda weight: nn.init.normal_(weight, mean=0.0, std=std)


# ---------------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------------

class GPTNeoX(nn.Module):
    """GPT-NeoX causal language model: ``forward(tokens [B, T]) -> logits [B, T, V]``."""

    def __init__(self, model_cfg: ModelConfig, vocab_size: int | None = None):
        super().__init__()
        # The weights depend only on the RNG state at entry: the submodules' own default init draws
        # are undone before init_weights, so a model built on the meta device and initialised one
        # unit at a time (init_parameters, in unit order) gets exactly the same weights.
        rng_at_entry = torch.random.get_rng_state()
        vocab_size = vocab_size if vocab_size is not None else model_cfg.padded_vocab_size
        validate_model_config(model_cfg, vocab_size)
        self.config = model_cfg
        self.vocab_size = vocab_size
        self.checkpoint_activations = model_cfg.checkpoint_activations
        h = model_cfg.hidden_size

        self.embed = Embedding(vocab_size, h, model_cfg.hidden_dropout)
        self.layers = nn.ModuleList(Block(model_cfg) for _ in range(model_cfg.num_layers))
        self.final = OutputHead(model_cfg, vocab_size)
        if not model_cfg.no_weight_tying:
            self.final.embed_out.weight = self.embed.embed_in.weight

        cos, sin = rotary_tables(rotary_dims(model_cfg), max_positions(model_cfg), model_cfg.rotary_emb_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        torch.random.set_rng_state(rng_at_entry)
        self.init_weights()

    @property
    def has_tied_embeddings(self) -> bool:
        """True when the output layer reuses the input embedding's weight (shared across two units)."""
        return self.final.embed_out.weight is self.embed.embed_in.weight

    def units(self) -> list[nn.Module]:
        """The modules the engine shards, in forward order: [embed, *layers, final]."""
        return [self.embed, *self.layers, self.final]

    def init_weights(self) -> None:
        """(Re)initialise every parameter as NeoX does, and the rotary tables; deterministic under
        ``torch.manual_seed``. Equal to ``init_parameters`` over the units in order (the engine's
        one-unit-at-a-time build), because parameters are registered in unit order."""
        self.init_parameters(self.named_parameters())  # deduplicated: a tied weight is drawn once
        self.init_buffers()

    @torch.no_grad()
    def init_parameters(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """NeoX's init for (full name, parameter) pairs, drawing from the default RNG in the given order."""
        cfg = self.config
        init_in = init_function(cfg.init_method, cfg)
        init_out = init_function(cfg.output_layer_init_method, cfg)
        for name, param in named:
            if param.is_meta:  # nothing to draw (and no RNG consumed): materialised and drawn later
                continue
            if ("layernorm" in name or "layer_norm" in name) and name.endswith("weight"):
                nn.init.ones_(param)
            elif name.endswith("bias"):
                nn.init.zeros_(param)
            elif name.endswith(OUTPUT_SIDE_WEIGHTS):
                init_out(param)
            else:
                init_in(param)

    @torch.no_grad()
    def init_buffers(self) -> None:
        """The rotary tables (also for a model built on the meta device and moved with ``to_empty``)."""
        cfg = self.config
        cos, sin = rotary_tables(rotary_dims(cfg), max_positions(cfg), cfg.rotary_emb_base)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of every position of ``tokens``; with a ``cache`` (megatron/model/kv_cache.py) the
        tokens continue the cached positions, whose keys and values are reused, and join the cache.
        With ``labels`` (training, no cache): the mean next-token cross entropy, computed by the head
        without materialising the logits (megatron/model/fused_cross_entropy.py)."""
        if labels is not None and cache is not None:
            raise ValueError("labels (the fused loss) and a KV cache (generation) do not go together")
        seq = tokens.shape[1]
        start = 0 if cache is None else cache.length
        if start + seq > self.rope_cos.shape[0]:
            raise ModelConfigError(
                f"model: sequence of {start + seq} tokens exceeds max_position_embeddings ({self.rope_cos.shape[0]})")
        h = self.embed(tokens)
        if cache is not None:
            cache.check_room(seq)
            rope = (self.rope_cos[start:start + seq].to(h.dtype), self.rope_sin[start:start + seq].to(h.dtype))
            for block, layer_cache in zip(self.layers, cache.layers):
                h = block(h, rope, layer_cache)
            cache.advance(seq)
            return self.final(h)
        rope = (self.rope_cos[:seq].to(h.dtype), self.rope_sin[:seq].to(h.dtype))
        if self.checkpoint_activations and torch.is_grad_enabled():
            # Early stop off: the recompute in backward runs the whole block's __call__, so the
            # engine's pre- AND post-forward hooks fire again (gather, then free) for every block.
            selective = self.config.recompute_granularity == "selective"
            policy = {"context_fn": keep_matmuls_and_attention} if selective else {}
            with set_checkpoint_early_stop(False):
                for block in self.layers:
                    h = checkpoint(block, h, rope, use_reentrant=False, **policy)
        else:
            for block in self.layers:
                h = block(h, rope)
        return self.final(h, labels)
