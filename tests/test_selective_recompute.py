"""recompute_granularity: selective (megatron/model/gpt_neox.py): a checkpointed block keeps its
matmuls' and attention's outputs and recomputes only what lies between them.

Checked against what actually runs: the aten ops of backward, counted by a dispatch mode (full
recompute runs every projection and attention again, selective none of them, both the LayerNorms
and GELU), and the gradients of the model without checkpointing (equal, dropout included). The
memory it saves is measured in tests/test_memory_single_process.py; the sharded engine's trajectory
and bytes in tests/test_engine_dist.py.
"""
from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.config.schema import ModelConfig
from megatron.model.gpt_neox import GPTNeoX, ModelConfigError
from megatron.model.sizes import backward_activation_bytes

LAYERS, VOCAB = 3, 96
SHAPE = dict(num_layers=LAYERS, hidden_size=32, num_attention_heads=4, seq_length=16, no_weight_tying=True)


class OpCounter(TorchDispatchMode):
    """Counts each aten op that runs while it is active."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def build(seed: int = 0, **overrides) -> GPTNeoX:
    torch.manual_seed(seed)
    return GPTNeoX(ModelConfig(**SHAPE, **overrides), VOCAB)


def tokens(batch: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, SHAPE["seq_length"]), generator=torch.Generator().manual_seed(1))


def backward_ops(dtype: torch.dtype, **overrides) -> collections.Counter:
    model = build(**overrides)
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        loss = model(tokens()).float().square().mean()
    with OpCounter() as counter:
        loss.backward()
    return counter.counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selective_recomputes_no_matmul_and_no_attention(dtype):
    plain = backward_ops(dtype)
    full = backward_ops(dtype, checkpoint_activations=True)
    selective = backward_ops(dtype, checkpoint_activations=True, recompute_granularity="selective")
    attention = [op for op in full if op.startswith("_scaled_dot_product") and not op.endswith("_backward")]
    # Full recompute: every block's four biased projections and its attention run again in backward.
    assert full["addmm"] == 4 * LAYERS and sum(full[op] for op in attention) == LAYERS, full
    assert plain["addmm"] == 0 and not any(plain[op] for op in attention), plain
    # Selective: none of them, and the gradient matmuls are exactly those of no checkpointing...
    assert selective["addmm"] == 0 and not any(selective[op] for op in attention), selective
    assert selective["mm"] == plain["mm"]
    # ...but the LayerNorms (two per block) and GELU are recomputed, as under full recompute.
    assert selective["native_layer_norm"] == full["native_layer_norm"] == 2 * LAYERS
    assert selective["gelu"] == full["gelu"] == LAYERS
    assert plain["native_layer_norm"] == 0 and plain["gelu"] == 0


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_selective_gradients_equal_no_checkpointing(dropout):
    """Same loss and gradients bit for bit in fp32: the kept outputs are the forward's own, and the
    recompute replays the forward's RNG, so dropout masks agree."""
    results = []
    for overrides in ({}, {"checkpoint_activations": True, "recompute_granularity": "selective"}):
        model = build(hidden_dropout=dropout, attention_dropout=dropout, **overrides).train()
        torch.manual_seed(7)
        loss = model(tokens()).square().mean()
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))


def test_selective_needs_checkpointing():
    with pytest.raises(ModelConfigError, match="checkpoint_activations is off"):
        build(recompute_granularity="selective")


def test_backward_activations_by_hand():
    """sizes.backward_activation_bytes for SHAPE's model at micro-batch 2 in fp32: T = 32 tokens,
    h = 32, I = 128, V = 96, L = 3. A block's full share (12h + 2I) T x 4 = 81920, the head's
    2Th x 4 + 3TV x 4 = 45056, a block backward's first gradients (h + I) T x 4 = 20480."""
    T, h, inner, layers = 32, 32, 128, LAYERS
    block, head, grads = (12 * h + 2 * inner) * T * 4, 2 * T * h * 4 + 3 * T * VOCAB * 4, (h + inner) * T * 4
    assert (block, head, grads) == (81920, 45056, 20480)
    expected = {  # (start of backward, in the first block's backward)
        "none": (layers * block + head, layers * block + grads),
        "full": (layers * T * h * 4 + head, layers * T * h * 4 + block + grads),
        "selective": (layers * (7 * h + inner) * T * 4 + head, layers * (7 * h + inner) * T * 4 + (5 * h + inner) * T * 4 + grads),
    }
    overrides = {"none": {}, "full": {"checkpoint_activations": True},
                 "selective": {"checkpoint_activations": True, "recompute_granularity": "selective"}}
    for mode, want in expected.items():
        got = backward_activation_bytes(ModelConfig(**SHAPE, **overrides[mode]), VOCAB, 2, 4)
        assert tuple(got) == want, mode
