"""Parameter counts and FLOPs of the GPT-NeoX model, from its configuration alone.

These are pure arithmetic on ``ModelConfig`` so that planners and throughput logging can size a 20B
model without building it; a test checks them against a built ``GPTNeoX``.
"""
from __future__ import annotations

from typing import NamedTuple

from torch import nn

from megatron.config.schema import ModelConfig
from megatron.model.fused_cross_entropy import chunk_rows_for
from megatron.config.model_shape import gated, head_dim, kv_heads, mlp_widths, qkv_rows


def unit_parameter_counts(model_cfg: ModelConfig, vocab_size: int) -> list[int]:
    """Parameters of each unit in forward order ``[embed, *layers, final]``.

    With tied embeddings the shared matrix is counted once, in the embedding unit; the final unit
    then holds only its norm.
    """
    h, v = model_cfg.hidden_size, vocab_size
    norm = _norm_parameters(model_cfg)
    block = 2 * norm + block_linear_parameters(model_cfg)  # + input and post-attention norms
    final = norm + (v * h if model_cfg.no_weight_tying else 0)
    return [v * h] + [block] * model_cfg.num_layers + [final]


def _norm_parameters(model_cfg: ModelConfig) -> int:
    """LayerNorm: weight and bias; RMSNorm: a weight only."""
    return model_cfg.hidden_size * (1 if model_cfg.norm == "rmsnorm" else 2)


def _block_linears(model_cfg: ModelConfig) -> list[tuple[str, int, int, bool]]:
    """One block's four nn.Linear layers as (name, out, in, has bias), in registration order."""
    h, mlp = model_cfg.hidden_size, mlp_widths(model_cfg)
    attn_bias, mlp_bias = model_cfg.use_bias_in_attn_linear, model_cfg.use_bias_in_mlp
    return [("attention.query_key_value", qkv_rows(model_cfg), h, attn_bias),  # Q, and K and V of kv heads
            ("attention.dense", h, h, attn_bias),
            ("mlp.dense_h_to_4h", mlp.in_rows, h, mlp_bias),                   # [up | gate] when gated
            ("mlp.dense_4h_to_h", h, mlp.inner, mlp_bias)]


def block_linear_parameters(model_cfg: ModelConfig) -> int:
    """Weights and biases of one block's four nn.Linear layers (its parameters but the norms)."""
    return sum(out * inp + (out if bias else 0) for _, out, inp, bias in _block_linears(model_cfg))


def unit_parameter_shapes(model_cfg: ModelConfig, vocab_size: int) -> list[list[tuple[str, tuple]]]:
    """Each unit's parameters as (name within the unit, shape), in ``named_parameters()`` order (the
    order the engine flattens them and DeepSpeed registers them); the counts of
    ``unit_parameter_counts`` unit by unit."""
    h, v = model_cfg.hidden_size, vocab_size
    rms = model_cfg.norm == "rmsnorm"
    norm = lambda name: [(f"{name}.weight", (h,))] + ([] if rms else [(f"{name}.bias", (h,))])  # noqa: E731
    linears = []
    for name, out, inp, bias in _block_linears(model_cfg):
        linears += [(f"{name}.weight", (out, inp))] + ([(f"{name}.bias", (out,))] if bias else [])
    block = norm("input_layernorm") + norm("post_attention_layernorm") + linears
    final = norm("final_layer_norm") + ([("embed_out.weight", (v, h))] if model_cfg.no_weight_tying else [])
    return [[("embed_in.weight", (v, h))]] + [list(block) for _ in range(model_cfg.num_layers)] + [final]


def parameter_count(model_cfg: ModelConfig, vocab_size: int) -> int:
    """Total distinct parameters of the model (a tied embedding counted once)."""
    return sum(unit_parameter_counts(model_cfg, vocab_size))


def num_parameters(model: nn.Module) -> int:
    """Distinct parameters of a built module (``parameters()`` already skips a shared tensor)."""
    return sum(p.numel() for p in model.parameters())


def attention_span(model_cfg: ModelConfig, seq_length: int | None = None) -> int:
    """Keys a query is counted against: the sequence, or a sliding window's w + 1 when shorter."""
    s = model_cfg.seq_length if seq_length is None else seq_length
    window = model_cfg.sliding_window_width
    return s if window is None else min(s, window + 1)


