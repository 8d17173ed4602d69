"""The output layer and its cross entropy, chunk by chunk: the [tokens, vocab] logits never exist whole.

The plain head (``OutputHead`` then ``cross_entropy(logits.float())``) keeps, per micro-batch of T
tokens and a vocabulary of V, the logits in fp32 and their log-softmax for backward, and makes
their gradient there: 3 x T x V x 4 bytes, 9.9 GB at the 1.01B shape of docs/gpu.md (T = 16,384,
V = 50,432), more than the whole model's weights. Here the tokens go through in chunks of
``chunk_rows``: each chunk's logits (compute dtype, then fp32), its log-sum-exp and loss, and at
once its gradients, ``grad_hidden = (softmax - onehot) @ W`` and ``grad_weight += (softmax -
onehot)^T @ h``. Backward has nothing left to compute but a scale. What is kept: grad_hidden (T x h,
compute dtype) and grad_weight (V x h, fp32), and while a chunk runs, its logits and softmax.

The gradients are kept unscaled (per-token sums, not divided by the token count) and scaled in
backward by ``grad_output / count``, in fp32: fp16's loss scale applies there as in the plain path,
and the compute-dtype terms are not first divided by the token count (1/16,384 at that shape).

Exact to the plain path up to summation order: the same matmuls in the same dtype, the softmax in
fp32 (tests/test_fused_cross_entropy.py). The matmul FLOPs are the same (logits, and the two
gradient products of backward, moved into forward).
"""
from __future__ import annotations

import torch

IGNORE_INDEX = -100  # torch.nn.functional.cross_entropy's default: such labels count nowhere
CHUNK_ELEMENTS = 1 << 24  # logits per chunk: 64 MiB in fp32, whatever the vocabulary


def chunk_rows_for(vocab_size: int) -> int:
    """Tokens per chunk: a multiple of 64 (whole tiles for the matmuls) near CHUNK_ELEMENTS / V."""
    return max(64, (CHUNK_ELEMENTS // vocab_size) // 64 * 64)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_rows: int):
        counted = labels != IGNORE_INDEX
        count = counted.sum()
        targets = torch.where(counted, labels, 0)[:, None]
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        wide = torch.promote_types(hidden.dtype, torch.float32)  # the softmax's dtype: fp32, or fp64
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=wide, device=weight.device) if want_weight else None
        total = torch.zeros((), dtype=wide, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            h, keep = hidden[rows], counted[rows]
            logits = (h @ weight.t()).to(wide)
            picked = logits.gather(1, targets[rows]).squeeze(1)
            # log-sum-exp by hand, in the logits' own storage (torch.logsumexp takes a chunk-sized
            # temporary): exp(logit - max), its row sums, then the softmax by one division.
            peak = logits.amax(dim=-1, keepdim=True)
            probs = logits.sub_(peak).exp_()
            sums = probs.sum(dim=-1, keepdim=True)
            total += ((peak + sums.log()).squeeze(1) - picked).mul_(keep).sum()
            if want_hidden or want_weight:
                probs.div_(sums)
                probs.scatter_add_(1, targets[rows], -torch.ones_like(probs[:, :1]))
                probs.mul_(keep[:, None])  # ignored tokens give no gradient
                delta = probs.to(hidden.dtype)
                if want_hidden:
                    grad_hidden[rows] = delta @ weight
                if want_weight:
                    grad_weight += (delta.t() @ h).to(wide)
                del delta
            del logits, probs  # before the next chunk's logits exist: one chunk at a time
        ctx.weight_dtype = weight.dtype
        ctx.save_for_backward(grad_hidden, grad_weight, count)
        return total / count

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight, count = ctx.saved_tensors
        scale = grad_output / count
        # In fp32, then one rounding: a scale rounded to bf16 would bias every element alike.
        return (None if grad_hidden is None else (grad_hidden.to(scale.dtype) * scale).to(grad_hidden.dtype),
                None if grad_weight is None else (grad_weight * scale).to(ctx.weight_dtype),
                None, None)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         chunk_rows: int | None = None) -> torch.Tensor:
    """Mean cross entropy of ``hidden @ weight.T`` against ``labels`` (ignoring IGNORE_INDEX), as
    ``cross_entropy((hidden @ weight.T).float(), labels)`` gives it, without the whole logits.

    hidden: [..., h]; weight: [V, h]; labels: hidden's leading shape. Under autocast both inputs are
    cast to its dtype first (as nn.Linear's would be), and the chunks run outside autocast.
    """
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    rows = chunk_rows or chunk_rows_for(weight.shape[0])
    with torch.autocast(device, enabled=False):
        return _LinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), rows)