def unit_flops_per_token(model_cfg: ModelConfig, vocab_size: int, seq_length: int | None = None) -> tuple:
    """Forward model FLOPs per token of each unit, in forward order ``(embed, *blocks, final)``: the
    one FLOP formula of the project (the training log's TFLOPS and MFU, the step-time model's compute,
    bench/gpu_throughput.py all read it). Model FLOPs: recomputation under activation checkpointing
    is not counted, the causal mask is not discounted, biases / norms / softmax / the SwiGLU product
    are neglected:

        block   2 * h * (Q + K + V + h + R + I)  (QKV rows Q+K+V = h + 2 kv_heads d, attention out,
                                                  MLP in of R rows, MLP out from I: 3h^2 + h^2 + 2hI
                                                  for NeoX-20B's shape, 3 matrices of I with SwiGLU)
                + 2 * 2 * a * h                  (QK^T and attention x V over a keys: every query head
                                                  reads a keys whatever the K/V heads; a = seq_length,
                                                  or w + 1 with a sliding window of w)
        final   2 * hV                           (the output layer)
        embed   0                                (a lookup, not a matmul)

    ``seq_length`` (the attention span) defaults to the model's."""
    h, layers = model_cfg.hidden_size, model_cfg.num_layers
    matmul = sum(out * inp for _, out, inp, _ in _block_linears(model_cfg))
    block = 2 * matmul + 2 * (2 * attention_span(model_cfg, seq_length) * h)
    return (0.0,) + (float(block),) * layers + (float(2 * h * vocab_size),)


def model_flops_per_token(model_cfg: ModelConfig, vocab_size: int, seq_length: int | None = None) -> float:
    """Training FLOPs (forward + backward) per token: 3x the forward of ``unit_flops_per_token`` (the
    backward costs twice the forward). This is the familiar ``6N + 12 L h s`` with N the matmul
    weights (the input embedding excluded), the quantity TFLOPS and MFU are reported in (with a
    sliding window, s is the window's span)."""
    return 3.0 * sum(unit_flops_per_token(model_cfg, vocab_size, seq_length))


class BackwardActivations(NamedTuple):
    """One micro-batch's activation bytes at the two moments that can make the step's peak."""
    start: int
    """The start of backward: every block's share and the head's (its backward holds the most)."""
    during: int
    """The first block's backward, the head's share freed: every block's share, what the block
    recomputes, and the gradients its backward starts with. Gradient reductions are in flight from
    here on (the memory model adds them to this moment only)."""


def backward_activation_bytes(model_cfg: ModelConfig, vocab_size: int, micro_batch: int, elem_bytes: int,
                              fused_cross_entropy: bool = False) -> BackwardActivations:
    """Bytes autograd holds for one micro-batch at the start of backward and in the first block's
    backward (``BackwardActivations``).

    Counted from the model's forward (gpt_neox.py), per block for T = micro_batch x seq tokens:
    the block input and both LayerNorm outputs (3 Th), the QKV output (3 Th), rotary's inputs and
    outputs for q and k (4 Th), attention's output and the dense layer's input copy (2 Th), the MLP's
    two intermediate tensors (2 TI): (12 h + 2 I) T elements. Under activation checkpointing a block
    keeps only its input (T h) and one block is recomputed at a time, after the head's backward has
    freed the head's share; the recomputed block's backward starts with the gradients of its output
    and of the MLP's wide input ((h + I) T), as does a block's backward without checkpointing. Under
    ``recompute_granularity: selective`` a block keeps its input and the outputs of its matmuls and
    attention: the QKV output (3 Th), attention's, the two projections back to h (3 Th) and the MLP's
    wide one (TI), (7 h + I) T; its recompute makes the rest, the LayerNorm outputs (2 Th), the rotated
    q and k (2 Th), the dense layer's input copy (Th) and GELU's output (TI), (5 h + I) T (rotary's
    inputs are views of the QKV output: no bytes of their own). The head
    keeps the final LayerNorm's input and output (2 Th) and, in fp32 whatever the compute dtype, the logits, their
    log-softmax and, during backward, their gradient (3 TV).

    With ``fused_cross_entropy`` the head keeps instead the LayerNorm's input and the hidden
    gradient (2 Th) and the head's gradient in fp32 (4 Vh bytes); at its largest moment it also
    holds a Vh product (a chunk's share of the head's gradient in forward, the scaled gradient in
    backward) and either one chunk of c rows (fp32 softmax, c V) or, in backward, the scaled hidden
    gradient (Th), whichever is larger, each in fp32 plus, below fp32, its compute-dtype copy:
    (Vh + max(cV, Th)) x (4 + e) bytes (x 4 in fp32).

    The figures above are NeoX-20B's shape (QKV rows 3h, MLP rows I, GELU). In general, with Q = QKV
    rows (h + 2 kv, kv = num_kv_heads x head_dim), R the MLP's wide rows and A what follows them
    (GELU: R; SwiGLU: silu(gate) and the product, 2 x inner): a block keeps (3h + Q + 2 (h + kv) + 2h
    + R + A) T, selective keeps (4h + Q + R) T and recomputes (4h + kv + A) T, and a block's backward
    starts with (h + R) T. RMSNorm adds its fp32 tensors (``_rms_norm_extra_bytes``) to what a block
    keeps and recomputes; a sliding window with grouped-query attention adds K and V copied out to
    every query head (2 Th).
    """
    h, layers = model_cfg.hidden_size, model_cfg.num_layers
    mlp, kv = mlp_widths(model_cfg), kv_heads(model_cfg) * head_dim(model_cfg)
    # After the wide projection: GELU's output (I), or SwiGLU's silu(gate) and product (2 x inner).
    activation = 2 * mlp.inner if gated(model_cfg) else mlp.in_rows
    tokens = micro_batch * model_cfg.seq_length
    # A window with grouped-query attention copies K and V out to every query head (gpt_neox.py).
    expanded = 2 * h if model_cfg.sliding_window_width is not None and kv < h else 0
    per_token = (3 * h + qkv_rows(model_cfg) + 2 * (h + kv) + 2 * h + mlp.in_rows + activation + expanded)
    norms = _rms_norm_extra_bytes(model_cfg, tokens, elem_bytes)
    block = per_token * tokens * elem_bytes + norms
    head = head_activation_bytes(tokens, h, vocab_size, elem_bytes, fused_cross_entropy)
    grads = (h + mlp.in_rows) * tokens * elem_bytes  # a block's output and MLP-input gradients
    if model_cfg.checkpoint_activations and model_cfg.recompute_granularity == "selective":
        kept = (4 * h + qkv_rows(model_cfg) + mlp.in_rows) * tokens * elem_bytes
        recomputed = (2 * h + (h + kv) + h + activation + expanded) * tokens * elem_bytes + norms
    elif model_cfg.checkpoint_activations:
        kept, recomputed = tokens * h * elem_bytes, block
    else:
        kept, recomputed = block, 0
    return BackwardActivations(layers * kept + head, layers * kept + recomputed + grads)


def _rms_norm_extra_bytes(model_cfg: ModelConfig, tokens: int, elem_bytes: int) -> int:
    """What a block's two RMSNorms keep beyond their outputs: each its fp32 normalised input (T h x 4
    bytes) and, below fp32, its fp32 copy of the input too (megatron/model/gpt_neox.py RMSNorm)."""
    if model_cfg.norm != "rmsnorm":
        return 0
    return 2 * tokens * model_cfg.hidden_size * 4 * (1 if elem_bytes >= 4 else 2)


def autocast_copy_bytes(model_cfg: ModelConfig, vocab_size: int, elem_bytes: int,
                        fused_cross_entropy: bool = False) -> int:
    """One process under autocast (fp32 weights, a compute dtype of ``elem_bytes`` < 4): the
    compute-dtype copies autocast makes of the weights and biases its matmuls read, at the start of
    backward. nn.Linear keeps its cast weight for backward, so every block's four projections and the
    output head's V x h are held at once. A checkpointed block keeps none; its recompute casts again,
    one block at a time (one block's copies). The fused head casts its weight itself and keeps no copy.
    0 in fp32, and for the sharded engine, whose gathered weights are already in the compute dtype."""
    if elem_bytes >= 4:
        return 0
    block = block_linear_parameters(model_cfg)
    blocks = block if model_cfg.checkpoint_activations else model_cfg.num_layers * block
    head = 0 if fused_cross_entropy else vocab_size * model_cfg.hidden_size
    return (blocks + head) * elem_bytes


def head_activation_bytes(tokens: int, hidden_size: int, vocab_size: int, elem_bytes: int,
                          fused_cross_entropy: bool) -> int:
    """The output head's share of ``backward_activation_bytes`` (its docstring says what is counted)."""
    t, h, v, e = tokens, hidden_size, vocab_size, elem_bytes
    if not fused_cross_entropy:
        return 2 * t * h * e + 3 * t * v * 4
    chunk = min(chunk_rows_for(v), t)
    copy = 0 if e == 4 else e  # in fp32 the casts to and from the softmax's dtype are no copies
    return 2 * t * h * e + 4 * v * h + (v * h + max(chunk * v, t * h)) * (4 + copy)
